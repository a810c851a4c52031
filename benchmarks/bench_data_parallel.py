"""Data-parallel step time: the course's DDP against torch's DistributedDataParallel, and
naive per-parameter all-reduce against bucketed DDP, side by side in one run.

    .venv/bin/python benchmarks/bench_data_parallel.py [--world-size 4] [--steps 6] [--rounds 9] [--quick]

4 gloo ranks train the course GPT (d_model 256, 4 layers: about 3.2M parameters, 12.2 MiB of
fp32 gradients per step) with the same data.

Method (built to tell a 10% difference on a shared machine):
* a step's time is the slowest rank's; a run's time is the median of its steps (the first
  WARMUP are dropped: torch DDP rebuilds its buckets after its first step);
* one round runs every strategy once, inside one call on the same warm ranks, in an order
  rotated from round to round, so that load from other processes hits all strategies alike
  and no strategy always runs first;
* a ratio is computed per round from runs of the same round (paired), and reported as the
  median over rounds with its interquartile range as the spread. A target inside that
  spread is "inconclusive": the noise is larger than the difference being asked about.

"ours / torch" close to 1 means the from-scratch DDP costs what torch's does. The 25 MB case
checks the small first bucket (1 MiB, as torch DDP): without it the whole 12 MiB gradient
sits in one bucket that cannot leave before backward ends. "naive / ours" > 1 is what
buckets and overlap buy. Ratios are recorded with benchmarks/summary.py.
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
from course_lib.parallel.dp.training import train_data_parallel  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

TARGET = 1.10  # ours / torch DDP
RUNS = {  # name -> (strategy, DDP keyword arguments)
    "torch DDP, 25 MB buckets": ("torch", {}),
    "ours, 25 MB buckets": ("ddp", {}),
    "ours, 25 MB, no small first bucket": ("ddp", {"first_bucket_cap_mb": None}),
    "torch DDP, 2 MB buckets": ("torch", {"bucket_cap_mb": 2}),
    "ours, 2 MB buckets": ("ddp", {"bucket_cap_mb": 2}),
    "naive (1 call/param)": ("naive", {}),
}
RATIOS = {  # label -> (numerator, denominator, target, better)
    "course DDP / torch DDP, 25 MB buckets": ("ours, 25 MB buckets", "torch DDP, 25 MB buckets", TARGET, "lower"),
    "course DDP / torch DDP, 2 MB buckets": ("ours, 2 MB buckets", "torch DDP, 2 MB buckets", TARGET, "lower"),
    "course DDP 25 MB: no small first bucket / with": ("ours, 25 MB, no small first bucket", "ours, 25 MB buckets",
                                                        None, "higher"),
    "naive / course DDP, 2 MB buckets": ("naive (1 call/param)", "ours, 2 MB buckets", 1.0, "higher"),
}


def one_round(config, cfg, order):
    """Rank code: train with every strategy of `order` in turn; step seconds per strategy."""
    return {name: train_data_parallel(config, cfg, RUNS[name][0], **RUNS[name][1]).step_seconds for name in order}



def main(argv=None):
    args = rank_share_args(__doc__.splitlines()[0], rounds=9, argv=argv)

    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=256, n_layer=4, n_head=8)
    n_params = GPT(config).num_params()
    cfg = TrainConfig(steps=args.steps, batch_size=args.micro_batch * args.world_size, progress=False)
    print(f"{args.world_size} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__}; GPT d_model={config.d_model} n_layer={config.n_layer}: "
          f"{n_params / 1e6:.2f}M params, {4 * n_params / 2**20:.1f} MiB of gradients; "
          f"{args.micro_batch} x {config.block_size} tokens per rank per step; {args.rounds} rounds")
    names = list(RUNS)
    kw = dict(world_size=args.world_size, timeout_s=600, check_collectives=False)
    start = time.perf_counter()
    warm = TrainConfig(steps=1, batch_size=cfg.batch_size, progress=False)
    per_round = run_rounds(one_round, names, args.rounds, (config, cfg),
                           None if args.quick else (config, warm), **kw)  # --quick: no warm-up call
    report("bench_data_parallel", per_round, RATIOS, save=not args.no_record)
    print(f"(measured in {time.perf_counter() - start:.0f} s; load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
