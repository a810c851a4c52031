"""LocalSGD, DiLoCo and Streaming DiLoCo on torchrun ranks, against the same algorithm in one process.

    torchrun --nproc-per-node=4 -m course_lib.demos.diloco --replicas 4 --inner-steps 4 --check
    torchrun --nproc-per-node=4 -m course_lib.demos.diloco --replicas 2 --inner-steps 4 --streaming 2 --bf16-outer
    torchrun --nproc-per-node=2 -m course_lib.demos.diloco --replicas 2 --inner-steps 2 --local-sgd --check

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
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.demos.verdict import compare_losses, run_demo
from course_lib.dims import ParallelDims
from course_lib.estimate.traffic.diloco import ddp_bytes_per_step, diloco_sync_bytes
from course_lib.model import GPTConfig
from course_lib.parallel.diloco.simulate import param_rms_tolerance, simulate_diloco
from course_lib.parallel.diloco.training import check_run, train_diloco, train_local_sgd
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig
from course_lib.units import fmt_bytes


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, required=True, help="R: the ranks form R replicas of N / R ranks")
    p.add_argument("--inner-steps", type=int, required=True, help="H: inner AdamW steps between syncs")
    p.add_argument("--streaming", type=int, default=1, help="F fragments synced at staggered steps")
    p.add_argument("--local-sgd", action="store_true", help="average the parameters instead (LocalSGD)")
    p.add_argument("--bf16-outer", action="store_true", help="send the deltas as bf16 (summed in fp32)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--check", action="store_true", help="compare with the single-process simulation")
    return p.parse_args(argv)


def build(args, world: int):
    """(options, GPTConfig, TrainConfig), every rule checked in the parent's way: ValueError otherwise."""
    if args.steps < 1 or not args.lr > 0:
        raise ValueError(f"--steps={args.steps} must be >= 1 and --lr={args.lr} > 0")
    if args.local_sgd and (args.streaming != 1 or args.bf16_outer):
        raise ValueError("--local-sgd averages the whole model in fp32: no --streaming, no --bf16-outer")
    config = GPTConfig.tiny(CharDataset("train").vocab_size, block_size=32, n_layer=4, d_model=32)
    train = TrainConfig(steps=args.steps, batch_size=4 * world, lr=args.lr, progress=False)
    options = dict(algorithm="local_sgd") if args.local_sgd else dict(
        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, fragments=args.streaming,
        outer_dtype=torch.bfloat16 if args.bf16_outer else torch.float32)
    check_run(ParallelDims(dp=world), config, train, args.replicas, args.inner_steps, **options)
    return options, config, train


def run(args, options, config, train):
    """Rank code: every rank's DilocoResult (traced), gathered on every rank."""
    if args.local_sgd:
        mine = train_local_sgd(config, train, args.replicas, args.inner_steps, trace=True)
    else:
        mine = train_diloco(config, train, args.replicas, args.inner_steps, options["outer_lr"],
                            options["outer_momentum"], options["fragments"], options["outer_dtype"], trace=True)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, mine)
    return results


def report(results, args, options, config, train) -> int:
    """Rank 0: the losses and bytes, and with --check the verdict (0 or 1)."""
    r, s = args.replicas, len(results) // args.replicas
    losses = [[sum(results[i * s + j].train_losses[k] for j in range(s)) / s for k in range(train.steps)]
              for i in range(r)]
    e = 2 if options.get("outer_dtype") == torch.bfloat16 else 4
    formula = diloco_sync_bytes(config, r, args.inner_steps, train.steps, options.get("fragments", 1), e)
    name = "LocalSGD" if args.local_sgd else ("Streaming DiLoCo" if args.streaming > 1 else "DiLoCo")
    print(f"{name} on {len(results)} ranks: {r} replicas of {s} rank(s), H = {args.inner_steps}", flush=True)
    print(f"{'step':>4} " + " ".join(f"{'replica ' + str(i):>10}" for i in range(r))
          + f" {'sent across (rank 0)':>21} {'formula':>10}")
    for k in range(train.steps):
        print(f"{k + 1:>4} " + " ".join(f"{losses[i][k]:>10.5f}" for i in range(r))
              + f" {fmt_bytes(results[0].sync_bytes[k]):>21} {fmt_bytes(formula[k]):>10}")
    ddp = ddp_bytes_per_step(config)
    print(f"per step on average: {fmt_bytes(sum(formula) / train.steps)}, peak {fmt_bytes(max(formula))}; "
          f"DDP sends {fmt_bytes(ddp)} every step", flush=True)
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


def main(argv=None) -> int:
    args = parse(argv)
    return run_demo("diloco", args, lambda a, world: (a, *build(a, world)), run,
                    lambda world, backend, built, results: report(results, *built))


if __name__ == "__main__":
    sys.exit(main())
