"""Pipeline-parallel training of the course GPT, checked against the single-process run.

    torchrun --nproc-per-node 4 -m course_lib.demos.pipeline --schedule 1f1b --microbatches 8

Every rank builds the same GPT from the seed and keeps its stage; each step runs the schedule
with real send/recv between the stage ranks. Rank 0 prints, per step, the pipeline's loss next
to the single-process loss on the same batch, and each rank's measured bubble: the share of
the schedule's time (between two barriers) it spent outside F, B and W, next to the formula
(p-1)/(m+p-1) (interleaved: (p-1)/(vm+p-1); zero bubble: (p-1)/(3m+p-1)). --action-ms adds a
fixed time to every F, B and W (per micro-batch) so a tiny model on a crowded CPU behaves like
a large one; on GPUs use a bigger model (--n-layer, --d-model) instead.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.observe.timeline import Timeline
from course_lib.parallel.pp import SCHEDULES, build_stage, check_pipeline, run_schedule
from course_lib.parallel.pp.bubble import COMPUTE, formula_for
from course_lib.parallel.pp.training import clip_grad_norm_pipeline
from course_lib.runtime.device import rank_device
from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.train import StepHooks, TrainConfig, make_optimizer, train_loop


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--action-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.action_ms < 0:
        parser.error(f"--steps={args.steps} must be >= 1 and --action-ms={args.action_ms} >= 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # every rule, before any rank joins the group
        config = GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=args.n_layer, d_model=args.d_model)
        check_pipeline(config, world, args.schedule, args.microbatches, args.batch_size, args.virtual_stages)
    except ValueError as err:
        parser.error(str(err))
    return args, config


def main(argv=None):
    args, config = parse_args(argv)
    train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, progress=False)
    init_from_env(timeout_s=120)
    try:
        dev, rank = rank_device(), dist.get_rank()
        p, m, v = dist.get_world_size(), args.microbatches, args.virtual_stages
        dataset = CharDataset("train", block_size=config.block_size)
        stage = build_stage(GPT(config, seed=train_cfg.seed).to(dev), None, v)
        optimizer = make_optimizer(stage, train_cfg)
        ref_losses = []
        if rank == 0:  # the single process on the same batches (its own generator, seeded alike), first
            reference = GPT(config, seed=train_cfg.seed).to(dev)
            ref_losses = train_loop(reference, make_optimizer(reference, train_cfg), dataset, train_cfg,
                                    device=dev).train_losses
        pad = {k: args.action_ms / 1e3 for k in "FBW"}
        formula = formula_for(args.schedule, p, m, v)
        if rank == 0:
            print(f"{args.schedule} on {p} stages x {v} chunk(s), {m} micro-batches of {args.batch_size // m}; "
                  f"bubble formula {formula:.3f}", flush=True)
        now = {}  # this step's timeline (a fresh one before each step) and the schedule's span between two barriers

        def forward_backward(_stage, x_, y_):
            dist.barrier()
            now["start"] = time.perf_counter()
            loss = run_schedule(stage, x_, y_, args.schedule, m, timeline=now["timeline"], action_seconds=pad)
            dist.barrier()
            now["end"] = time.perf_counter()
            return loss

        def report(step, loss):
            busy = sum(e - s for _, s, e, c in now["timeline"].events if c in COMPUTE)
            bubble = torch.tensor([1 - busy / (now["end"] - now["start"])])
            bubbles = [torch.zeros(1) for _ in range(p)]
            dist.all_gather(bubbles, bubble)
            if rank == 0:
                ref_loss = ref_losses[step - 1]
                print(f"step {step}: pipeline loss {loss:.6f}  single process {ref_loss:.6f}  "
                      f"|diff| {abs(loss - ref_loss):.1e}  bubble per rank "
                      + " ".join(f"{b.item():.3f}" for b in bubbles), flush=True)

        hooks = StepHooks(forward_backward=forward_backward, clip_grad_norm=lambda c: clip_grad_norm_pipeline(stage, c))
        train_loop(stage, optimizer, dataset, train_cfg, hooks, device=dev,
                   before_step=lambda step: now.update(timeline=Timeline()), on_step=report)
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
