"""LocalSGD, DiLoCo and Streaming DiLoCo on torchrun ranks, against the same algorithm in one process.

    torchrun --nproc-per-node=4 -m course_lib.demos.diloco --replicas 4 --inner-steps 4 --check
    torchrun --nproc-per-node=4 -m course_lib.demos.diloco --replicas 2 --inner-steps 4 --streaming 2 --bf16-outer
    torchrun --nproc-per-node=2 -m course_lib.demos.diloco --replicas 2 --inner-steps 2 --local-sgd --check
    torchrun --nproc-per-node=4 -m course_lib.demos.diloco --replicas 2 --inner-steps 2 --shard --check
    torchrun --nproc-per-node=2 -m course_lib.demos.diloco --replicas 2 --inner-steps 4 --slow-rank 1 --delay-ms 50
    torchrun --nproc-per-node=2 -m course_lib.demos.diloco --ddp --slow-rank 1 --delay-ms 50
    torchrun --nproc-per-node=2 -m course_lib.demos.diloco --replicas 3 --inner-steps 2 --kill-replica 1 --at-step 3 --check

The N ranks form R replicas of N / R ranks (DDP inside a replica), each training its own copy of
the course GPT with AdamW and meeting every H steps (course_lib.parallel.diloco): LocalSGD
averages the parameters, DiLoCo (Douillard et al. 2023) takes an outer Nesterov step on the
averaged change, --streaming F (Douillard et al. 2025) syncs one of F fragments at a time.
Rank 0 prints each step's loss per replica and the bytes each rank sent across replicas
(measured by CommTracer) beside the formula (course_lib.estimate.traffic.diloco) and DDP's every
step. --check reruns the algorithm in one process (simulate_diloco: the replicas in turn) and
exits 1 when a replica's loss differs by more than adamw_loss_atol(lr) at any step, or its
parameters by more than param_rms_tolerance in RMS (the reasons are there), or a step's bytes
differ from the formula at all.

--slow-rank R --delay-ms D makes rank R a straggler: it sleeps D ms in every step (inside the
timed step; no number changes). --ddp is plain data parallelism over all N ranks (one replica,
LocalSGD with R = 1: the gradients are all-reduced every step, so it equals the single process).
Rank 0 then prints each rank's mean step time and wall time beside the straggler model's
prediction (course_lib.estimate.stragglers: max over replicas of their rounds' step times; the
rest is the syncs and the loop). --check checks the numbers only, never a time.

--kill-replica K --at-step S kills replica K's process for real at the start of step S; the
others keep training and their next sync's quorum excludes it; a restarted replica rejoins,
healed from a healthy peer. Its design (the replicas are children of the ranks, not torchrun's
workers, whose death would end the job) and its --check are course_lib/demos/diloco_kill.py's.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.demos import diloco_kill
from course_lib.demos.verdict import compare_losses, run_demo
from course_lib.dims import ParallelDims
from course_lib.estimate.stragglers import constant_delays, round_seconds
from course_lib.estimate.traffic.diloco import ddp_bytes_per_step, diloco_sync_bytes
from course_lib.model import GPTConfig
from course_lib.parallel.diloco.simulate import param_rms_tolerance, simulate_diloco
from course_lib.parallel.diloco.training import check_run, train_diloco, train_local_sgd
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig
from course_lib.units import fmt_bytes


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, help="R: the ranks form R replicas of N / R ranks")
    p.add_argument("--inner-steps", type=int, help="H: inner AdamW steps between syncs")
    p.add_argument("--ddp", action="store_true", help="plain DDP over all ranks (one replica, H = 1)")
    p.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps --delay-ms in every step")
    p.add_argument("--delay-ms", type=float, default=0.0, help="the slow rank's delay per step, in ms")
    p.add_argument("--streaming", type=int, default=1, help="F fragments synced at staggered steps")
    p.add_argument("--local-sgd", action="store_true", help="average the parameters instead (LocalSGD)")
    p.add_argument("--bf16-outer", action="store_true", help="send the deltas as bf16 (summed in fp32)")
    p.add_argument("--shard", action="store_true", help="FSDP inside each replica; the outer step on shards")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--check", action="store_true", help="compare with the single-process simulation")
    diloco_kill.add_flags(p)
    args = p.parse_args(argv)
    if args.ddp:
        if args.replicas is not None or args.inner_steps is not None or args.local_sgd or args.streaming != 1 \
                or args.bf16_outer or args.shard:
            p.error("--ddp is one replica syncing every step: no --replicas, --inner-steps, --local-sgd, "
                    "--streaming, --bf16-outer or --shard")
        args.replicas, args.inner_steps, args.local_sgd = 1, 1, True  # LocalSGD with R = 1 is DDP
    elif args.replicas is None or args.inner_steps is None:
        p.error("--replicas and --inner-steps are required (or --ddp)")
    return args


def build(args, world: int):
    """(options, GPTConfig, TrainConfig), every rule checked in the parent's way: ValueError otherwise."""
    if args.steps < 1 or not args.lr > 0:
        raise ValueError(f"--steps={args.steps} must be >= 1 and --lr={args.lr} > 0")
    if args.slow_rank is not None and not 0 <= args.slow_rank < world:
        raise ValueError(f"--slow-rank={args.slow_rank} must be a rank in [0, {world})")
    if not args.delay_ms >= 0:  # NaN too
        raise ValueError(f"--delay-ms={args.delay_ms} must be >= 0")
    if args.delay_ms and args.slow_rank is None:
        raise ValueError(f"--delay-ms={args.delay_ms} needs --slow-rank: which rank is late")
    if args.slow_rank is not None and args.steps < 2:
        raise ValueError(f"--steps={args.steps} must be >= 2 with --slow-rank: the times are read from step 2 on")
    if diloco_kill.wanted(args):
        return {"ft": diloco_kill.build_ft(args), "world": world}, None, None
    if args.local_sgd and (args.streaming != 1 or args.bf16_outer):
        raise ValueError("--local-sgd averages the whole model in fp32: no --streaming, no --bf16-outer")
    config = GPTConfig.tiny(CharDataset("train").vocab_size, block_size=32, n_layer=4, d_model=32)
    train = TrainConfig(steps=args.steps, batch_size=4 * world, lr=args.lr, progress=False)
    options = dict(algorithm="local_sgd") if args.local_sgd else dict(
        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, fragments=args.streaming,
        outer_dtype=torch.bfloat16 if args.bf16_outer else torch.float32)
    check_run(ParallelDims(dp=world), config, train, args.replicas, args.inner_steps, shard=args.shard, **options)
    return options, config, train


