"""Every run_<axis> in course_lib.parallel takes one signature, run_<axis>(dims, model_config,
train_cfg, **options), with dims a course_lib.dims.ParallelDims, and refuses a layout it cannot
run with a ValueError naming the value and the rule, in the parent, before any rank starts.

A runner is found, not listed: a module-level function named run_* in course_lib/parallel whose
body calls run_on_ranks (it starts ranks); run_schedule and run_local_experts run inside a rank
and are not runners. A new runner must appear in OUTSIDE below, or the coverage test fails."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

import course_lib.parallel
from course_lib.dims import ParallelDims
from course_lib.model import GPTConfig
from course_lib.train import TrainConfig

PARALLEL = pathlib.Path(course_lib.parallel.__file__).parent


def _starts_ranks(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "run_on_ranks"
               for n in ast.walk(fn))


def runners() -> dict[str, tuple[str, str]]:
    """{name: (module, name)} of every run_* function in course_lib/parallel that starts ranks."""
    out = {}
    for path in sorted(PARALLEL.rglob("*.py")):
        module = "course_lib." + ".".join(path.relative_to(PARALLEL.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("run_") and _starts_ranks(node):
                out[node.name] = (module, node.name)
    return out


RUNNERS = runners()

# A layout each runner cannot run, and the words its refusal must contain (the value and the rule).
OUTSIDE = {
    "run_tensor_parallel": (ParallelDims(tp=2, pp=2), "pp=2: run_tensor_parallel runs tp, sequence_parallel only"),
    "run_pipeline": (ParallelDims(pp=2, tp=2), "tp=2: run_pipeline runs pp, schedule, microbatches"),
    "run_native": (ParallelDims(pp=2, dp=2), "dp=2: run_native runs pp, schedule, microbatches"),
    "run_ours_and_native": (ParallelDims(pp=2, zero=1), "zero=1: run_ours_and_native runs pp, schedule"),
    "run_2bw": (ParallelDims(pp=2, schedule="pipedream_2bw", microbatches=2, virtual_stages=2),
                "virtual_stages=2: run_2bw runs pp, schedule, microbatches only"),
    "run_expert_parallel": (ParallelDims(ep=2, cp=2), "cp=2: run_expert_parallel runs ep, dp only"),
    "run_context_parallel": (ParallelDims(cp=2, pp=2), "pp=2: run_context_parallel runs cp, dp, cp_method"),
    "run_data_parallel": (ParallelDims(dp=2, microbatches=2), "microbatches=2: run_data_parallel runs dp only"),
    "run_zero": (ParallelDims(dp=2, zero=1, tp=2), "tp=2: run_zero runs dp, zero only"),
    "run_native_fsdp_tp": (ParallelDims(dp=2, tp=2, zero=3, ep=2), "ep=2: run_native_fsdp_tp runs dp, tp"),
    "run_diloco": (ParallelDims(dp=2, tp=2), "tp=2: run_diloco runs dp only"),
    # run_hybrid composes every axis: what it refuses is what the composed runtime cannot compose
    "run_hybrid": (ParallelDims(pp=2, schedule="zbv", virtual_stages=2), "schedule='zbv' with pp=2"),
}

MODEL = GPTConfig.tiny(97, n_layer=4)  # valid for every layout above: rules other than the axis's pass
TRAIN = TrainConfig(steps=1, batch_size=8, progress=False)


def _load(name):
    module, attr = RUNNERS[name]
    return importlib.import_module(module), getattr(importlib.import_module(module), attr)


def test_the_runners_are_found_and_each_has_a_refused_layout():
    # the nine axis runners the course has, and run_hybrid; a missing one means discovery broke
    assert {"run_tensor_parallel", "run_pipeline", "run_native", "run_ours_and_native", "run_2bw",
            "run_expert_parallel", "run_context_parallel", "run_data_parallel", "run_zero",
            "run_native_fsdp_tp", "run_hybrid"} <= set(RUNNERS)
    assert set(RUNNERS) == set(OUTSIDE), "a new run_<axis> needs its refused layout in OUTSIDE"


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_first_three_parameters_are_dims_model_config_train_cfg(name):
    _, fn = _load(name)
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:3]] == ["dims", "model_config", "train_cfg"], name
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params[:3]), name
    assert params[0].annotation in (ParallelDims, "ParallelDims"), name
    # everything after them is an option with a default (or **kwargs): nothing else is positional and required
    assert all(p.default is not p.empty or p.kind is p.VAR_KEYWORD for p in params[3:]), name


def _no_ranks(monkeypatch, module):
    started = []
    monkeypatch.setattr(module, "run_on_ranks", lambda *a, **k: started.append(a) or pytest.fail("ranks started"))
    return started


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_a_layout_outside_the_axis_is_refused_before_any_rank_starts(name, monkeypatch):
    module, fn = _load(name)
    started = _no_ranks(monkeypatch, module)
    dims, words = OUTSIDE[name]
    with pytest.raises(ValueError) as err:
        fn(dims, MODEL, TRAIN)
    assert words in str(err.value), str(err.value)
    assert not started


@pytest.mark.parametrize("name", sorted(set(RUNNERS) - {"run_hybrid"}))
def test_an_int_for_dims_is_refused(name, monkeypatch):
    """The old first argument (world_size, tp or cp as an int) names the type it needs."""
    module, fn = _load(name)
    started = _no_ranks(monkeypatch, module)
    with pytest.raises(ValueError, match=r"dims=2 must be a course_lib.dims.ParallelDims"):
        fn(2, MODEL, TRAIN)
    assert not started
