"""Train the course GPT with Megatron tensor parallelism and print its loss beside the
single-process run.

    torchrun --nproc-per-node=2 -m course_lib.demos.tensor_parallel --steps 20
    torchrun --nproc-per-node=4 -m course_lib.demos.tensor_parallel --sequence-parallel
    torchrun --nproc-per-node=4 -m course_lib.demos.tensor_parallel --sequence-parallel --async-tp
    torchrun --nproc-per-node=4 -m course_lib.demos.tensor_parallel --n-head 4 --n-kv-head 1 --seq-len 32

Every rank holds 1/N of each attention and MLP weight (whole heads), of the embedding and of
the output head; the loss is computed without gathering the logits. The model has
n_head = max(4, N) heads of 16 features (or --n-head), so N must divide it; with --n-kv-head K
< n_head (grouped-query attention) N must divide K or be a multiple of it, each key/value head
then read by N/K ranks (course_lib.parallel.tp.apply). Rank 0 also trains the
single-process model on the same batches and checks the two loss curves agree. --async-tp
(with --sequence-parallel) overlaps each block's all-gathers and reduce-scatters with their
matmuls, chunk by chunk (course_lib.parallel.tp.async_tp).

In a notebook: `run_on_ranks(train_tensor_parallel, config, train_cfg, sequence_parallel)`.
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.model import GPTConfig
from course_lib.parallel.tp.apply import check_tensor_parallel
from course_lib.parallel.tp.async_tp import check_async_tp
from course_lib.parallel.tp.training import train_tensor_parallel
from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.train import TrainConfig, train_reference


def demo_config(world_size: int, block_size: int = 64, n_head: int | None = None,
                n_kv_head: int | None = None) -> GPTConfig:
    """The tiny course GPT, heads of 16 features: n_head of them (default: at least one per rank)."""
    n_head = max(4, world_size) if n_head is None else n_head
    return GPTConfig.tiny(CharDataset("train").vocab_size, block_size=block_size, n_head=n_head, d_model=16 * n_head,
                          n_kv_head=n_kv_head)


def compare(tp_losses, ref_losses, tolerance: float) -> tuple[str, float]:
    lines = [f"{'step':>5} {'tensor parallel':>16} {'single process':>15}"]
    for i, (a, b) in enumerate(zip(tp_losses, ref_losses), start=1):
        lines.append(f"{i:>5} {a:>16.6f} {b:>15.6f}")
    worst = max(abs(a - b) for a, b in zip(tp_losses, ref_losses))
    verdict = "OK" if worst <= tolerance else f"MISMATCH (tolerance {tolerance:g})"
    lines.append(f"max |loss - single-process loss| = {worst:.2e}: {verdict}")
    return "\n".join(lines), worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--async-tp", action="store_true",
                        help="overlap the sequence-parallel collectives with the matmuls (needs --sequence-parallel)")
    parser.add_argument("--n-head", type=int, default=None, help="query heads (default: max(4, ranks))")
    parser.add_argument("--n-kv-head", type=int, default=None, help="key/value heads (default: n_head)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (the model's block_size)")
    # 1e-3: room for 20 AdamW steps at lr 3e-3, over which the rounding-driven differences
    # (adamw_loss_atol(3e-3) = 7e-5 over a few steps, course_lib.tolerances) may grow; a wrong
    # shard or a missing all-reduce moves the loss by > 1e-2 within the first steps.
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted loss difference")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error(f"--steps={args.steps} must be >= 1 and --batch-size={args.batch_size} >= 1")
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:  # before joining the group: a bad layout fails on every rank at once, nobody waits
        config = demo_config(world, args.seq_len, args.n_head, args.n_kv_head)
        check_tensor_parallel(config, world, args.sequence_parallel)
        check_async_tp(args.async_tp, args.sequence_parallel)
    except ValueError as e:
        parser.error(str(e))
    train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, eval_every=10**9, progress=False)
    backend = init_from_env()
    try:
        result = train_tensor_parallel(config, train_cfg, args.sequence_parallel, async_tp=args.async_tp)
        worst = 0.0
        if dist.get_rank() == 0:
            ref = train_reference(config, train_cfg)
            mode = "sequence parallel" if args.sequence_parallel else "no sequence parallelism"
            mode += ", async TP (overlapped)" if args.async_tp else ""
            print(f"tensor parallel on {world} ranks ({backend}), {mode}: {config}")
            table, worst = compare(result.train_losses, ref.train_losses, args.tolerance)
            print(table, flush=True)
        failed = dist.get_rank() == 0 and worst > args.tolerance
    finally:
        leave_process_group()  # every rank waits there for rank 0's reference run
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
