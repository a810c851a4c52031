"""ZeRO step time: the course's stage 3 (flat and per-parameter) against torch's FSDP2, stage 1
against torch's ZeroRedundancyOptimizer (under torch DDP), stages 0-3 against each other, prefetch
on / off, and the offload tiers (NVMe files / host memory), in one run.

    .venv/bin/python benchmarks/bench_zero.py [--world-size 4] [--steps 6] [--rounds 5] [--quick]
    TMPDIR=/mnt/nvme .venv/bin/python benchmarks/bench_zero.py     (the NVMe tier's files go under TMPDIR)

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

Per-parameter stage 3 (sharding="per_param", FSDP2's design) gathers each block in one all-gather
as the flat design does, plus a copy-in / copy-out per parameter; it is timed with prefetch on
(the flat stage 3's default) and off. The NVMe tier (per-parameter only) reads and writes
Adam's m and v, 16 bytes per local element per step per rank, through files under TMPDIR; the
host tier (flat only) steps Adam on fp32 masters in host memory, which on CPU ranks is the same
memory: so "NVMe / host" is the file round trip against none, and the disk's bandwidth, measured
here, predicts it: 16 * L * N bytes per step over one disk shared by the N ranks (L = local
elements per rank), if every byte went through the disk at the measured rates; the page cache
(reads, and writes not yet synced) can make the measured cost smaller than that.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rounds import rank_share_args, report, run_rounds  # noqa: E402  (benchmarks/ is not a package)

from course_lib.data import CharDataset  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.parallel.zero import local_elements, train_zero  # noqa: E402
from course_lib.parallel.zero.nvme import disk_bandwidth  # noqa: E402
from course_lib.parallel.zero.native import train_native  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

PER_PARAM = "course per-param stage 3"
NVME, HOST = "course per-param stage 3, NVMe offload", "course stage 3, host offload"
RUNS = {  # name -> rank-side function(config, cfg, nvme_dir) -> TrainResult
    "course stage 0 (DDP)": lambda c, cfg, d: train_zero(c, cfg, 0),
    "course stage 1": lambda c, cfg, d: train_zero(c, cfg, 1),
    "course stage 2": lambda c, cfg, d: train_zero(c, cfg, 2),
    "course stage 3": lambda c, cfg, d: train_zero(c, cfg, 3),  # flat, prefetch on (its default)
    PER_PARAM: lambda c, cfg, d: train_zero(c, cfg, 3, sharding="per_param", prefetch=True),
    "course per-param stage 3, no prefetch": lambda c, cfg, d: train_zero(c, cfg, 3, sharding="per_param"),
    NVME: lambda c, cfg, d: train_zero(c, cfg, 3, sharding="per_param", prefetch=True, offload="nvme",
                                       offload_dir=d),
    HOST: lambda c, cfg, d: train_zero(c, cfg, 3, offload=True),
    "torch ZeroRedundancyOptimizer": lambda c, cfg, d: train_native(c, cfg, "zero_redundancy"),
    "torch FSDP2 fully_shard": lambda c, cfg, d: train_native(c, cfg, "fsdp2"),
}
RATIOS = {  # label -> (numerator, denominator, target, better)
    "course stage 3 / torch FSDP2": ("course stage 3", "torch FSDP2 fully_shard", 1.3, "lower"),
    "per-param stage 3 / torch FSDP2": (PER_PARAM, "torch FSDP2 fully_shard", 1.3, "lower"),
    "per-param stage 3 / flat stage 3": (PER_PARAM, "course stage 3", None, "lower"),
    "per-param: prefetch on / off": (PER_PARAM, "course per-param stage 3, no prefetch", None, "lower"),
    "NVMe offload (per-param) / host offload (flat)": (NVME, HOST, None, "lower"),
    "per-param: NVMe offload / none": (NVME, PER_PARAM, None, "lower"),
    "flat: host offload / none": (HOST, "course stage 3", None, "lower"),
    "course stage 1 / torch ZeroRedundancyOptimizer": ("course stage 1", "torch ZeroRedundancyOptimizer", 1.3, "lower"),
    "course stage 1 / stage 0": ("course stage 1", "course stage 0 (DDP)", None, "lower"),
    "course stage 2 / stage 0": ("course stage 2", "course stage 0 (DDP)", None, "lower"),
    "course stage 3 / stage 0": ("course stage 3", "course stage 0 (DDP)", None, "lower"),
}


def one_round(config, cfg, nvme_dir, order):
    """Rank code: train with every variant of `order` in turn; step seconds per variant."""
    return {name: RUNS[name](config, cfg, nvme_dir).step_seconds for name in order}


def nvme_prediction(per_round, config, world_size: int, bandwidth: dict) -> None:
    """Print the disk's measured bandwidth, the NVMe tier's bytes per step and the time they predict,
    beside the measured difference NVMe offload - no offload (medians over the rounds)."""
    import statistics

    elements = local_elements(GPT(config), "block", world_size)
    nbytes = 16 * elements * world_size  # m and v (8 bytes per element) read and written, every rank
    predicted = nbytes / 2 / bandwidth["read"] + nbytes / 2 / bandwidth["write"]
    measured = statistics.median(r[NVME] - r[PER_PARAM] for r in per_round)
    print(f"\ndisk under {tempfile.gettempdir()}: write {bandwidth['write'] / 1e6:,.0f} MB/s (fsynced), read "
          f"{bandwidth['read'] / 1e6:,.0f} MB/s (the page cache may serve it: an upper bound)")
    print(f"NVMe tier per step: 16 B x {elements:,} local elements x {world_size} ranks = {nbytes / 1e6:.1f} MB over "
          f"one disk -> {predicted * 1e3:.1f} ms predicted; measured NVMe - no offload {measured * 1e3:.1f} ms "
          f"(the page cache can make it less than predicted)")


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
    nvme_dir = tempfile.mkdtemp(prefix="bench_zero_nvme_")  # one file per unit and rank, rewritten per run
    try:
        bandwidth = disk_bandwidth(nvme_dir, (4 if args.quick else 64) * 2**20)
        per_round = run_rounds(one_round, names, args.rounds, (config, cfg, nvme_dir),
                               None if args.quick else (config, warm, nvme_dir), **kw)  # --quick: no warm-up
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    report("bench_zero", per_round, RATIOS, save=not args.no_record, started=start)
    nvme_prediction(per_round, config, args.world_size, bandwidth)


if __name__ == "__main__":
    main()
