"""torch.compile per block under torch's DDP and FSDP2 (course_lib/techniques/compiled.py, notebook 03 §13).

One cold compile (an empty Inductor cache folder) on 2 gloo ranks serves both wrappers: compiled and
eager agree within fp32 rounding after one SGD step, far from what an unaveraged gradient moves, and
the replicas are bitwise equal. Skipped, with compile_unavailable()'s sentence, where no C++
compiler is found.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.model import GPT, GPTConfig
from course_lib.techniques import compiled
from course_lib.techniques.compiled import apply_compile, compile_unavailable, run_compiled_vs_eager

CONFIG = GPTConfig.tiny(97)


@pytest.fixture(scope="module")
def steps():
    reason = compile_unavailable()
    if reason is not None:
        pytest.skip(reason)
    return run_compiled_vs_eager(CONFIG, world_size=2, backend="gloo", check_collectives=False)


@pytest.mark.parametrize("i, kind", list(enumerate(compiled.KINDS)))
def test_compiled_step_equals_eager(steps, i, kind):
    for rank_steps in steps:
        s = rank_steps[i]
        assert s.kind == kind
        assert s.graphs >= 1  # the compiled model really went through torch.compile
        # Bounds: GRAD_RTOL (1e-4) of the largest gradient, the same fp32 sums in another order; lr
        # times it on the parameters plus the update's own rounding (compiled.py says why).
        assert s.max_grad_diff <= s.grad_atol, s
        assert s.max_param_diff <= s.param_atol, s
        assert abs(s.loss_compiled - s.loss_eager) <= 1e-5 * abs(s.loss_eager)  # ~4.6: sums reordered
        # The bound is meaningful: a gradient left unaveraged moves the parameters > 100x more.
        assert s.param_atol < s.max_param_diff_unaveraged / 100, s
    assert torch.equal(steps[0][i].params, steps[1][i].params)  # replicas: the same averaged/gathered numbers


def test_one_graph_serves_both_blocks(steps):
    # Regional compile: the second block reuses the first block's graph (same code, same shapes).
    assert CONFIG.n_layer == 2 and steps[0][0].graphs == 1


def test_apply_compile_marks_every_block_and_keeps_weights():
    model, plain = GPT(CONFIG), GPT(CONFIG)
    assert apply_compile(model) is model
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model._compiled_call_impl is None  # embeddings, head and loss stay eager
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)  # compile is lazy: nothing traced or changed yet


def test_no_compiler_is_said(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    reason = compile_unavailable()
    assert reason is not None and "no-such-compiler-xyz" in reason and "C++ compiler" in reason
    with pytest.raises(RuntimeError, match="no-such-compiler-xyz"):
        run_compiled_vs_eager(CONFIG)


def test_bad_kind():
    with pytest.raises(ValueError, match="kind='zero'"):
        run_compiled_vs_eager(CONFIG, kinds=("zero",))
