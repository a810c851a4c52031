"""The reference training loop with periodic checkpoints, resumption, and a failure on purpose.

    train_with_checkpoints(config, train_cfg, checkpoint_dir, checkpoint_every, layout="zero")

Rank code (run_on_ranks or torchrun). On start it loads the newest complete checkpoint under
checkpoint_dir (any world size, any of the layouts) and continues from the step after it; it
saves after every checkpoint_every-th step; with kill_rank/kill_at_step that rank kills itself
(SIGKILL, no clean-up, like a GPU falling off the bus) at the start of that step, once (a
marker file remembers it across restarts). Then torchrun restarts the whole group, and the
restarted run resumes from the last complete checkpoint, recomputing the steps after it:

    steps   1 2 3 4 | 5 6 7 8 | 9 10 x            x = killed at the start of step 11
    saves         4 |       8 |                    restart: load step 8, redo 9, 10, 11, ...

Data: every rank draws the global batch indices with one generator seeded with train_cfg.seed
(data.sample_indices) and keeps its share, as the data-parallel loop does; that generator is
the data-loader position in the checkpoint. Layouts: "replicated" (data parallel: one
all-reduce per gradient, AdamW on every rank) or "zero" (course_lib.parallel.zero, zero_stage 1
or 3). TrainResult.train_losses holds the *global* loss (mean over ranks) of every step
1..steps, the steps before the resumed checkpoint restored from it. Rank 0 appends what
happened (resume, save, kill) to checkpoint_dir/events.jsonl.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

from course_lib._validate import check_int, check_one_of
from course_lib.checkpoint.async_save import AsyncCheckpointer
from course_lib.checkpoint.atomic import checkpoint_path, latest_checkpoint, prune
from course_lib.checkpoint.state import load_training_state, save_training_state
from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.parallel.dp import naive_all_reduce_gradients
from course_lib.parallel.zero.apply import apply_zero
from course_lib.parallel.zero.sharded_optimizer import ShardedOptimizer
from course_lib.platform import kill_self_hard
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainResult, flat_params, make_optimizer, share_rows, train_loop

TRAINING_LAYOUTS = ("replicated", "zero")
FORGETTABLE = ("optimizer", "data", "rng")
EVENTS = "events.jsonl"


def check_checkpoint_run(train_cfg, world_size, checkpoint_every, layout="zero", zero_stage=1,
                         kill_rank=None, kill_at_step=None) -> None:
    """ValueError naming the value and the rule (call in the parent, before any rank starts)."""
    check_int("world_size", world_size)
    check_int("checkpoint_every", checkpoint_every, minimum=0)
    check_one_of("layout", layout, TRAINING_LAYOUTS)
    check_one_of("zero_stage", zero_stage, (1, 3))
    if train_cfg.batch_size % world_size:
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by world_size={world_size}")
    if (kill_rank is None) != (kill_at_step is None):
        raise ValueError(f"kill_rank={kill_rank} and kill_at_step={kill_at_step} go together")
    if kill_rank is not None:
        if not 0 <= kill_rank < world_size:
            raise ValueError(f"kill_rank={kill_rank} must be in [0, world_size={world_size})")
        if not 1 <= kill_at_step <= train_cfg.steps:
            raise ValueError(f"kill_at_step={kill_at_step} must be in [1, steps={train_cfg.steps}]")


def log_event(checkpoint_dir, **event) -> None:
    pathlib.Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    with open(pathlib.Path(checkpoint_dir) / EVENTS, "a") as f:
        f.write(json.dumps(event) + "\n")


def read_events(checkpoint_dir) -> list[dict]:
    path = pathlib.Path(checkpoint_dir) / EVENTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _build(model, train_cfg, layout, zero_stage, group):
    """(optimizer, sync_gradients, clip_grad_norm, layout kind for the checkpoint)."""
    if layout == "replicated":
        return (make_optimizer(model, train_cfg), lambda: naive_all_reduce_gradients(model, group),
                lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))
    if zero_stage == 3:
        _, opt = apply_zero(model, 3, torch.optim.AdamW, group, lr=train_cfg.lr, betas=train_cfg.betas,
                            weight_decay=train_cfg.weight_decay, foreach=False)
    else:
        groups = make_optimizer(model, train_cfg).param_groups  # the reference's decay / no-decay groups
        opt = ShardedOptimizer([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                               torch.optim.AdamW, group, lr=train_cfg.lr, betas=train_cfg.betas, foreach=False)
    return opt, None, opt.clip_grad_norm_


def _final_params(model, optimizer, layout, zero_stage):
    if layout == "zero" and zero_stage == 3:  # the parameters are shards: gather them (collective)
        return torch.cat([p.reshape(-1) for p in optimizer.full_state_dict()["params"]]).cpu()
    return flat_params(model)


def train_with_checkpoints(model_config, train_cfg, checkpoint_dir, checkpoint_every: int, layout: str = "zero",
                           zero_stage: int = 1, resume: bool = True, kill_rank: int | None = None,
                           kill_at_step: int | None = None, async_save: bool = False, keep: int = 0,
                           log_steps: bool = False, forget: tuple = (), group=None) -> TrainResult:
    """Rank code: see the module docstring. keep > 0 deletes all but the newest `keep` checkpoints;
    log_steps adds every step's loss to events.jsonl; forget (a subset of FORGETTABLE) resumes
    without that part of the state, to see the run diverge."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    check_checkpoint_run(train_cfg, n, checkpoint_every, layout, zero_stage, kill_rank, kill_at_step)
    root = pathlib.Path(checkpoint_dir)
    dev = rank_device()
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = GPT(model_config, seed=train_cfg.seed).to(dev)
    optimizer, sync, clip = _build(model, train_cfg, layout, zero_stage, group)
    gen = torch.Generator().manual_seed(train_cfg.seed)
    losses, first = [], 1
    latest = latest_checkpoint(root) if resume else None
    if latest is not None:
        if any(f not in FORGETTABLE for f in forget):
            raise ValueError(f"forget={forget!r} must list items of {FORGETTABLE}")
        info = load_training_state(latest, model, optimizer, layout, None if "data" in forget else gen, group,
                                   restore_rng_state="rng" not in forget,
                                   restore_optimizer_state="optimizer" not in forget)
        losses, first = list(info.extra["losses"]), info.step + 1
        if rank == 0:
            log_event(root, event="resume", step=info.step, world_size=n, saved_world_size=info.saved_world_size,
                      path=latest.name)
            print(f"resumed from {latest.name} (saved at {info.saved_world_size} ranks) on {n} ranks", flush=True)
    saver = AsyncCheckpointer(group) if async_save else None
    result = TrainResult(train_losses=losses)  # the steps before `first` come from the checkpoint

    def kill_if_due(step):  # at the start of the step, before its batch is drawn
        marker = root / f".killed-rank{kill_rank}-step{kill_at_step}"
        if rank == kill_rank and step == kill_at_step and not marker.exists():
            root.mkdir(parents=True, exist_ok=True)
            marker.touch()
            log_event(root, event="kill", step=step, rank=rank)
            print(f"rank {rank}: killed at the start of step {step}", flush=True)
            kill_self_hard()

    def global_loss(loss):  # the mean over ranks, the same at any world size
        mean = torch.tensor([loss / n], dtype=torch.float64, device=dev)
        dist.all_reduce(mean, group=group)
        return mean.item()

    def log_and_save(step, loss):
        if log_steps and rank == 0:
            log_event(root, event="step", step=step, loss=loss, world_size=n)
        if checkpoint_every and step % checkpoint_every == 0:
            path = checkpoint_path(root, step)
            t0 = time.perf_counter()
            save_training_state(path, step, model, optimizer, layout, gen, extra={"losses": list(result.train_losses)},
                                group=group, saver=saver)
            if rank == 0:
                log_event(root, event="save", step=step, world_size=n, blocking_s=time.perf_counter() - t0,
                          path=path.name)
                if keep:
                    prune(root, keep)

    start_all = time.perf_counter()
    if first <= train_cfg.steps:  # else the checkpoint holds every step already
        train_loop(model, optimizer, dataset, train_cfg, StepHooks(sync_gradients=sync, clip_grad_norm=clip),
                   rows=share_rows(rank, n, train_cfg.batch_size), generator=gen, device=dev, first=first,
                   result=result, before_step=kill_if_due, report_loss=global_loss, on_step=log_and_save)
    if saver is not None:
        saver.wait()
    result.seconds = time.perf_counter() - start_all  # the saves' wait included
    result.final_params = _final_params(model, optimizer, layout, zero_stage)
    return result
