"""The same stages under PyTorch's own pipelining (torch.distributed.pipelining).

Each of our StageChunks is wrapped in a torch PipelineStage (stage index s = c*p + rank, the
same placement as ours) and driven by ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B.
torch's schedules compute loss_fn per micro-batch and divide the gradients by m
(scale_grads=True), which is our L = (1/m) sum_j L_j. The tied matrix is summed between the
first and last stage by the same PipelineStage.sum_tied_gradients.

zbv and dualpipev run under ScheduleZBVZeroBubble and ScheduleDualPipeV on the V placement
(stage indices r and 2p-1-r, as ours). There rank 0's two torch stages share the tied matrix, and
scale_grads would divide its gradient by m once per stage, m^2 in all: so the loss is divided by
m inside loss_fn instead (scale_grads=False), the same L = (1/m) sum_j L_j.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.data import CharDataset
from course_lib.dims import V_SCHEDULES, ParallelDims, check_runner, check_virtual_stages
from course_lib.model import GPT
from course_lib.parallel.pp.stage import build_stage
from course_lib.parallel.pp.training import AXES, PipelineResult, check_pipeline, clip_grad_norm_pipeline, train_pipeline
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, flat_grads, flat_params, make_optimizer, train_loop

NATIVE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")


def check_native(schedule: str, virtual_stages: int) -> None:
    if schedule not in NATIVE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {NATIVE_SCHEDULES} for torch.distributed.pipelining")
    check_virtual_stages(schedule, virtual_stages)  # the rule book's: 2 in a V, one unless interleaved
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise ValueError(f"virtual_stages={virtual_stages} does not fit schedule='interleaved_1f1b': torch's "
                         f"interleaved schedule needs virtual_stages >= 2")


def native_schedule(stage, schedule: str, n_microbatches: int):
    """A torch.distributed.pipelining schedule object driving `stage` (our PipelineStage)."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    vocab, scale = stage.vocab_size, (n_microbatches if schedule in V_SCHEDULES else 1)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)) / scale

    dev = next(stage.parameters()).device
    torch_stages = [TorchStage(chunk, stage.stage_of(c), stage.n_stages, dev, group=stage.group)
                    for c, chunk in enumerate(stage.chunks)]
    if schedule in V_SCHEDULES:
        cls = ScheduleZBVZeroBubble if schedule == "zbv" else ScheduleDualPipeV
        sched = cls(torch_stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        sched.loss_scale = scale
        return sched
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(torch_stages, n_microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(torch_stages[0], n_microbatches, loss_fn=loss_fn)


def native_forward_backward(stage, sched, idx, targets) -> float:
    """One step of torch's schedule; returns the mean micro-batch loss on every rank."""
    first, last = 0 in stage_ids(stage), stage.n_stages - 1 in stage_ids(stage)
    losses: list = []
    args = (idx,) if first else ()
    kwargs = {"target": targets, "losses": losses} if last else {}
    sched.step(*args, **kwargs)
    stage.sum_tied_gradients()
    scale = getattr(sched, "loss_scale", 1)  # V schedules: loss_fn returned L_j / m
    mean = torch.stack([x.detach() * scale for x in losses]).mean() if last else torch.zeros((), device=idx.device)
    dist.broadcast(mean, stage.global_rank_of_stage(stage.n_stages - 1), group=stage.group)
    return float(mean)


def stage_ids(stage) -> list[int]:
    return [stage.stage_of(c) for c in range(stage.virtual_stages)]


def train_native(model_config, train_cfg, schedule: str = "1f1b", n_microbatches: int = 4,
                 virtual_stages: int = 1, group=None) -> PipelineResult:
    """Rank code: train_pipeline's loop with torch.distributed.pipelining running the schedule."""
    check_native(schedule, virtual_stages)
    n = dist.get_world_size(group)
    check_pipeline(model_config, n, schedule, n_microbatches, train_cfg.batch_size, virtual_stages)
    dev = rank_device()
    dataset = CharDataset("train", block_size=model_config.block_size)
    placement = "v" if schedule in V_SCHEDULES else "loop"
    stage = build_stage(GPT(model_config, seed=train_cfg.seed).to(dev), group, virtual_stages, placement)
    sched = native_schedule(stage, schedule, n_microbatches)
    optimizer = make_optimizer(stage, train_cfg)
    result = PipelineResult(param_names=list(stage.param_names),
                            param_shapes=[tuple(p.shape) for p in stage.parameters()])
    hooks = StepHooks(forward_backward=lambda _s, x_, y_: native_forward_backward(stage, sched, x_, y_),
                      clip_grad_norm=lambda c: clip_grad_norm_pipeline(stage, c))
    train_loop(stage, optimizer, dataset, train_cfg, hooks, device=dev, result=result)
    result.final_params, result.final_grads = flat_params(stage), flat_grads(stage)  # this stage's, in its order
    return result


def _checked(dims: ParallelDims, model_config, train_cfg, runner: str) -> ParallelDims:
    """Parent side, before any rank starts: dims runs pp, schedule, microbatches and
    virtual_stages only; torch's schedules, ours, then the rule book's check_model."""
    check_runner(dims, runner, AXES)
    check_native(dims.schedule, dims.virtual_stages)
    check_pipeline(model_config, dims.pp, dims.schedule, dims.microbatches, train_cfg.batch_size, dims.virtual_stages)
    return dims.check_model(model_config, train_cfg.batch_size)


def run_native(dims: ParallelDims, model_config, train_cfg, backend: str = "gloo",
               timeout_s: float = 120) -> list[PipelineResult]:
    """Parent side: validate, then train_native on dims.pp ranks. check_collectives is off:
    torch's schedules exchange shape metadata and batch their send/recv below the API the
    checker sees, and its pairing of those calls is not ours to verify."""
    _checked(dims, model_config, train_cfg, "run_native")
    return run_on_ranks(train_native, model_config, train_cfg, dims.schedule, dims.microbatches, dims.virtual_stages,
                        world_size=dims.pp, backend=backend, timeout_s=timeout_s, check_collectives=False)


def _ours_and_torch(model_config, train_cfg, schedule, n_microbatches, virtual_stages):
    ours = train_pipeline(model_config, train_cfg, schedule, n_microbatches, virtual_stages)
    dist.barrier()
    return ours, train_native(model_config, train_cfg, schedule, n_microbatches, virtual_stages)


def run_ours_and_native(dims: ParallelDims, model_config, train_cfg, timeout_s: float = 120):
    """Our runner and torch's on the same dims.pp ranks, one after the other, in one launch:
    returns (ours, torch's), each a list of PipelineResult per rank."""
    _checked(dims, model_config, train_cfg, "run_ours_and_native")
    per_rank = run_on_ranks(_ours_and_torch, model_config, train_cfg, dims.schedule, dims.microbatches,
                            dims.virtual_stages, world_size=dims.pp, timeout_s=timeout_s, check_collectives=False)
    return [r[0] for r in per_rank], [r[1] for r in per_rank]
