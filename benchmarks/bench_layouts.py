"""Several layouts of one model on 8 ranks: step time and traffic per step, side by side.

    .venv/bin/python benchmarks/bench_layouts.py [--steps 5] [--rounds 5] [--batch-size 16] [--quick]

8 gloo ranks train the same GPT (d_model 128, 4 layers, global batch 16 x 64 tokens) as pure
DP, DP x TP, DP x PP, 3D (dp2 x tp2 x pp2) and 3D with ZeRO-1, through
course_lib.parallel.hybrid. Method as benchmarks/rounds.py: every layout once per round on the
same warm ranks, rotated order, a step's time is the slowest rank's, ratios paired per round.

What it measures is a CPU box with 2 cores shared by 8 processes, where communication is a
memory copy and tp's many small all-reduces cost latency: the ranking here is NOT a cluster's
(notebook 10, section 6). The traffic table (bytes per step by dimension, from the CommTracer)
is the same on any machine; notebook 11's planner must predict both from its model. Ratios
(layout / pure DP, info only: no target) go to benchmarks/summary.py.
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

from course_lib import run_on_ranks  # noqa: E402
from course_lib.data import CharDataset  # noqa: E402
from course_lib.model import GPTConfig  # noqa: E402
from course_lib.parallel.hybrid import ParallelDims, train_hybrid  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402
from course_lib.units import fmt_bytes  # noqa: E402

LAYOUTS = {
    "pure DP (dp 8)": ParallelDims(dp=8),
    "DP x TP (dp 4, tp 2)": ParallelDims(dp=4, tp=2),
    "DP x PP (dp 4, pp 2, m 2)": ParallelDims(dp=4, pp=2, microbatches=2),
    "3D (dp 2, tp 2, pp 2, m 2)": ParallelDims(dp=2, tp=2, pp=2, microbatches=2),
    "3D + ZeRO-1": ParallelDims(dp=2, tp=2, pp=2, microbatches=2, zero=1),
}
BASE = "pure DP (dp 8)"
RATIOS = {f"{name} / pure DP": (name, BASE, None, "lower") for name in LAYOUTS if name != BASE}


def one_round(config, cfg, order):
    """Rank code: every layout of `order` in turn; step seconds per layout."""
    return {name: train_hybrid(LAYOUTS[name], config, cfg).step_seconds for name in order}


def traffic(config, cfg):
    """Rank code: one traced step of every layout; {layout: {dim: bytes sent by this rank}}."""
    one = TrainConfig(steps=1, batch_size=cfg.batch_size, lr=cfg.lr, progress=False)
    return {name: {d: row["bytes_sent"] for d, row in train_hybrid(dims, config, one, trace=True).traffic.items()}
            for name, dims in LAYOUTS.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, steps=WARMUP + 1, rounds=QUICK_ROUNDS, batch_size=8)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1:
        parser.error(f"need --steps > {WARMUP} and --rounds >= 1")
    quick_mode(args)
    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=128, n_layer=4, n_head=4)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, progress=False)
    try:
        for dims in LAYOUTS.values():
            dims.check(8, config, cfg.batch_size)
    except ValueError as err:
        parser.error(str(err))
    print(f"8 gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), torch "
          f"{torch.__version__}; GPT d_model {config.d_model}, {config.n_layer} layers, batch {cfg.batch_size} x "
          f"{config.block_size} tokens; {args.rounds} rounds of {args.steps} steps")
    kw = dict(world_size=8, timeout_s=600, check_collectives=False)
    start = time.perf_counter()
    per_rank = run_on_ranks(traffic, config, cfg, **kw)
    print(f"\n{'layout':<30}" + "".join(f"{d:>12}" for d in ("tp", "pp", "dp", "world")) + f"{'total':>12}")
    for name in LAYOUTS:
        sums = {d: sum(r[name].get(d, 0) for r in per_rank) for d in ("tp", "pp", "dp", "world")}
        print(f"{name:<30}" + "".join(f"{fmt_bytes(v):>12}" for v in sums.values())
              + f"{fmt_bytes(sum(sums.values())):>12}")
    print("(bytes sent per step, summed over the 8 ranks)")
    warm = TrainConfig(steps=WARMUP + 1, batch_size=cfg.batch_size, progress=False)
    per_round = run_rounds(one_round, list(LAYOUTS), args.rounds, (config, cfg),
                           None if args.quick else (config, warm), **kw)  # --quick: no warm-up call
    report("bench_layouts", per_round, RATIOS, save=not args.no_record, started=start)
    print(f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
