"""Train the course GPT with context parallelism: every rank holds a shard of every sequence.

    torchrun --nproc-per-node 2 -m course_lib.demos.context_parallel --method ring --seq-len 96 --load-balance --check
    torchrun --nproc-per-node 4 -m course_lib.demos.context_parallel --method ulysses --seq-len 256 --dp 2

The N ranks form dp x cp = N (cp = N / --dp, cp innermost). Each rank keeps its data-parallel
rows of the global batch and T/cp tokens of each (contiguous, or with --load-balance the zig-zag
chunks r and 2cp-1-r of 2cp); attention sees the other shards by --method: ring (K/V passed
round the ranks), allgather (K/V gathered once per layer) or ulysses (all-to-all to whole heads;
cp must divide the heads). The model is the tiny course GPT with block_size = --seq-len and
n_head = 4 (cp when 4 is not a multiple of it, so Ulysses can split the heads).
The layout is checked before the process group starts: a bad one exits with code 2 and its rule.
With --check rank 0 also trains the single-process model on the same batches, prints both
losses and exits 1 when they differ beyond what rounding explains after AdamW steps
(course_lib.tolerances.adamw_loss_atol(lr), or --tolerance).

In a notebook: `run_context_parallel(ParallelDims(cp=cp, dp=dp, cp_method=method), config, train_cfg)`.
"""

from __future__ import annotations

import argparse
import sys

from course_lib.data import CharDataset
from course_lib.demos.verdict import losses_or_check, run_demo
from course_lib.dims import CP_METHODS
from course_lib.model import GPTConfig
from course_lib.parallel.cp.training import check_run, train_context_parallel
from course_lib.train import TrainConfig, train_reference


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=CP_METHODS, default="ring")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (the model's block_size)")
    p.add_argument("--load-balance", action="store_true", help="zig-zag chunks r and 2cp-1-r (2cp must divide it)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas; cp = ranks / dp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (sequences per step)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--check", action="store_true", help="compare every step with the single process")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest accepted |loss difference| with --check (default: adamw_loss_atol(--lr))")
    return p.parse_args(argv)


def demo_config(seq_len: int, cp: int) -> GPTConfig:
    """The tiny course GPT over sequences of seq_len tokens, with heads Ulysses can split."""
    n_head = 4 if 4 % cp == 0 else cp
    return GPTConfig.tiny(CharDataset("train").vocab_size, block_size=seq_len, n_head=n_head, d_model=16 * n_head)


def build(args, world: int):
    """(cp, GPTConfig, TrainConfig), every rule checked: ValueError otherwise."""
    for name in ("steps", "batch_size", "dp", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if world % args.dp:
        raise ValueError(f"--dp={args.dp} must divide the {world} ranks (cp = ranks / dp)")
    if not args.lr > 0 or (args.tolerance is not None and not args.tolerance >= 0):
        raise ValueError(f"--lr={args.lr} must be > 0 and --tolerance={args.tolerance} >= 0")
    cp = world // args.dp
    config = demo_config(args.seq_len, cp)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, eval_every=10**9, progress=False)
    check_run(config, train, cp, args.dp, args.method, args.load_balance)
    return cp, config, train


def main(argv=None) -> int:
    args = parse(argv)

    def train(cp, config, train_cfg):
        return train_context_parallel(config, train_cfg, cp, args.dp, args.method, args.load_balance)

    def report(world, backend, built, result) -> int:
        cp, config, train_cfg = built
        split = "zig-zag (load balanced)" if args.load_balance else "contiguous"
        print(f"context parallel on {world} ranks ({backend}): dp {args.dp} x cp {cp}, method {args.method}, "
              f"{split} shards of {args.seq_len // cp} of {args.seq_len} tokens; {config}", flush=True)
        return losses_or_check(args, result.train_losses, lambda: train_reference(config, train_cfg))

    return run_demo("context_parallel", args, build, train, report)


if __name__ == "__main__":
    sys.exit(main())
