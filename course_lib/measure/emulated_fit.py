"""The constants of the emulated-rank cost model (course_lib.estimate.emulated), each fitted by
its own micro-benchmark, in the same run as the collectives they predict.

    interleaved(cores, sizes_mb)  rank code, every rank: the micro-benchmarks and the course's
                               collectives, alternating round by round (what the benchmark runs)
    probe(cores)               rank code, every rank: the micro-benchmarks alone
    fit_constants(raw, cores)  parent: EmulatedConstants from every rank's probe() or interleaved()
    fit_gamma(sizes, seconds)  seconds per byte of an in-place add (a line's slope)

The micro-benchmarks:

    x(m)    every rank sends m bytes to its right neighbour while receiving m from its left
            (comm.p2p.exchange, the call every step of the course's collectives makes), several
            such steps in a row, every rank at once, back to back, and when ranks outnumber cores
            also x+(m), each step after an add of what the last one brought, as in a collective,
            its time taken off (after_compute): a ping-pong in both directions around a
            ring, at sizes from 64 KiB to 64 MiB (a 1-64 MiB collective's messages: 2 MiB ring
            pieces, whole tensors for recursive doubling, the all-to-all's S/N). Not
            costmodel.ping_pong: one pair, one direction at a time, the fastest round trip kept, is the link of a cluster, not a step
            of a collective among processes that wait on each other (that alpha-beta fit predicted
            10-24% of the ring's time here). exchange_seconds is the pairwise variant (r, r ^ 1).
    gamma   x.add_(y) on rank 0 alone at three sizes beyond the caches; gamma = the slope
    sigma   calibrate.copy_bandwidth on the first `cores` ranks at once, then on every rank at once:
            the mean rate per rank of each
    t0      interleaved() only: one 4-byte ring step timed exactly as the collectives are, as
            many times per round as a 1 MiB collective (repeats())

Every time is a median over calls, not a minimum: the collectives it predicts are reported as
medians (benchmarks/bench_collectives.py), and on a shared machine the fastest call of a
micro-benchmark is a machine that the collective's calls rarely get.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from course_lib.comm.collectives import ALL_REDUCE_ALGORITHMS, pairwise_all_to_all
from course_lib.comm.costmodel import fit_alpha_beta
from course_lib.comm.p2p import PIECE_BYTES, exchange
from course_lib.estimate.emulated import EmulatedConstants
from course_lib.measure.calibrate import copy_bandwidth, sustained_seconds

EXCHANGE_SIZES = (1 << 16, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 24, 1 << 25, 1 << 26)
ADD_SIZES = (1 << 22, 1 << 24, 1 << 26)  # 4, 16, 64 MiB: beyond the caches, as the collectives' adds
COPY_BYTES = 1 << 24
SAMPLE_MB = 8  # see repeats()


def _pass(buffers, right, left, after_add: bool = False) -> list:
    """For each buffer triple: seconds per exchange over several exchanges in a row (16 up to
    2 MiB, where one is a wake-up or two and varies most, and every piece of a large ring or tree
    is 2 MiB; else 4), each sending to `right` and
    receiving from `left` (one step of a ring), after a one-byte exchange that starts the ranks
    together. after_add: each received message is added into the third buffer before the next
    exchange, as the ring's reduce-scatter and the tree add each piece they receive, and those
    adds, timed alone just before, are taken off (gamma prices them): an exchange that follows
    compute, as a collective's do. Else back to back (after_compute says when both are
    measured)."""
    sync_out, sync_in = torch.zeros(1), torch.zeros(1)
    out = []
    for buf_out, buf_in, acc in buffers:
        steps = 16 if buf_out.numel() <= PIECE_BYTES else 4
        received, adds = buf_in.view(torch.float32), 0.0
        if after_add:
            t0 = time.perf_counter()
            for _ in range(steps):
                acc.add_(received)
            adds = time.perf_counter() - t0
        add = (lambda: acc.add_(received)) if after_add else None
        done = exchange(sync_out, right, sync_in, left)
        t0 = time.perf_counter()
        for _ in range(steps):  # each exchange's works held until the next, as the ring does (see exchange)
            done = exchange(buf_out, right, buf_in, left, on_arrival=add)
        out.append(max(time.perf_counter() - t0 - adds, 0.0) / steps)
    del done
    return out


def _buffers(sizes) -> list:
    """(send, receive, accumulate) buffers of each size in bytes (a multiple of 4)."""
    return [(torch.zeros(int(s), dtype=torch.uint8), torch.zeros(int(s), dtype=torch.uint8),
             torch.zeros(int(s) // 4)) for s in sizes]


def exchange_seconds(sizes=EXCHANGE_SIZES, rounds: int = 7, all_pairs: bool = True,
                     after_add: bool = False) -> list | None:
    """Rank code: median seconds of one exchange of each size between ranks r and r ^ 1 (rank 0's
    clock; None on the other ranks). all_pairs: every pair (0,1), (2,3), ... at once, as every
    rank of a collective sends and receives at once; else only ranks 0 and 1 (the others wait).
    after_add: each exchange after an add (_pass).
    The sizes are measured in `rounds` interleaved passes after one warm-up pass (as
    costmodel.ping_pong does), so a burst of load from elsewhere slows one pass of every size."""
    rank, n = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    active = peer < n and (all_pairs or rank <= 1)
    buffers = _buffers(sizes)
    passes = [_pass(buffers, peer, peer, after_add) for _ in range(rounds + 1 if active else 0)][1:]
    dist.barrier()
    return [statistics.median(p[i] for p in passes) for i in range(len(sizes))] if rank == 0 else None


def add_seconds(nbytes: int, seconds: float = 0.2) -> float:
    """Sustained seconds of x.add_(y) on float32 tensors of `nbytes` each."""
    x, y = torch.randn(nbytes // 4), torch.randn(nbytes // 4)
    return sustained_seconds(lambda: x.add_(y), seconds)


def probe(cores: int, sizes=EXCHANGE_SIZES, add_sizes=ADD_SIZES, copy_bytes: int = COPY_BYTES,
          seconds: float = 0.2) -> dict:
    """Rank code, on every rank of a world of >= 2: {"exchange" (seconds per size back to back,
    rank 0), "exchange_after_add" (after an add, where ranks outnumber cores; else None), "add"
    (seconds per add size, rank 0 alone), "copy_cores" (this rank's copy bytes/s while the first
    `cores` ranks copy at once; None on the others), "copy_all" (while every rank copies)}."""
    if dist.get_world_size() < 2:
        raise ValueError("probe needs at least 2 ranks (the exchange is between ranks r and r ^ 1)")
    dist.barrier()
    x = exchange_seconds(sizes)  # every pair at once
    after = exchange_seconds(sizes, after_add=True) if after_compute(dist.get_world_size(), cores) else None
    return probe_rates(cores, add_sizes, copy_bytes, seconds) | {"exchange": x, "exchange_after_add": after}


def probe_rates(cores: int, add_sizes=ADD_SIZES, copy_bytes: int = COPY_BYTES, seconds: float = 0.2) -> dict:
    """Rank code, on every rank: {"add", "copy_cores", "copy_all"} of probe()."""
    rank = dist.get_rank()
    dist.barrier()
    add = [add_seconds(s, seconds) for s in add_sizes] if rank == 0 else None
    dist.barrier()
    copy_cores = copy_bandwidth(copy_bytes, seconds) if rank < cores else None
    dist.barrier()
    copy_all = copy_bandwidth(copy_bytes, seconds)
    dist.barrier()
    return {"add": add, "copy_cores": copy_cores, "copy_all": copy_all}


def fit_gamma(sizes_bytes, seconds) -> float:
    """Seconds per byte of an in-place add: the slope of the line through (bytes, seconds), by
    costmodel.fit_alpha_beta (its fixed part, the call's overhead, is no part of gamma)."""
    return 1.0 / fit_alpha_beta(sizes_bytes, seconds, name="add").beta


def fit_constants(raw: list, cores: int, sizes=EXCHANGE_SIZES, add_sizes=ADD_SIZES) -> EmulatedConstants:
    """EmulatedConstants from every rank's probe() (raw[r] is rank r's dict): the exchanges as
    measured (back to back, and after an add where measured), gamma fitted, and the mean copy
    rate per rank of the `cores` ranks and of all."""
    copy_cores = [r["copy_cores"] for r in raw if r["copy_cores"] is not None]
    copy_all = [r["copy_all"] for r in raw]
    return EmulatedConstants(sizes=tuple(sizes), seconds=tuple(raw[0]["exchange"]),
                             gamma=fit_gamma(add_sizes, raw[0]["add"]), cores=cores,
                             copy_cores=statistics.fmean(copy_cores), copy_all=statistics.fmean(copy_all),
                             start=raw[0].get("start", 0.0),
                             after_add=tuple(raw[0].get("exchange_after_add") or ()))


def after_compute(world_size: int, cores: int) -> bool:
    """Whether x+(m), the exchange after an add (_pass's after_add), is measured too: when ranks
    outnumber cores. A rank that computes between two exchanges, as a collective's ranks add
    what they received, gives up its core's turn and must be scheduled again before its next
    message moves, and its partners wait for that; back to back, the ranks run in step and skip
    it. Measured here (benchmarks/bench_collectives.py): on 4 ranks and 2 cores, 0.73 ms back
    to back against 0.94 ms after adds at 256 KiB; the back-to-back x alone predicted all nine
    collectives low (by 1-25%). On 2 ranks, each with its core, no rank waits to be scheduled:
    in two runs x after adds priced the 1 MiB collectives 20-47% high, where back to back they
    were within 25%."""
    return world_size > cores


def repeats(size_mb: float) -> int:
    """Calls per round of a collective of `size_mb` MiB in interleaved(): SAMPLE_MB / size_mb, from 1
    to 8. A 1 MiB call lasts one to a few wake-ups and swings most from call to call (its median of
    9 calls moved by up to 50% between runs here), a 16 MiB call lasts a hundred; every call is
    timed on its own, from a barrier."""
    return max(1, min(8, int(SAMPLE_MB / size_mb)))


def _collective(name: str, x: torch.Tensor):
    """A call of the course's `name` collective on x: an all-reduce of comm.ALL_REDUCE_ALGORITHMS,
    or "all_to_all" (pairwise_all_to_all of x's N equal parts)."""
    if name == "all_to_all":
        inputs = list(torch.tensor_split(x, dist.get_world_size()))
        outputs = [torch.empty_like(t) for t in inputs]
        return lambda: pairwise_all_to_all(outputs, inputs)
    fn = ALL_REDUCE_ALGORITHMS[name]
    return lambda: fn(x)


def interleaved(cores: int, sizes_mb, algorithms=("ring", "tree", "all_to_all"), rounds: int = 5,
                sizes=EXCHANGE_SIZES, seconds: float = 0.2) -> dict:
    """Rank code, on every rank: probe()'s dict plus "start" (the model's t0: median seconds of one
    step of a 4-byte ring from a barrier to the slowest rank's end) and "measured" ({algorithm:
    {size_mb: median seconds}}, each call timed as its slowest rank, from a barrier). The exchanges and the collectives alternate
    round by round (one exchange pass, then every collective at every size, repeats(size) times),
    so the model's inputs and what it predicts see the same load from elsewhere on the machine."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if n < 2:
        raise ValueError("interleaved needs at least 2 ranks (the exchange is between ranks r and r ^ 1)")
    buffers, right, left = _buffers(sizes), (rank + 1) % n, (rank - 1) % n
    tensors = {mb: torch.randn(int(mb * 2**20) // 4) for mb in sizes_mb}
    calls = {(name, mb): _collective(name, x) for mb, x in tensors.items() for name in algorithms}
    passes, after_passes, times, starts = [], [], {key: [] for key in calls}, []
    measure_after = after_compute(n, cores)
    elapsed = torch.zeros(1, dtype=torch.float64)
    tiny_out, tiny_in = torch.zeros(1), torch.zeros(1)

    def timed(fn) -> float:  # from a barrier to the slowest rank's end
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed[0] = time.perf_counter() - t0
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    for round_ in range(rounds + 1):  # round 0 is a warm-up
        dist.barrier()
        one = _pass(buffers, right, left)
        after = _pass(buffers, right, left, after_add=True) if measure_after else None
        # t0: one step of a 4-byte ring, timed as the collectives below are (as often as a 1 MiB call)
        start = [timed(lambda: exchange(tiny_out, right, tiny_in, left)) for _ in range(repeats(1))]
        for (name, mb), fn in calls.items():
            for _ in range(repeats(mb)):
                t = timed(fn)
                if name != "all_to_all":
                    tensors[mb].div_(n)  # an all-reduce multiplies the sums by about N: keep them in range
                if round_ > 0:
                    times[name, mb].append(t)
        if round_ > 0:
            passes.append(one)
            after_passes.append(after)
            starts += start
    out = probe_rates(cores, seconds=seconds)
    out["exchange"] = [statistics.median(p[i] for p in passes) for i in range(len(sizes))] if rank == 0 else None
    out["exchange_after_add"] = ([statistics.median(p[i] for p in after_passes) for i in range(len(sizes))]
                                 if rank == 0 and measure_after else None)
    out["start"] = statistics.median(starts)
    out["measured"] = {name: {mb: statistics.median(times[(name, mb)]) for mb in sizes_mb} for name in algorithms}
    return out
