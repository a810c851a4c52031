"""Tensor-parallel step time: the course's Megatron layers against DTensor's parallelize_module
on the same model and ranks, and sequence parallelism against none, side by side in one run.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--tp 2] [--steps 6] [--rounds 7] [--quick]

tp gloo ranks train the course GPT (d_model 256, 4 layers, 8 heads) on the same batches.
The DTensor version splits the blocks exactly as the course does (2 all-reduces per layer and
pass, or 2 all-gathers + 2 reduce-scatters with SP) but keeps the embedding, head and loss
whole on every rank, where the course splits them by vocabulary; with a 97-symbol vocabulary
that part is small.

Method (as bench_data_parallel.py): a step's time is the slowest rank's, a run's the median of
its steps after WARMUP; one round runs every variant on the same warm ranks in an order rotated
from round to round; ratios are paired per round and reported as the median over rounds with
the interquartile spread ("inconclusive" when the target lies inside it). Ratios are recorded
with benchmarks/summary.py.
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
from course_lib.parallel.tp.training import train_tensor_parallel  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

TARGET = 1.2  # course TP / DTensor TP
SP_TARGET = 1.0  # course TP+SP / DTensor TP+SP: sequence parallelism at or below DTensor's cost (issue #47)
RUNS = {  # name -> (sequence_parallel, impl)
    "course TP": (False, "course"),
    "DTensor TP": (False, "dtensor"),
    "course TP + SP": (True, "course"),
    "DTensor TP + SP": (True, "dtensor"),
}
RATIOS = {  # label -> (numerator, denominator, target, better)
    "course TP / DTensor TP": ("course TP", "DTensor TP", TARGET, "lower"),
    "course TP+SP / DTensor TP+SP": ("course TP + SP", "DTensor TP + SP", SP_TARGET, "lower"),
    "course TP: SP / no SP": ("course TP + SP", "course TP", None, "lower"),
    "DTensor TP: SP / no SP": ("DTensor TP + SP", "DTensor TP", None, "lower"),
}


def one_round(config, cfg, order):
    """Rank code: train every variant of `order` in turn; step seconds per variant."""
    return {name: train_tensor_parallel(config, cfg, RUNS[name][0], RUNS[name][1]).step_seconds for name in order}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, steps=WARMUP + 1, rounds=QUICK_ROUNDS, batch_size=1)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1 or args.tp not in (2, 4, 8) or args.batch_size < 1:
        parser.error(f"need --steps > {WARMUP}, --rounds >= 1, --tp in (2, 4, 8), --batch-size >= 1")
    quick_mode(args)

    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=256, n_layer=4, n_head=8)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, progress=False)
    print(f"tp={args.tp} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__}; GPT d_model={config.d_model} n_layer={config.n_layer}: "
          f"{GPT(config).num_params() / 1e6:.2f}M params; {args.batch_size} x {config.block_size} tokens per step; "
          f"{args.rounds} rounds")
    names = list(RUNS)
    # Timing runs: no collective checks (their extra all-gathers would be timed too); DTensor's
    # collectives are below the Python API anyway. The tests run the same code with checks on.
    kw = dict(world_size=args.tp, timeout_s=600, check_collectives=False)
    start = time.perf_counter()
    warm = TrainConfig(steps=1, batch_size=args.batch_size, progress=False)
    per_round = run_rounds(one_round, names, args.rounds, (config, cfg),
                           None if args.quick else (config, warm), **kw)  # --quick: no warm-up call
    report("bench_tensor_parallel", per_round, RATIOS, save=not args.no_record, started=start)


if __name__ == "__main__":
    main()
