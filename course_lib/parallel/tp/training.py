"""The reference training loop (course_lib.train), tensor parallel.

Every rank of the tensor-parallel group reads the same batch (the reference's: a generator
seeded with train_cfg.seed), builds the same GPT(config, seed), keeps its shards and runs
`train_step`. The loss is the single-process loss on every rank, each shard's gradient is the
matching slice of the single-process gradient, and clipping uses the global norm, so a plain
AdamW on each rank trains the same model as `train_reference`.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.dims import ParallelDims, check_runner
from course_lib.model import GPT
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.tp.apply import (apply_tensor_parallel, check_tensor_parallel, clip_grad_norm_, gather_full_gradients,
                                         gather_full_state_dict)
from course_lib.parallel.tp.dtensor import apply_dtensor_tensor_parallel, clip_grad_norm_dtensor
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainResult, flat_grads, flat_params, make_optimizer, train_loop

IMPLS = ("course", "dtensor")
AXES = ("tp", "sequence_parallel")  # the ParallelDims fields run_tensor_parallel runs


def _check_run(impl, config, train_cfg, tp, sequence_parallel):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    check_tensor_parallel(config, tp, sequence_parallel, config.block_size)


@contextlib.contextmanager
def _dtensor_counter(counts: dict):
    """Add the functional collectives DTensor ran in the block to counts ({op name: calls}).
    One CommDebugMode per step: its module tracking does not survive being re-entered."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        yield
    for op, n in mode.get_comm_counts().items():
        name = getattr(op, "__name__", str(op)).split(".")[-1]
        counts[name] = counts.get(name, 0) + n


def train_tensor_parallel(model_config, train_cfg, sequence_parallel: bool = False, impl: str = "course",
                          group=None, trace: bool = False, record_timeline: bool = False,
                          async_tp: bool = False) -> TrainResult:
    """Rank code: train_cfg.steps steps of the tensor-parallel GPT on `group` (None: the world).

    impl "course" (apply_tensor_parallel) or "dtensor" (apply_dtensor_tensor_parallel).
    Returns a TrainResult: train_losses (the global loss, equal on every rank), step_seconds;
    for "course" also final_params / final_grads of the gathered single-process model (flat, in
    GPT.parameters() order); comm_summary with trace (CommTracer for "course", CommDebugMode's
    per-op counts for "dtensor"); timeline_events with record_timeline. async_tp (course impl, under
    sequence parallelism): apply_tensor_parallel's overlapped all-gathers and reduce-scatters.
    """
    tp = dist.get_world_size(group)
    _check_run(impl, model_config, train_cfg, tp, sequence_parallel)
    dev = rank_device()
    model = GPT(model_config, seed=train_cfg.seed).to(dev)
    if impl == "course":
        apply_tensor_parallel(model, group, sequence_parallel, async_tp=async_tp)
        clip = lambda c: clip_grad_norm_(model, c)  # noqa: E731
    elif async_tp:
        raise ValueError(f"async_tp=True runs the course layers (impl='course'), not impl={impl!r}")
    else:
        apply_dtensor_tensor_parallel(model, group, sequence_parallel)
        clip = lambda c: clip_grad_norm_dtensor(model, c)  # noqa: E731
    optimizer = make_optimizer(model, train_cfg)
    dataset = CharDataset("train", block_size=model_config.block_size)
    timeline = Timeline() if record_timeline else None
    dtensor_counts: dict[str, int] = {}
    result = TrainResult().set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    counted = trace and impl == "dtensor"  # DTensor's collectives run below the API CommTracer sees
    # every rank reads the whole batch (rows=None): the loss is the single process's on every rank
    train_loop(model, optimizer, dataset, train_cfg, StepHooks(clip_grad_norm=clip, timeline=timeline), device=dev,
               result=result, tracer=CommTracer(timeline=timeline) if (trace or record_timeline) else None,
               step_context=(lambda step: _dtensor_counter(dtensor_counts)) if counted else None)
    if impl == "course":
        full = GPT(model_config, seed=train_cfg.seed)
        full.load_state_dict({k: v.cpu() for k, v in gather_full_state_dict(model).items()})
        result.final_params = flat_params(full)
        for name, g in gather_full_gradients(model).items():
            full.get_parameter(name).grad = g.cpu()
        result.final_grads = flat_grads(full)
    elif trace:
        result.comm_summary = dtensor_counts  # CommDebugMode's per-op counts
    return result


def run_tensor_parallel(dims: ParallelDims, model_config, train_cfg, impl: str = "course", backend: str = "gloo",
                        timeout_s: float = 120, **kwargs) -> list[TrainResult]:
    """Parent side: validate (dims runs tp and sequence_parallel only; check_tensor_parallel and
    the rule book's check_model), then run train_tensor_parallel on dims.tp ranks."""
    check_runner(dims, "run_tensor_parallel", AXES)
    _check_run(impl, model_config, train_cfg, dims.tp, dims.sequence_parallel)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_tensor_parallel, model_config, train_cfg, dims.sequence_parallel, impl,
                        world_size=dims.tp, backend=backend, timeout_s=timeout_s, **kwargs)
