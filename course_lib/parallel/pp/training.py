"""The reference training loop (course_lib.loop.train_loop), pipelined.

Every rank builds the same single-process GPT from the seed, keeps its stage (build_stage) and
draws the same batches as train_reference; train_step's forward_backward hook runs the
schedule, and the gradient-norm clip sums the squared norms of all stages (the tied matrix
counted once: weight 1/2 on each of its two stages). So the losses and parameters after each
step equal the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.observe.timeline import Timeline
from course_lib.parallel.clip import clip_grad_norm_
from course_lib.parallel.pp.runner import PipelinePlan, plan_pipeline, run_schedule
from course_lib.dims import ParallelDims, check_runner, split_layers
from course_lib.parallel.pp.stage import build_stage
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainResult, flat_grads, flat_params, make_optimizer, train_loop


AXES = ("pp", "schedule", "microbatches", "virtual_stages")  # the ParallelDims fields a pipeline runner runs


@dataclass
class PipelineResult(TrainResult):
    """TrainResult plus what a stage knows: the canonical names of its parameters (the order
    of final_params / final_grads) and its peak saved-activation bytes per step."""

    param_names: list[str] = field(default_factory=list)
    param_shapes: list[tuple] = field(default_factory=list)
    peak_activation_bytes: list[int] = field(default_factory=list)


def clip_grad_norm_pipeline(stage, max_norm: float) -> torch.Tensor:
    """Scale all gradients by min(1, max_norm / (||g|| + 1e-6)) and return ||g||, summed over every
    stage: the one weighted clip (course_lib.parallel.clip), each parameter weighted 1 / the ranks
    holding it (the tied matrix 1/2 on the first and last stage, every other parameter 1)."""
    pairs = [(p.grad, 1 / stage.copies(name)) for name, p in zip(stage.param_names, stage.parameters())]
    return clip_grad_norm_(pairs, max_norm, stage.group)


def plan_checked(model_config, world_size: int, schedule, n_microbatches: int, batch_size: int,
                 virtual_stages: int = 1) -> PipelinePlan:
    """Every rule a pipelined run must satisfy, then the schedule's PipelinePlan (runner.py):
    built once per run, and run every step."""
    check_int("world_size", world_size)
    check_int("virtual_stages", virtual_stages)
    split_layers(model_config.n_layer, world_size * virtual_stages)
    return plan_pipeline(schedule, world_size, virtual_stages, n_microbatches, batch_size)


def check_pipeline(model_config, world_size: int, schedule, n_microbatches: int, batch_size: int,
                   virtual_stages: int = 1):
    """Every rule a pipelined run must satisfy, checked in the parent before any rank waits;
    returns the Schedule."""
    return plan_checked(model_config, world_size, schedule, n_microbatches, batch_size, virtual_stages).schedule


def train_pipeline(model_config, train_cfg, schedule: str = "1f1b", n_microbatches: int = 4,
                   virtual_stages: int = 1, group=None, record_timeline: bool = False,
                   action_seconds: dict | None = None) -> PipelineResult:
    """Rank code: train_cfg.steps steps of the reference loop, pipelined over `group`."""
    n = dist.get_world_size(group)
    plan = plan_checked(model_config, n, schedule, n_microbatches, train_cfg.batch_size, virtual_stages)
    dev = rank_device()
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = GPT(model_config, seed=train_cfg.seed).to(dev)
    stage = build_stage(model, group, virtual_stages, plan.placement)  # "v" for zbv and dualpipev
    del model
    optimizer = make_optimizer(stage, train_cfg)
    timeline = Timeline() if record_timeline else None
    result = PipelineResult(param_names=list(stage.param_names),
                            param_shapes=[tuple(p.shape) for p in stage.parameters()])
    result.set_step_work(model_config, train_cfg.batch_size, model_config.block_size)

    def forward_backward(_stage, x, y):
        return run_schedule(_stage, x, y, plan, n_microbatches, timeline=timeline,
                            action_seconds=action_seconds)

    hooks = StepHooks(forward_backward=forward_backward, clip_grad_norm=lambda c: clip_grad_norm_pipeline(stage, c))
    # every stage reads the whole batch: the first embeds it, the last scores it
    train_loop(stage, optimizer, dataset, train_cfg, hooks, device=dev, result=result,
               on_step=lambda step, loss: result.peak_activation_bytes.append(stage.last_peak_activation_bytes))
    result.final_params, result.final_grads = flat_params(stage), flat_grads(stage)  # this stage's, in its order
    if timeline is not None:
        result.timeline_events = timeline.events
    return result


def run_pipeline(dims: ParallelDims, model_config, train_cfg, actions=None, backend: str = "gloo",
                 timeout_s: float = 120, **kwargs) -> list[PipelineResult]:
    """Parent side: validate everything (dims runs pp, schedule, microbatches and virtual_stages
    only; the schedule's rules, then the rule book's check_model), then run train_pipeline on
    dims.pp ranks. actions (optional): a built Schedule (per-rank action lists, e.g. a learner's)
    run in place of the schedule dims names."""
    check_runner(dims, "run_pipeline", AXES)
    schedule = dims.schedule if actions is None else actions
    check_pipeline(model_config, dims.pp, schedule, dims.microbatches, train_cfg.batch_size, dims.virtual_stages)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_pipeline, model_config, train_cfg, schedule, dims.microbatches, dims.virtual_stages,
                        world_size=dims.pp, backend=backend, timeout_s=timeout_s, **kwargs)


def stage_tensors(results: list[PipelineResult], what: str = "final_params") -> dict[str, torch.Tensor]:
    """{canonical name: tensor} over all stages (the tied matrix from stage 0), for comparing
    with a single-process model's named_parameters()."""
    out = {}
    for res in results:
        flat, offset = getattr(res, what), 0
        for name, shape in zip(res.param_names, res.param_shapes):
            numel = int(torch.Size(shape).numel())
            out.setdefault(name, flat[offset:offset + numel].reshape(shape))
            offset += numel
    return out
