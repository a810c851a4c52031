"""Training an MoE GPT with expert parallelism (optionally x data parallelism), and its reference.

Every rank r of the world draws the reference's global batch with the same seeded generator
and keeps its contiguous share idx[r*B/W : (r+1)*B/W] (W = world size). Each share is routed
on its own rank, with its own capacity and auxiliary losses, so the single-process reference
is `train_moe_reference(..., shares=W)`: the same model run on the W shares one after the
other, loss = mean of the W share losses, then one optimizer step.

Mesh: ep x dp (course_lib.parallel.mesh: rank = dp_index * ep + ep_index). Gradients:
reduce_gradients over the ep group, then an all-reduce average over the dp group. With
balance="bias", each layer's step load is summed over the world and the bias updated after the
backward (the reference: after its shares' backward), so every copy of the bias stays equal.
experts="replicated" is the baseline: every rank keeps every expert and all gradients are
averaged over the world (data parallelism only), with the same result.
"""

from __future__ import annotations

import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims, check_runner
from course_lib.model import GPT
from course_lib.model.moe import update_expert_bias
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.dp import naive_all_reduce_gradients
from course_lib.parallel.ep.apply import (apply_expert_parallel, check_expert_parallel, clip_grad_norm, full_flat,
                                          reduce_gradients, sync_expert_load)
from course_lib.parallel.mesh import make_mesh
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainResult, flat_grads, flat_params, make_optimizer, share_rows, train_loop

EXPERT_LAYOUTS = ("sharded", "replicated")


def check_run(model_config, train_cfg, world_size: int, dp: int = 1, experts: str = "sharded") -> int:
    """Parent-side validation; returns ep = world_size / dp."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts={experts!r} must be one of {EXPERT_LAYOUTS}")
    rule = f"a positive int dividing world_size={world_size}"
    check_int("dp", dp, rule=rule)
    if world_size % dp:
        raise ValueError(f"dp={dp!r} must be {rule}")
    ep = world_size // dp
    if experts == "sharded":
        check_expert_parallel(model_config, ep)
    elif not model_config.n_experts:
        raise ValueError("n_experts=0 is a dense model: this loop trains an MoE GPT")
    if train_cfg.batch_size % world_size:
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by world_size={world_size}: "
                         f"every rank takes an equal share")
    return ep


def train_moe_reference(model_config, train_cfg, shares: int) -> TrainResult:
    """Single process: each step runs the model on the `shares` contiguous shares of the batch
    separately (each its own routing, capacity, auxiliary loss), back-propagates
    (1/shares) * sum of their losses, clips and steps. train_losses: the mean share loss."""
    if train_cfg.batch_size % shares:
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by shares={shares}")
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = GPT(model_config, seed=train_cfg.seed)
    optimizer = make_optimizer(model, train_cfg)

    def forward_backward(m, x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(shares), y.chunk(shares)):  # rows [r*B/W, (r+1)*B/W): rank r's share
            loss = m(xs, ys)[1] / shares
            loss.backward()
            total += loss.item()
        update_expert_bias(m)  # balance="bias": the step's load, summed over the shares
        return total

    result = TrainResult(model=model).set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    train_loop(model, optimizer, dataset, train_cfg, StepHooks(forward_backward=forward_backward), result=result)
    result.final_params, result.final_grads = flat_params(model), flat_grads(model)
    return result


def train_expert_parallel(model_config, train_cfg, dp: int = 1, experts: str = "sharded", trace: bool = False,
                          record_timeline: bool = False, once_per_rank: bool = False) -> TrainResult:
    """Rank code: the MoE GPT on an ep x dp mesh (ep = world / dp), this rank's share of each batch.

    Returns a TrainResult: train_losses this rank's share losses (their mean over ranks is the
    reference's), final_params / final_grads of the WHOLE model in single-process order
    (experts gathered after training), step_seconds; comm_summary with trace; timeline_events
    with record_timeline (forward/backward/optimizer spans and every collective). once_per_rank:
    the deduplicating dispatch (apply_expert_parallel), the same result with fewer bytes.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = check_run(model_config, train_cfg, world, dp, experts)
    if dp > 1:
        mesh = make_mesh(dp=dp, ep=ep)
        ep_group, dp_group = mesh["ep"].get_group(), mesh["dp"].get_group()
    else:
        ep_group, dp_group = None, None
    dev = rank_device()
    model = GPT(model_config, seed=train_cfg.seed).to(dev)
    if experts == "sharded":
        apply_expert_parallel(model, ep_group, once_per_rank)

        def sync_gradients():
            reduce_gradients(model, ep_group)
            if dp > 1:
                naive_all_reduce_gradients(model, dp_group)
            sync_expert_load(model)  # over the world: every rank's tokens, as the reference's shares
            update_expert_bias(model)

        def clip(max_norm):
            clip_grad_norm(model, max_norm, ep_group)
    else:
        def sync_gradients():
            naive_all_reduce_gradients(model, None)
            sync_expert_load(model)
            update_expert_bias(model)

        clip = None
    dataset = CharDataset("train", block_size=model_config.block_size)
    optimizer = make_optimizer(model, train_cfg)
    timeline = Timeline() if record_timeline else None
    result = TrainResult().set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    train_loop(model, optimizer, dataset, train_cfg,
               StepHooks(sync_gradients=sync_gradients, clip_grad_norm=clip, timeline=timeline),
               rows=share_rows(rank, world, train_cfg.batch_size), device=dev, result=result,
               tracer=CommTracer(timeline=timeline) if (trace or record_timeline) else None)
    if experts == "sharded":
        result.final_params, result.final_grads = full_flat(model, ep_group), full_flat(model, ep_group, grads=True)
    else:
        result.final_params, result.final_grads = flat_params(model), flat_grads(model)
    return result


def run_expert_parallel(dims: ParallelDims, model_config, train_cfg, experts: str = "sharded",
                        timeout_s: float = 120, check_collectives: bool = True, **kwargs) -> list[TrainResult]:
    """Parent side: validate (dims runs ep and dp only; check_run, then the rule book's
    check_model), then train_expert_parallel on dims.dp * dims.ep ranks."""
    check_runner(dims, "run_expert_parallel", ("ep", "dp"))
    check_run(model_config, train_cfg, dims.world_size, dims.dp, experts)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_expert_parallel, model_config, train_cfg, dims.dp, experts, world_size=dims.world_size,
                        timeout_s=timeout_s, check_collectives=check_collectives, **kwargs)
