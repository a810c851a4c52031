"""The reference training loop (course_lib.train), made data parallel.

Every rank draws the reference's global batch indices with the same seeded generator, keeps
its contiguous 1/N share and cuts it into micro-batches; the gradients are averaged by one of
the strategies of data_parallel.py (or torch's DistributedDataParallel), so the parameters
after each step equal the single-process reference trained on the whole batch.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.data import CharDataset, collate, sample_indices
from course_lib.runtime.device import rank_device
from course_lib.model import GPT
from course_lib.parallel.dp.ddp import DDP, naive_all_reduce_gradients
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.train import make_optimizer

STRATEGIES = ("ddp", "naive", "torch")


def _check_run(strategy, accum_steps, batch_size, world_size):
    if not callable(strategy) and strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES} or a callable wrap(model, group)")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r} must be an int >= 1")
    if batch_size % (world_size * accum_steps):
        raise ValueError(f"batch_size={batch_size} must be divisible by world_size * accum_steps = "
                         f"{world_size} * {accum_steps}: every rank takes equal micro-batches")


def train_data_parallel(model_config, train_cfg, strategy: str = "ddp", accum_steps: int = 1, group=None,
                        model_fn=None, record_timeline: bool = False, trace: bool = False, **ddp_kwargs) -> dict:
    """Rank code: course_lib.train's reference loop, made data parallel.

    Every rank draws the reference's global batch indices with the same seeded generator
    (data.sample_indices), keeps its contiguous share idx[r*B/N : (r+1)*B/N] and splits it
    into accum_steps micro-batches (all but the last under no_sync). Each micro-batch loss
    is divided by accum_steps, so the summed gradient is the mean over the rank's share.
    strategy: "ddp" (ours), "naive" (naive_all_reduce_gradients), "torch"
    (torch.nn.parallel.DistributedDataParallel) or a callable wrap(model, group) -> wrapper
    with finish_gradient_synchronization() (the exercise). model_fn(config, seed) builds the model
    (default GPT). Returns {"losses": this rank's per-step losses (the global loss is their
    mean over ranks), "params"/"grads": flat final parameters and last gradients, "step_s",
    with record_timeline "events" (Timeline events: forward/backward/... and buckets), with
    trace "comm" (CommTracer summary of the training steps, after any wrapper was built)}.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    timeline = Timeline() if record_timeline else None
    _check_run(strategy, accum_steps, train_cfg.batch_size, n)
    dataset = CharDataset("train", block_size=model_config.block_size)
    dev = rank_device()  # the CPU under gloo, this rank's GPU under NCCL
    model = (model_fn or GPT)(model_config, seed=train_cfg.seed).to(dev)
    if callable(strategy):
        wrapped = strategy(model, group)
    elif strategy == "ddp":
        wrapped = DDP(model, group=group, timeline=timeline, **ddp_kwargs)
    elif strategy == "torch":
        ids = [dev.index] if dev.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group, **ddp_kwargs)
    else:
        wrapped = model
    optimizer = make_optimizer(model, train_cfg)
    gen = torch.Generator().manual_seed(train_cfg.seed)
    share, micro = train_cfg.batch_size // n, train_cfg.batch_size // (n * accum_steps)
    spans = timeline.span if timeline is not None else (lambda *a: contextlib.nullcontext())
    out = {"losses": [], "step_s": []}
    tracer = CommTracer() if trace else contextlib.nullcontext()
    with tracer:
        for _ in range(train_cfg.steps):
            start = time.perf_counter()
            idx = sample_indices(len(dataset), train_cfg.batch_size, gen)[rank * share:(rank + 1) * share]
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for k in range(accum_steps):
                x, y = (t.to(dev) for t in collate(dataset, idx[k * micro:(k + 1) * micro]))
                last = k == accum_steps - 1
                with contextlib.nullcontext() if last or not hasattr(wrapped, "no_sync") else wrapped.no_sync():
                    with spans("forward", "forward"):
                        _, loss = wrapped(x, y)
                    with spans("backward", "backward"):
                        (loss / accum_steps).backward()  # ours: buckets reduced at the end of the last one
                loss_sum += loss.item() / accum_steps
            if strategy == "naive":
                with spans("all-reduce", "comm"):
                    naive_all_reduce_gradients(model, group)
            elif hasattr(wrapped, "finish_gradient_synchronization"):
                wrapped.finish_gradient_synchronization()  # ours: a no-op, it ran at the end of backward
            with spans("optimizer", "optimizer"):
                if train_cfg.grad_clip:  # on the averaged gradient: the global norm, as in the reference
                    torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
                optimizer.step()
            out["losses"].append(loss_sum)
            out["step_s"].append(time.perf_counter() - start)
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    out["grads"] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in model.parameters()]).cpu()
    if timeline is not None:
        out["events"] = timeline.events
    if trace:
        out["comm"] = tracer.summary()
    return out


def run_data_parallel(world_size: int, model_config, train_cfg, strategy: str = "ddp", accum_steps: int = 1,
                      backend: str = "auto", timeout_s: float = 120, check_collectives: bool = True,
                      **kwargs) -> list[dict]:
    """Parent side: validate, then run train_data_parallel on `world_size` ranks (run_on_ranks'
    backend/timeout_s/check_collectives; other kwargs go to train_data_parallel)."""
    from course_lib.runtime import run_on_ranks

    _check_run(strategy, accum_steps, train_cfg.batch_size, world_size)
    return run_on_ranks(train_data_parallel, model_config, train_cfg, strategy, accum_steps, world_size=world_size,
                        backend=backend, timeout_s=timeout_s, check_collectives=check_collectives, **kwargs)