def run(args, options, config, train):
    """Rank code: every rank's DilocoResult (traced), gathered on every rank (with --kill-replica:
    the replicas' FtRun on rank 0)."""
    if "ft" in options:
        return diloco_kill.run(options["ft"])
    delay_s = args.delay_ms / 1000 if dist.get_rank() == args.slow_rank else 0.0
    if args.local_sgd:
        mine = train_local_sgd(config, train, args.replicas, args.inner_steps, trace=True, delay_s=delay_s,
                               shard=args.shard)
    else:
        mine = train_diloco(config, train, args.replicas, args.inner_steps, options["outer_lr"],
                            options["outer_momentum"], options["fragments"], options["outer_dtype"], trace=True,
                            delay_s=delay_s, shard=args.shard)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, mine)
    return results


def report(results, args, options, config, train) -> int:
    """Rank 0: the losses and bytes, and with --check the verdict (0 or 1)."""
    if "ft" in options:
        return diloco_kill.report(results, options["ft"], options["world"], args.check)
    r, s = args.replicas, len(results) // args.replicas
    losses = [[sum(results[i * s + j].train_losses[k] for j in range(s)) / s for k in range(train.steps)]
              for i in range(r)]
    e = 2 if options.get("outer_dtype") == torch.bfloat16 else 4
    formula = diloco_sync_bytes(config, r, args.inner_steps, train.steps, options.get("fragments", 1), e,
                                shards=s if args.shard else 1)
    name = "DDP" if args.ddp else "LocalSGD" if args.local_sgd else (
        "Streaming DiLoCo" if args.streaming > 1 else "DiLoCo")
    sharded = " (each FSDP-sharded: the outer step on each rank's rows)" if args.shard else ""
    print(f"{name} on {len(results)} ranks: {r} replicas of {s} rank(s){sharded}, H = {args.inner_steps}", flush=True)
    print(f"{'step':>4} " + " ".join(f"{'replica ' + str(i):>10}" for i in range(r))
          + f" {'sent across (rank 0)':>21} {'formula':>10}")
    for k in range(train.steps):
        print(f"{k + 1:>4} " + " ".join(f"{losses[i][k]:>10.5f}" for i in range(r))
              + f" {fmt_bytes(results[0].sync_bytes[k]):>21} {fmt_bytes(formula[k]):>10}")
    ddp = ddp_bytes_per_step(config)
    print(f"per step on average: {fmt_bytes(sum(formula) / train.steps)}, peak {fmt_bytes(max(formula))}; "
          f"DDP sends {fmt_bytes(ddp)} every step", flush=True)
    if args.slow_rank is not None:
        report_times(results, args, train.steps)
    if not args.check:
        return 0
    sim = simulate_diloco(config, train, r, args.inner_steps, **options)
    failed = 0
    for i in range(r):
        print(f"replica {i} against the single-process simulation:")
        failed |= compare_losses(losses[i], sim[i].train_losses, adamw_loss_atol(train.lr))
    tol = param_rms_tolerance(train.lr, args.inner_steps, **options)
    worst = max(float((x.final_params - sim[x.replica].final_params).double().pow(2).mean().sqrt()) for x in results)
    params_ok = worst <= tol  # False for a NaN
    bytes_ok = all(x.sync_bytes == formula for x in results)
    print(f"parameters: largest RMS difference {worst:.2e} (tolerance {tol:.1e}): {'OK' if params_ok else 'MISMATCH'}")
    print(f"bytes across replicas, every rank and step, equal to the formula: {'OK' if bytes_ok else 'MISMATCH'}",
          flush=True)
    return 1 if failed or not params_ok or not bytes_ok else 0


