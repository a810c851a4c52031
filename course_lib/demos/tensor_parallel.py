"""Train the course GPT with Megatron tensor parallelism and print its loss beside the
single-process run.

    torchrun --nproc-per-node=2 -m course_lib.demos.tensor_parallel --steps 20 --check
    torchrun --nproc-per-node=4 -m course_lib.demos.tensor_parallel --sequence-parallel
    torchrun --nproc-per-node=4 -m course_lib.demos.tensor_parallel --sequence-parallel --async-tp --check
    torchrun --nproc-per-node=4 -m course_lib.demos.tensor_parallel --n-head 4 --n-kv-head 1 --seq-len 32

Every rank holds 1/N of each attention and MLP weight (whole heads), of the embedding and of
the output head; the loss is computed without gathering the logits. The model has
n_head = max(4, N) heads of 16 features (or --n-head), so N must divide it; with --n-kv-head K
< n_head (grouped-query attention) N must divide K or be a multiple of it, each key/value head
then read by N/K ranks (course_lib.parallel.tp.apply). --async-tp (with --sequence-parallel)
overlaps each block's all-gathers and reduce-scatters with their matmuls, chunk by chunk
(course_lib.parallel.tp.async_tp).

Rank 0 also trains the single-process model on the same batches and prints the two loss curves
side by side with the largest difference (course_lib.demos.verdict.compare_losses). --check makes
that a verdict: exit 1 when any step differs by more than --tolerance.

In a notebook: `run_on_ranks(train_tensor_parallel, config, train_cfg, sequence_parallel)`.
"""

from __future__ import annotations

import argparse
import sys

from course_lib.data import CharDataset
from course_lib.demos.verdict import compare_losses, run_demo
from course_lib.model import GPTConfig
from course_lib.parallel.tp.apply import check_tensor_parallel
from course_lib.parallel.tp.async_tp import check_async_tp
from course_lib.parallel.tp.training import train_tensor_parallel
from course_lib.train import TrainConfig, train_reference

# 1e-3: room for 20 AdamW steps at lr 3e-3, over which the rounding-driven differences
# (adamw_loss_atol(3e-3) = 7e-5 over a few steps, course_lib.tolerances) may grow; a wrong
# shard or a missing all-reduce moves the loss by > 1e-2 within the first steps.
TOLERANCE = 1e-3


def demo_config(world_size: int, block_size: int = 64, n_head: int | None = None,
                n_kv_head: int | None = None) -> GPTConfig:
    """The tiny course GPT, heads of 16 features: n_head of them (default: at least one per rank)."""
    n_head = max(4, world_size) if n_head is None else n_head
    return GPTConfig.tiny(CharDataset("train").vocab_size, block_size=block_size, n_head=n_head, d_model=16 * n_head,
                          n_kv_head=n_kv_head)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--async-tp", action="store_true",
                        help="overlap the sequence-parallel collectives with the matmuls (needs --sequence-parallel)")
    parser.add_argument("--n-head", type=int, default=None, help="query heads (default: max(4, ranks))")
    parser.add_argument("--n-kv-head", type=int, default=None, help="key/value heads (default: n_head)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (the model's block_size)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a step's loss differs from the single process's by more than --tolerance")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest accepted loss difference")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error(f"--steps={args.steps} must be >= 1 and --batch-size={args.batch_size} >= 1")
    if not args.tolerance >= 0:  # NaN too
        parser.error(f"--tolerance={args.tolerance} must be >= 0")
    return args


def build(args, world: int):
    """(GPTConfig, TrainConfig, sequence_parallel, async_tp), every rule checked before any rank
    waits: ValueError otherwise."""
    config = demo_config(world, args.seq_len, args.n_head, args.n_kv_head)
    check_tensor_parallel(config, world, args.sequence_parallel)
    check_async_tp(args.async_tp, args.sequence_parallel)
    train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, eval_every=10**9, progress=False)
    return config, train_cfg, args.sequence_parallel, args.async_tp


def train(config, train_cfg, sequence_parallel: bool, async_tp: bool):
    """Rank code: this rank's TrainResult (the loss is the global one on every rank)."""
    return train_tensor_parallel(config, train_cfg, sequence_parallel, async_tp=async_tp)


def report(args, world: int, backend: str, built, result) -> int:
    """Rank 0: the single-process run on the same batches, both losses step by step and the
    largest difference; with --check the verdict's exit status (0 or 1), else 0."""
    config, train_cfg, sequence_parallel, async_tp = built
    mode = "sequence parallel" if sequence_parallel else "no sequence parallelism"
    mode += ", async TP (overlapped)" if async_tp else ""
    print(f"tensor parallel on {world} ranks ({backend}), {mode}: {config}", flush=True)
    code = compare_losses(result.train_losses, train_reference(config, train_cfg).train_losses, args.tolerance)
    return code if args.check else 0


def main(argv=None) -> int:
    args = parse(argv)
    return run_demo("tensor_parallel", args, build, train,
                    lambda world, backend, built, result: report(args, world, backend, built, result))


if __name__ == "__main__":
    sys.exit(main())
