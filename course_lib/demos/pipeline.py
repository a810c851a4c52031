"""Pipeline-parallel training of the course GPT, checked against the single-process run.

    torchrun --nproc-per-node 4 -m course_lib.demos.pipeline --schedule 1f1b --microbatches 8
    torchrun --nproc-per-node 2 -m course_lib.demos.pipeline --schedule zbv --microbatches 4 --check
    torchrun --nproc-per-node 2 -m course_lib.demos.pipeline --schedule pipedream_2bw --microbatches 2 --check

Every rank builds the same GPT from the seed and keeps its stage; each step runs the schedule
with real send/recv between the stage ranks. Rank 0 prints, per step, the pipeline's loss next
to the single-process loss on the same batch, and each rank's measured bubble: the share of
the schedule's time (between two barriers) it spent outside F, B and W, next to the formula
(p-1)/(m+p-1) (interleaved: (p-1)/(vm+p-1); zero bubble: (p-1)/(3m+p-1)). --action-ms adds a
fixed time to every F, B and W (per micro-batch) so a tiny model on a crowded CPU behaves like
a large one; on GPUs use a bigger model (--n-layer, --d-model) instead.

zbv and dualpipev run 2 chunks per rank in a V (--virtual-stages defaults to 2 for them).
pipedream_2bw runs all steps without a flush (course_lib.parallel.pp.pipedream): its reference
is the one-step-delayed single process, and it runs with an untied head and no gradient clip
(its rules). --check: rank 0 exits 1 when any step's loss differs from its single-process
reference by more than what rounding explains after AdamW steps (adamw_loss_atol, or --tolerance).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.observe.timeline import Timeline
from course_lib.dims import V_SCHEDULES
from course_lib.parallel.pp import SCHEDULES, build_stage, check_pipeline, plan_pipeline, run_schedule
from course_lib.parallel.pp.bubble import COMPUTE, formula_for
from course_lib.parallel.pp.pipedream import check_2bw, reference_2bw, train_2bw
from course_lib.parallel.pp.training import clip_grad_norm_pipeline
from course_lib.tolerances import adamw_loss_atol
from course_lib.runtime.device import rank_device
from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.train import StepHooks, TrainConfig, make_optimizer, train_loop


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--virtual-stages", type=int, default=None, help="default: 2 for zbv/dualpipev, else 1")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--action-ms", type=float, default=0.0)
    parser.add_argument("--check", action="store_true", help="exit 1 if a step differs from the single process")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest accepted |loss difference| with --check (default: adamw_loss_atol(lr))")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.action_ms < 0 or (args.tolerance is not None and not args.tolerance >= 0):
        parser.error(f"--steps={args.steps} must be >= 1, --action-ms={args.action_ms} >= 0 and "
                     f"--tolerance={args.tolerance} >= 0")
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in V_SCHEDULES else 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    two_bw = args.schedule == "pipedream_2bw"
    try:  # every rule, before any rank joins the group
        config = GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=args.n_layer, d_model=args.d_model,
                                tie_weights=not two_bw)
        if two_bw:
            if args.virtual_stages != 1:
                raise ValueError(f"pipedream_2bw runs one chunk per rank: --virtual-stages={args.virtual_stages}")
            check_2bw(config, world, args.microbatches, train_config(args))
        else:
            check_pipeline(config, world, args.schedule, args.microbatches, args.batch_size, args.virtual_stages)
    except ValueError as err:
        parser.error(str(err))
    return args, config


def train_config(args) -> TrainConfig:
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, progress=False)
    return dataclasses.replace(cfg, grad_clip=0.0) if args.schedule == "pipedream_2bw" else cfg


def verdict(args, pipeline_losses, reference_losses) -> int:
    """Rank 0 with --check: 1 if any step differs beyond the tolerance, else 0."""
    tolerance = adamw_loss_atol(train_config(args).lr) if args.tolerance is None else args.tolerance
    worst = max(abs(a - b) for a, b in zip(pipeline_losses, reference_losses))
    ok = worst <= tolerance
    print(f"largest |loss difference| {worst:.2e} (tolerance {tolerance:.1e}): {'OK' if ok else 'MISMATCH'}",
          flush=True)
    return 0 if ok else 1


def main_2bw(args, config) -> int:
    """PipeDream-2BW: the whole run at once, then each step against the delayed-update reference."""
    train_cfg, rank = train_config(args), dist.get_rank()
    res = train_2bw(config, train_cfg, args.microbatches)
    if rank != 0:
        return 0
    ref = reference_2bw(config, train_cfg, args.microbatches)
    p = dist.get_world_size()
    bubble = formula_for("pipedream_2bw", p, args.microbatches, steps=args.steps)
    print(f"pipedream_2bw on {p} stages, {args.microbatches} micro-batches, no flush; "
          f"bubble formula over the run {bubble:.3f}", flush=True)
    for t, (a, b) in enumerate(zip(res.train_losses, ref.train_losses)):
        print(f"step {t + 1}: pipeline loss {a:.6f}  delayed-update single process {b:.6f}  |diff| {abs(a - b):.1e}  "
              f"weights W_{res.version_used[t]}", flush=True)
    print(f"rank 0 held at most {max(len(v) for v in res.versions_held)} stashed weight versions "
          f"({res.version_bytes / 1e6:.2f} MB each)", flush=True)
    return verdict(args, res.train_losses, ref.train_losses) if args.check else 0


def main(argv=None):
    args, config = parse_args(argv)
    train_cfg = train_config(args)
    init_from_env(timeout_s=120)
    status = 0
    try:
        if args.schedule == "pipedream_2bw":
            status = main_2bw(args, config)
            return status
        dev, rank = rank_device(), dist.get_rank()
        p, m, v = dist.get_world_size(), args.microbatches, args.virtual_stages
        dataset = CharDataset("train", block_size=config.block_size)
        plan = plan_pipeline(args.schedule, p, v, m, args.batch_size)  # once per run, not per step
        stage = build_stage(GPT(config, seed=train_cfg.seed).to(dev), None, v, plan.placement)
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
            loss = run_schedule(stage, x_, y_, plan, m, timeline=now["timeline"], action_seconds=pad)
            dist.barrier()
            now["end"] = time.perf_counter()
            return loss

        def report(step, loss):
            busy = sum(e - s for _, s, e, c in now["timeline"].events if c in COMPUTE)
            bubble = torch.tensor([1 - busy / (now["end"] - now["start"])], device=dev)
            bubbles = [torch.zeros(1, device=dev) for _ in range(p)]
            dist.all_gather(bubbles, bubble)
            if rank == 0:
                ref_loss = ref_losses[step - 1]
                print(f"step {step}: pipeline loss {loss:.6f}  single process {ref_loss:.6f}  "
                      f"|diff| {abs(loss - ref_loss):.1e}  bubble per rank "
                      + " ".join(f"{b.item():.3f}" for b in bubbles), flush=True)

        hooks = StepHooks(forward_backward=forward_backward, clip_grad_norm=lambda c: clip_grad_norm_pipeline(stage, c))
        result = train_loop(stage, optimizer, dataset, train_cfg, hooks, device=dev,
                            before_step=lambda step: now.update(timeline=Timeline()), on_step=report)
        if args.check and rank == 0:
            status = verdict(args, result.train_losses, ref_losses)
    finally:
        leave_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
