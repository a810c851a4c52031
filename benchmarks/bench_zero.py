"""ZeRO step time: the course's stage 3 against torch's FSDP2, stage 1 against torch's
ZeroRedundancyOptimizer (under torch DDP), and stages 0-3 against each other, in one run.

    .venv/bin/python benchmarks/bench_zero.py [--world-size 4] [--steps 6] [--rounds 5] [--quick]

4 gloo ranks train the course GPT (d_model 256, 4 layers: about 3.2M parameters) with AdamW on
the same data. Method as bench_data_parallel.py: a step's time is the slowest rank's, a run's
time the median of its steps after WARMUP; one round runs every variant once on the same warm
ranks in an order rotated per round; ratios are paired per round and reported as the median
with the interquartile range as the spread (a target inside it is "inconclusive").

What to expect on CPU ranks: stage 3 sends 1.5x DDP's bytes and waits for each block's gather
(prefetching overlaps it with the previous block's compute), so it is the slowest stage; stage
1's reduce-scatter + all-gather moves DDP's bytes but in two calls after backward, with no
overlap. gloo's reduce-scatter is an all-reduce plus a slice (twice the data), which costs the
course's stages 1-3 and FSDP2 alike. Ratios are recorded with benchmarks/summary.py.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rounds import rank_share_args, report, run_rounds  # noqa: E402  (benchmarks/ is not a package)

from course_lib.data import CharDataset  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.parallel.zero import train_zero  # noqa: E402
from course_lib.parallel.zero.native import train_native  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

RUNS = {  # name -> rank-side function(config, cfg) -> TrainResult
    "course stage 0 (DDP)": lambda c, cfg: train_zero(c, cfg, 0),
    "course stage 1": lambda c, cfg: train_zero(c, cfg, 1),
    "course stage 2": lambda c, cfg: train_zero(c, cfg, 2),
    "course stage 3": lambda c, cfg: train_zero(c, cfg, 3),
    "torch ZeroRedundancyOptimizer": lambda c, cfg: train_native(c, cfg, "zero_redundancy"),
    "torch FSDP2 fully_shard": lambda c, cfg: train_native(c, cfg, "fsdp2"),
}
RATIOS = {  # label -> (numerator, denominator, target, better)
    "course stage 3 / torch FSDP2": ("course stage 3", "torch FSDP2 fully_shard", 1.3, "lower"),
    "course stage 1 / torch ZeroRedundancyOptimizer": ("course stage 1", "torch ZeroRedundancyOptimizer", 1.3, "lower"),
    "course stage 1 / stage 0": ("course stage 1", "course stage 0 (DDP)", None, "lower"),
    "course stage 2 / stage 0": ("course stage 2", "course stage 0 (DDP)", None, "lower"),
    "course stage 3 / stage 0": ("course stage 3", "course stage 0 (DDP)", None, "lower"),
}


def one_round(config, cfg, order):
    """Rank code: train with every variant of `order` in turn; step seconds per variant."""
    return {name: RUNS[name](config, cfg).step_seconds for name in order}


def main(argv=None):
    args = rank_share_args(__doc__.splitlines()[0], rounds=5, argv=argv)

    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=256, n_layer=4, n_head=8)
    n_params = GPT(config).num_params()
    cfg = TrainConfig(steps=args.steps, batch_size=args.micro_batch * args.world_size, progress=False)
    print(f"{args.world_size} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__}; GPT d_model={config.d_model} n_layer={config.n_layer}: "
          f"{n_params / 1e6:.2f}M params; {args.micro_batch} x {config.block_size} tokens per rank per step; "
          f"{args.rounds} rounds")
    names = list(RUNS)
    # check_collectives=False: DDP and FSDP2 issue their collectives from C++ (the check would
    # see only part of them), and the check's extra all-gather per call would distort the timings.
    kw = dict(world_size=args.world_size, timeout_s=600, check_collectives=False, backend="gloo")
    start = time.perf_counter()
    warm = TrainConfig(steps=1, batch_size=cfg.batch_size, progress=False)
    per_round = run_rounds(one_round, names, args.rounds, (config, cfg),
                           None if args.quick else (config, warm), **kw)  # --quick: no warm-up call
    report("bench_zero", per_round, RATIOS, save=not args.no_record, started=start)


if __name__ == "__main__":
    main()
