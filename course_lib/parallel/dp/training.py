"""The reference training loop (course_lib.train), made data parallel.

Every rank draws the reference's global batch indices with the same seeded generator, keeps
its contiguous 1/N share and cuts it into micro-batches; the gradients are averaged by one of
the strategies of ddp.py (or torch's DistributedDataParallel), so the parameters
after each step equal the single-process reference trained on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims, check_runner
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.model import GPT
from course_lib.parallel.dp.apply import apply_data_parallel, check_strategy
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.train import TrainResult, flat_grads, flat_params, make_optimizer, share_rows, train_loop

def _check_run(strategy, accum_steps, batch_size, world_size):
    check_strategy(strategy)
    check_int("accum_steps", accum_steps, rule="an int >= 1")
    if batch_size % (world_size * accum_steps):
        raise ValueError(f"batch_size={batch_size} must be divisible by world_size * accum_steps = "
                         f"{world_size} * {accum_steps}: every rank takes equal micro-batches")


def train_data_parallel(model_config, train_cfg, strategy: str = "ddp", accum_steps: int = 1, group=None,
                        model_fn=None, record_timeline: bool = False, trace: bool = False, **ddp_kwargs) -> TrainResult:
    """Rank code: course_lib.train's reference loop, made data parallel.

    Every rank draws the reference's global batch indices with the same seeded generator
    (course_lib.loop.train_loop), keeps its contiguous share idx[r*B/N : (r+1)*B/N] and runs
    `train_step` on it with accum_steps micro-batches (all but the last under no_sync). Each
    micro-batch loss is divided by accum_steps, so the summed gradient is the mean over the
    rank's share; the strategy then averages it over the ranks.
    strategy: "ddp" (ours), "naive" (naive_all_reduce_gradients), "torch"
    (torch.nn.parallel.DistributedDataParallel) or a callable wrap(model, group) -> wrapper
    with finish_gradient_synchronization() (the exercise). model_fn(config, seed) builds the model
    (default GPT). Returns a TrainResult: train_losses are this rank's (the global loss is their
    mean over ranks), final_params/final_grads flat, step_seconds; timeline_events with
    record_timeline (forward/backward/... and buckets); comm_summary with trace (the training
    steps, after any wrapper was built).
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    timeline = Timeline() if record_timeline else None
    _check_run(strategy, accum_steps, train_cfg.batch_size, n)
    dataset = CharDataset("train", block_size=model_config.block_size)
    dev = rank_device()  # the CPU under gloo, this rank's GPU under NCCL
    model = (model_fn or GPT)(model_config, seed=train_cfg.seed).to(dev)
    dp = apply_data_parallel(model, group, strategy, timeline, **ddp_kwargs)
    optimizer = make_optimizer(model, train_cfg)
    # Clip the plain model's gradients: after the average every rank holds the global
    # gradient, so its norm is the reference's.
    hooks = dp.hooks(accum_steps=accum_steps, timeline=timeline,
                     clip_grad_norm=lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))
    result = TrainResult().set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    train_loop(dp.module, optimizer, dataset, train_cfg, hooks, rows=share_rows(rank, n, train_cfg.batch_size),
               device=dev, result=result, tracer=CommTracer() if trace else None)
    result.final_params, result.final_grads = flat_params(model), flat_grads(model)
    return result


def run_data_parallel(dims: ParallelDims, model_config, train_cfg, strategy: str = "ddp", accum_steps: int = 1,
                      backend: str = "gloo", timeout_s: float = 120, check_collectives: bool = True,
                      **kwargs) -> list[TrainResult]:
    """Parent side: validate (dims runs dp only; the strategy and accum_steps, then the rule
    book's check_model), then run train_data_parallel on dims.dp ranks (run_on_ranks'
    backend/timeout_s/check_collectives; other kwargs go to train_data_parallel)."""
    check_runner(dims, "run_data_parallel", ("dp",))
    _check_run(strategy, accum_steps, train_cfg.batch_size, dims.dp)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_data_parallel, model_config, train_cfg, strategy, accum_steps, world_size=dims.dp,
                        backend=backend, timeout_s=timeout_s, check_collectives=check_collectives, **kwargs)
