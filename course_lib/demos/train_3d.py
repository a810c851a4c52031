"""Train the course GPT (or its MoE form) on a dp x tp x pp x ep mesh.

    torchrun --nproc-per-node 8 -m course_lib.demos.train_3d --dp 2 --tp 2 --pp 2 --zero 1 \\
        --microbatches 2 --steps 3 --check
    ... --zero 3 --no-reshard-after-forward     FSDP x TP x PP, each stage's parameters gathered
                                                once per step (Llama 3's policy)
    ... --dp 1 --tp 2 --pp 2 --sequence-parallel --microbatches 2   sequence-sharded stage messages

The layout is checked before the process group starts (course_lib.parallel.hybrid.ParallelDims):
a bad one exits with code 2 and its rule, printed once. With --check rank 0 also trains the
single-process model on the same global batches, prints both losses per step and the largest
difference, and exits 1 when they differ beyond what rounding can explain after AdamW steps
(course_lib.tolerances.adamw_loss_atol at --lr, or --tolerance).
"""

from __future__ import annotations

import argparse
import sys

from course_lib.data import CharDataset
from course_lib.demos.verdict import losses_or_check, run_demo
from course_lib.model import GPTConfig
from course_lib.parallel.hybrid import ParallelDims, train_hybrid, train_single
from course_lib.train import TrainConfig


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("dp", "tp", "pp"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage over dp: 0-3 (2 and 3 reduce once per step)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="--zero 3: free a stage's gathered parameters after each micro-batch's forward (default) "
                        "or, with --no-reshard-after-forward, keep them for the whole step")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the dataset's alphabet")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--n-experts", type=int, default=0, help="> 0: the MoE GPT (top-2, no auxiliary losses)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--check", action="store_true", help="compare every step with the single process")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest accepted |loss difference| with --check (default: adamw_loss_atol(--lr))")
    return p.parse_args(argv)


def build(args, world_size: int):
    """(ParallelDims, GPTConfig, TrainConfig), every rule checked: ValueError otherwise."""
    data_vocab = CharDataset("train", args.seq_len).vocab_size
    vocab = data_vocab if args.vocab_size is None else args.vocab_size
    if vocab < data_vocab:
        raise ValueError(f"--vocab-size={vocab} must be >= the dataset's alphabet ({data_vocab} symbols)")
    moe = dict(n_experts=args.n_experts, top_k=min(2, args.n_experts), aux_loss_coef=0.0, z_loss_coef=0.0) \
        if args.n_experts else {}
    config = GPTConfig(vocab_size=vocab, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       d_model=args.d_model, **moe)
    dims = ParallelDims(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, zero=args.zero,
                        virtual_stages=args.virtual_stages, microbatches=args.microbatches,
                        schedule=args.schedule, sequence_parallel=args.sequence_parallel,
                        reshard_after_forward=args.reshard_after_forward)
    dims.check(world_size, config, args.batch_size)
    if args.tolerance is not None and not args.tolerance >= 0:
        raise ValueError(f"--tolerance={args.tolerance} must be >= 0")
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr} must be > 0")
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, grad_clip=args.grad_clip,
                        progress=False)
    return dims, config, train


def main(argv=None) -> int:
    args = parse(argv)

    def report(world, backend, built, result) -> int:
        dims, config, train = built
        layout = " x ".join(f"{d} {getattr(dims, d)}" for d in ("pp", "dp", "ep", "tp"))
        print(f"train_3d on {world} ranks ({backend}): {layout}, {dims.describe()}, {dims.microbatches} "
              f"micro-batches, global batch {train.batch_size}", flush=True)
        return losses_or_check(args, result.train_losses, lambda: train_single(config, train))

    return run_demo("train_3d", args, build, train_hybrid, report)


if __name__ == "__main__":
    sys.exit(main())