def report_times(results, args, steps: int) -> dict:
    """Rank 0: each rank's measured mean step time and wall time, and the straggler model's
    prediction (returned too, in seconds), all from step 2 on: in step 1 a rank also waits for
    the others to arrive. The compute per step c is the least over ranks of the mean step time
    less its own delay (a rank that waited inside its step, as DDP's do, counts the wait; the
    slow rank never waits, so the least is the step's own time); each replica is late by its
    slowest rank's delay, and a round ends at the replicas' next sync."""
    world, s, h, d = len(results), len(results) // args.replicas, args.inner_steps, args.delay_ms / 1000
    delay = [d if r == args.slow_rank else 0.0 for r in range(world)]
    mean = [sum(x.step_seconds[1:]) / (steps - 1) for x in results]
    wall = [x.seconds - x.step_seconds[0] for x in results]
    c = min(m - dr for m, dr in zip(mean, delay))
    late = constant_delays(args.replicas, args.slow_rank // s, d, steps)
    rounds = [range(max(2, k + 1), min(k + h, steps) + 1) for k in range(0, steps, h)]

    def predict(quorum=None):
        return sum(round_seconds(c, [[row[t - 1] for t in rnd] for row in late], quorum=quorum)
                   for rnd in rounds if len(rnd))
    predicted = predict()
    print(f"from step 2 on: {'rank':>4} {'replica':>7} {'delay':>8} {'mean step':>10} {'wall':>8}")
    for r in range(world):
        print(f"{'':>14}{r:>4} {r // s:>7} {1000 * delay[r]:>6.1f}ms {1000 * mean[r]:>8.1f}ms {wall[r]:>7.3f}s")
    print(f"predicted (c = {1000 * c:.1f} ms a step, max over replicas of each round's steps): {predicted:.3f}s "
          f"of the measured {max(wall):.3f}s wall; the rest ({max(wall) - predicted:+.3f}s) is the syncs and "
          f"the loop", flush=True)
    out = {"predicted": predicted, "wall": max(wall), "compute": c}
    if args.replicas > 1:
        out["quorum"] = predict(args.replicas - 1)
        print(f"dropping the slow replica from the quorum (a round ends when {args.replicas - 1} of "
              f"{args.replicas} are done) would predict {out['quorum']:.3f}s", flush=True)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    return run_demo("diloco", args, lambda a, world: (a, *build(a, world)), run,
                    lambda world, backend, built, results: report(results, *built))


if __name__ == "__main__":
    sys.exit(main())
