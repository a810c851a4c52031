"""Rank start-up and dispatch cost of run_on_ranks vs a fresh torch.multiprocessing.spawn,
and the CommTracer's overhead on a 16 MB all-reduce loop.

    python benchmarks/bench_runtime.py

Prints times side by side and ratios; nothing here is asserted (machines are noisy).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from course_lib import CommTracer, run_on_ranks
from course_lib.runtime import _free_port, shutdown_pools, threads_per_rank

REDISPATCH_CALLS = 20


def trivial():
    return dist.get_rank()


def _spawned(rank, world_size, port):
    torch.set_num_threads(threads_per_rank(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    trivial()
    dist.barrier()
    dist.destroy_process_group()


def fresh_spawn_seconds(world_size: int) -> float:
    start = time.perf_counter()
    tmp.spawn(_spawned, args=(world_size, _free_port()), nprocs=world_size, join=True)
    return time.perf_counter() - start


def pool_seconds(world_size: int) -> tuple[float, float]:
    shutdown_pools()
    start = time.perf_counter()
    run_on_ranks(trivial, world_size=world_size, check_collectives=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(REDISPATCH_CALLS):
        run_on_ranks(trivial, world_size=world_size, check_collectives=False)
    return first, (time.perf_counter() - start) / REDISPATCH_CALLS


def allreduce_loop(rounds: int = 6, iters: int = 5, mb: int = 16):
    """Alternate untraced and traced blocks so drift in machine load hits both equally."""
    t = torch.ones(mb * 2**20 // 4)
    plain = traced = 0.0
    dist.all_reduce(t)  # warm-up
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        plain += time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        with CommTracer():
            for _ in range(iters):
                dist.all_reduce(t)
        traced += time.perf_counter() - start
    return plain / (rounds * iters), traced / (rounds * iters)


def main():
    print(f"{'world size':>10} {'fresh mp.spawn':>15} {'pool 1st call':>14} {'pool re-dispatch':>17} {'spawn / re-dispatch':>20}")
    for ws in (2, 4, 8):
        spawn_s = fresh_spawn_seconds(ws)
        first, again = pool_seconds(ws)
        print(f"{ws:>10} {spawn_s:>13.2f} s {first:>12.2f} s {again * 1e3:>14.1f} ms {spawn_s / again:>19.0f}x")
    print("(re-dispatch target: under 150 ms at world size 4)")

    results = run_on_ranks(allreduce_loop, world_size=4, check_collectives=False, timeout_s=300)
    plain = max(r[0] for r in results)
    traced = max(r[1] for r in results)
    print(f"\n16 MB all_reduce on 4 ranks: {plain * 1e3:.1f} ms untraced, {traced * 1e3:.1f} ms traced "
          f"-> tracer overhead {100 * (traced / plain - 1):+.1f}% (target under 5%)")
    shutdown_pools()


if __name__ == "__main__":
    main()
