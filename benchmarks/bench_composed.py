"""FSDP x TP step time: the course's composed runtime against PyTorch's own composition (FSDP2
fully_shard over DTensor tensor parallelism), on the same model, batches and ranks, side by side.

    .venv/bin/python benchmarks/bench_composed.py [--steps 6] [--rounds 7] [--batch-size 8] [--quick]

dp2 x tp2 = 4 gloo ranks train the course GPT (d_model 256, 4 layers, 8 heads) with ZeRO-3 over
dp and tensor parallelism over tp, one micro-batch per step, gradients clipped to the global norm:
    course   course_lib.parallel.hybrid.train_hybrid(ParallelDims(dp=2, tp=2, zero=3))
    torch    course_lib.parallel.hybrid.native.train_native_fsdp_tp(config, cfg, 2, 2):
             parallelize_module then fully_shard per block and root over mesh["dp"]
Both split the blocks the same way (2 all-reduces per layer and pass over tp; a block's shards
all-gathered before its forward and again before its backward, its gradients reduce-scattered
once over dp). The course also splits the embedding, head and loss by vocabulary, where DTensor's
plan keeps them whole on every tp rank (small with a 97-symbol vocabulary).

Method as benchmarks/rounds.py: every variant once per round on the same warm ranks, in an order
rotated from round to round; a step's time is the slowest rank's, a run's the median of its steps
after WARMUP; ratios paired per round, reported as the median over rounds with the interquartile
spread ("inconclusive" when the target lies inside it), recorded with benchmarks/summary.py.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rounds import WARMUP, report, run_rounds  # noqa: E402  (benchmarks/ is not a package)
from summary import QUICK_ROUNDS, add_quick, quick_mode  # noqa: E402

from course_lib.data import CharDataset  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.parallel.hybrid import ParallelDims, train_hybrid  # noqa: E402
from course_lib.parallel.hybrid.native import train_native_fsdp_tp  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

TARGET = 1.3  # course composed / torch FSDP2 x TP (issue 31)
DIMS = ParallelDims(dp=2, tp=2, zero=3)
COURSE, TORCH = "course FSDP x TP (ZeRO-3)", "torch FSDP2 x DTensor TP"
RUNS = {
    COURSE: lambda config, cfg: train_hybrid(DIMS, config, cfg),
    TORCH: lambda config, cfg: train_native_fsdp_tp(config, cfg, DIMS.dp, DIMS.tp, gather=False),
}
RATIOS = {"course composed / torch FSDP2 x TP, dp2 x tp2": (COURSE, TORCH, TARGET, "lower")}


def one_round(config, cfg, order):
    """Rank code: train every variant of `order` in turn; step seconds per variant."""
    return {name: RUNS[name](config, cfg).step_seconds for name in order}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, steps=WARMUP + 1, rounds=QUICK_ROUNDS, batch_size=DIMS.dp)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1:
        parser.error(f"need --steps > {WARMUP} and --rounds >= 1")
    quick_mode(args)

    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=256, n_layer=4, n_head=8)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, progress=False)
    try:
        DIMS.check(DIMS.world_size, config, cfg.batch_size)
    except ValueError as err:
        parser.error(str(err))
    print(f"dp{DIMS.dp} x tp{DIMS.tp} = {DIMS.world_size} gloo ranks on {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f}), torch {torch.__version__}; GPT d_model={config.d_model} "
          f"n_layer={config.n_layer}: {GPT(config).num_params() / 1e6:.2f}M params; {args.batch_size} x "
          f"{config.block_size} tokens per step; {args.rounds} rounds of {args.steps} steps")
    # Timing runs: no collective checks (their extra all-gathers would be timed too); torch's
    # collectives run below the Python API anyway. tests/test_hybrid_native.py checks the numbers.
    kw = dict(world_size=DIMS.world_size, timeout_s=600, check_collectives=False)
    start = time.perf_counter()
    warm = TrainConfig(steps=WARMUP + 1, batch_size=args.batch_size, progress=False)
    per_round = run_rounds(one_round, list(RUNS), args.rounds, (config, cfg),
                           None if args.quick else (config, warm), **kw)  # --quick: no warm-up call
    report("bench_composed", per_round, RATIOS, save=not args.no_record, started=start)
    print(f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
