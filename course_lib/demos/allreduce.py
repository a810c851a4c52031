"""Hello all-reduce, with a bandwidth printout.

    torchrun --nproc-per-node=2 -m course_lib.demos.allreduce --sizes-mb 1 16 --iters 5

Every rank fills a tensor with (rank + 1), all-reduces it (sum) and checks the result is
1 + 2 + ... + N = N(N+1)/2 everywhere. Then it times all-reduce of a few sizes and prints

    algorithm bandwidth  algbw = S / t                 (bytes of the tensor per second)
    bus bandwidth        busbw = algbw * 2(N-1)/N      (what each link carries under a ring
                                                         all-reduce; comparable across N)

In a notebook: `run_on_ranks(allreduce_bandwidth, sizes_mb=(1, 16))`.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from course_lib.runtime.device import rank_device
from course_lib.runtime.launch import init_from_env, leave_process_group


def hello_allreduce() -> float:
    """All-reduce (rank + 1) and check every element equals N(N+1)/2. Returns that value."""
    n = dist.get_world_size()
    t = torch.full((4,), float(dist.get_rank() + 1), device=rank_device())
    dist.all_reduce(t)
    expected = n * (n + 1) / 2
    if not torch.all(t == expected):
        raise AssertionError(f"all_reduce gave {t.tolist()}, expected {expected} everywhere")
    return t[0].item()


def allreduce_bandwidth(sizes_mb=(1, 16), iters: int = 5, warmup: int = 1) -> list[dict]:
    """Time `iters` float32 all-reduces per size; returns rows of size, seconds, algbw, busbw."""
    n = dist.get_world_size()
    rows = []
    for mb in sizes_mb:
        numel = int(mb * 2**20) // 4
        t = torch.ones(numel, device=rank_device())
        for _ in range(warmup):
            dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        algbw = numel * 4 / seconds
        rows.append({"size_mb": mb, "seconds": seconds, "algbw_GBps": algbw / 1e9,
                     "busbw_GBps": algbw * 2 * (n - 1) / n / 1e9})
    return rows


def format_rows(rows, world_size, backend) -> str:
    lines = [f"all_reduce on {world_size} ranks ({backend})",
             f"{'size':>9} {'time/call':>11} {'algbw':>11} {'busbw':>11}"]
    for r in rows:
        lines.append(f"{r['size_mb']:>5g} MiB {r['seconds'] * 1e3:>8.2f} ms {r['algbw_GBps']:>7.2f} GB/s "
                     f"{r['busbw_GBps']:>7.2f} GB/s")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16], help="message sizes in MiB (2^20 bytes)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    if args.iters < 1 or any(s <= 0 for s in args.sizes_mb):
        parser.error(f"--iters={args.iters} must be >= 1 and every --sizes-mb must be > 0")
    backend = init_from_env()
    try:
        value = hello_allreduce()
        rows = allreduce_bandwidth(args.sizes_mb, args.iters)
        if dist.get_rank() == 0:
            n = dist.get_world_size()
            print(f"hello all-reduce: every rank holds {value:g} = 1 + ... + {n}")
            print(format_rows(rows, n, backend), flush=True)
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
