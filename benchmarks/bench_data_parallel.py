"""Data-parallel step time: the course's DDP against torch's DistributedDataParallel, and
naive per-parameter all-reduce against bucketed DDP, side by side in one run.

    .venv/bin/python benchmarks/bench_data_parallel.py [--world-size 4] [--steps 6] [--rounds 3]

4 gloo ranks train the course GPT (d_model 256, 4 layers: about 3.3M parameters, 13 MB of
fp32 gradients per step) with the same data. A step's time is the slowest rank's; a run's
time is the median of its steps (the first 2 are warm-up and dropped); a strategy's number
is the fastest of its runs over the rounds. Rounds interleave the strategies so that load
from other processes on the machine hits all of them alike, and the minimum over rounds is
the least disturbed measurement (the spread column shows how disturbed the others were). Ratios are against torch DDP measured in
the same run: "ours / torch" close to 1 means the from-scratch DDP costs what torch's does;
"naive / ours" > 1 is what buckets and overlap buy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.train import TrainConfig

WARMUP = 2


def step_time(world_size, config, cfg, strategy, **kw) -> float:
    res = run_on_ranks(train_data_parallel, config, cfg, strategy, world_size=world_size, timeout_s=300,
                       check_collectives=False, **kw)
    return statistics.median(max(r.step_seconds[s] for r in res) for s in range(WARMUP, cfg.steps))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1 or args.world_size < 2 or args.micro_batch < 1:
        parser.error(f"need --steps > {WARMUP}, --rounds >= 1, --world-size >= 2, --micro-batch >= 1")

    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=256, n_layer=4, n_head=8)
    n_params = GPT(config).num_params()
    cfg = TrainConfig(steps=args.steps, batch_size=args.micro_batch * args.world_size, progress=False)
    runs = {  # name -> (strategy, kwargs)
        "torch DDP (25 MB buckets)": ("torch", {}),
        "ours DDP (25 MB buckets)": ("ddp", {}),
        "torch DDP (2 MB buckets)": ("torch", {"bucket_cap_mb": 2}),
        "ours DDP (2 MB buckets)": ("ddp", {"bucket_cap_mb": 2}),
        "naive (1 call/param)": ("naive", {}),
    }
    print(f"{args.world_size} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__}; GPT d_model={config.d_model} n_layer={config.n_layer}: "
          f"{n_params / 1e6:.2f}M params, {4 * n_params / 2**20:.1f} MB of gradients; "
          f"{args.micro_batch} x {config.block_size} tokens per rank per step")
    step_time(args.world_size, config, cfg, "ddp")  # start the ranks and warm them up
    times = {name: [] for name in runs}
    start = time.perf_counter()
    for _ in range(args.rounds):
        for name, (strategy, kw) in runs.items():
            times[name].append(step_time(args.world_size, config, cfg, strategy, **kw))
    med = {name: min(t) for name, t in times.items()}
    print(f"\n{'strategy':<28}{'step (ms)':>11}{'spread (ms)':>14}")
    for name, t in times.items():
        print(f"{name:<28}{med[name] * 1e3:>11.1f}{(max(t) - min(t)) * 1e3:>14.1f}")
    print("\nratios (same run):")
    for cap in ("25 MB", "2 MB"):
        print(f"  ours / torch DDP, {cap} buckets: {med[f'ours DDP ({cap} buckets)'] / med[f'torch DDP ({cap} buckets)']:.3f}x")
    print(f"  naive / ours (2 MB buckets):      {med['naive (1 call/param)'] / med['ours DDP (2 MB buckets)']:.3f}x")
    print(f"  naive / ours (25 MB buckets):     {med['naive (1 call/param)'] / med['ours DDP (25 MB buckets)']:.3f}x")
    print(f"(measured in {time.perf_counter() - start:.0f} s; load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
