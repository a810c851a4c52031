"""Elastic recovery: train with periodic checkpoints, kill a rank on purpose, let torchrun restart
the group, resume from the last complete checkpoint, and check nothing was lost or repeated.

    torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts 1 -m course_lib.demos.elastic \\
        --steps 12 --checkpoint-every 4 --checkpoint-dir /tmp/ckpt --kill-rank 1 --kill-at-step 7 --check

    attempt 0: steps 1..6, saves step 4; rank 1 SIGKILLs itself at the start of step 7
    torchrun:  sees the dead worker, stops the others, starts all workers again (restart 1)
    attempt 1: loads step_00000004, recomputes 5, 6, runs 7..12
    --check:   trains the same steps again without interruption and compares the loss curves
               (exit status 1 when they differ: bit for bit when every segment ran at this
               world size, within 1e-4 when the world size changed in between)

A different world size: run torchrun again with another --nproc-per-node and a larger --steps on
the same --checkpoint-dir; it resumes from the newest checkpoint, resharding by global offsets.
--forget optimizer|data|rng resumes without that part of the state: --check then fails.
Rank 0 writes every step's loss and the saves/resumes/kills to CHECKPOINT_DIR/events.jsonl.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys

import torch.distributed as dist

from course_lib.checkpoint.training import (FORGETTABLE, TRAINING_LAYOUTS, check_checkpoint_run, read_events,
                                            train_with_checkpoints)
from course_lib.data import CharDataset
from course_lib.model import GPTConfig
from course_lib.runtime.launch import init_from_env, leave_process_group

from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig


def compare_losses(resumed, uninterrupted, exact: bool, lr: float) -> tuple[bool, float]:
    """(ok, max |difference|): equal lists (exact: every segment ran at one world size, the same
    arithmetic) or, where the world size changed (the gradient summed in another order, which
    AdamW magnifies near g = 0), within adamw_loss_atol(lr) of each other."""
    if len(resumed) != len(uninterrupted):
        return False, float("inf")
    diff = max((abs(a - b) for a, b in zip(resumed, uninterrupted)), default=0.0)
    return (diff == 0.0) if exact else (diff <= adamw_loss_atol(lr)), diff


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checkpoint-every", type=int, required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-at-step", type=int)
    p.add_argument("--check", action="store_true")
    p.add_argument("--layout", choices=TRAINING_LAYOUTS, default="zero")
    p.add_argument("--zero-stage", type=int, choices=(1, 3), default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--forget", choices=FORGETTABLE, nargs="*", default=[])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1:
        p.error(f"--steps={args.steps} and --checkpoint-every={args.checkpoint_every} must be >= 1")
    if (args.kill_rank is None) != (args.kill_at_step is None):
        p.error("--kill-rank and --kill-at-step go together")
    return args


def configs(args):
    vocab = CharDataset("train", args.block_size).vocab_size
    model = GPTConfig.tiny(vocab, block_size=args.block_size, n_layer=2, n_head=2, d_model=32)
    return model, TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed, progress=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    root = pathlib.Path(args.checkpoint_dir)
    init_from_env(timeout_s=60)  # a dead peer turns into an error within a minute, not a hang
    rank, n = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model_cfg, train_cfg = configs(args)
    try:
        check_checkpoint_run(train_cfg, n, args.checkpoint_every, args.layout, args.zero_stage, args.kill_rank,
                             args.kill_at_step)
        if rank == 0:
            print(f"attempt {restart}: {n} ranks, layout {args.layout}", flush=True)
        result = train_with_checkpoints(model_cfg, train_cfg, root, args.checkpoint_every, args.layout,
                                        args.zero_stage, kill_rank=args.kill_rank, kill_at_step=args.kill_at_step,
                                        async_save=args.async_save, log_steps=True, forget=tuple(args.forget))
        status = 0
        if rank == 0:
            print("losses: " + " ".join(f"{x:.4f}" for x in result.train_losses), flush=True)
        if args.check:
            ref_dir = root / "uninterrupted"
            if rank == 0 and ref_dir.exists():
                shutil.rmtree(ref_dir)
            dist.barrier()
            ref = train_with_checkpoints(model_cfg, train_cfg, ref_dir, 0, args.layout, args.zero_stage,
                                         resume=False)
            sizes = {e.get("world_size") for e in read_events(root) if e["event"] in ("step", "resume")}
            exact = sizes <= {n}
            ok, diff = compare_losses(result.train_losses, ref.train_losses, exact, train_cfg.lr)
            if rank == 0:
                rule = "bit for bit" if exact else f"within {adamw_loss_atol(train_cfg.lr):g} (the world size changed)"
                verdict = "equal" if ok else "DIFFERENT"
                print(f"check: resumed vs uninterrupted losses {verdict} {rule}; max |difference| = {diff:.3g}",
                      flush=True)
            status = 0 if ok else 1
    finally:
        leave_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
