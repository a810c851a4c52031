"""A measured table of collective times, and the one function that costs a collective on any link.

The alpha-beta model (costmodel.py) says one collective of S bytes on N ranks takes
a(N) alpha + b(N) S / beta. On a real network a table of measured times follows that line
closely. Emulated ranks that share a few CPU cores do not: a 16 KiB all-reduce of 8 ranks on
2 cores can take longer than a 1 MiB one (each of the ring's 2(N-1) hops waits for the next
rank to be scheduled, and TCP's small-message handling adds its own delays), so one (alpha,
beta) pair fitted through all sizes is wrong almost everywhere.

CollectiveTable keeps what was measured instead: for each (op, group size) the seconds of one
call at a few sizes S_0 < S_1 < ..., and between two measured sizes the straight line through
them, which is again  T(S) = alpha_i + S / beta_i,  one (alpha, beta) pair per size range (as
NCCL's tuner holds one latency and bandwidth per protocol and picks by size):

    S <= S_0            T(S_0)                     (latency: nothing is faster than the smallest)
    S_i <= S <= S_i+1   T(S_i) + (S - S_i) (T(S_i+1) - T(S_i)) / (S_i+1 - S_i)
    S > S_last          T(S_last) * S / S_last     (bandwidth-bound: time grows with the bytes)

S is always the full tensor: the all-reduce's tensor, the all-gather's output, the
reduce-scatter's input, the all-to-all's input, one point-to-point message ("send", group 2).
A group size that was not measured uses the nearest measured one (larger first).

    collective_time(link, op, nbytes, n)    a LinkModel (alpha-beta formulas) or a CollectiveTable
    measure_table(sizes, group_sizes, ops)  rank code: every rank in a group of each size at once
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.comm.costmodel import LinkModel, predict_time, synchronize
from course_lib.comm.process_groups import own_group

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
# the alpha-beta formula (costmodel.cost_terms) of each op on a LinkModel
ALGORITHM_OF = {"all_reduce": "ring", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                "all_to_all": "all_to_all"}


@dataclass(frozen=True)
class CollectiveTable:
    """Measured seconds per call: entries[op][str(group size)] = [[sizes...], [seconds...]]
    (string keys so that the table round-trips through JSON). `fit`: one alpha-beta line
    through the whole world's all-reduces, for comparison and for printing alpha and beta."""

    name: str
    entries: dict = field(default_factory=dict)
    fit: LinkModel | None = None

    @property
    def alpha(self) -> float:
        return self.fit.alpha if self.fit else 0.0

    @property
    def beta(self) -> float:
        return self.fit.beta if self.fit else float("inf")

    def seconds(self, op: str, nbytes: float, n: int) -> float:
        if op not in OPS:
            raise ValueError(f"op={op!r} must be one of {OPS}")
        if n <= 1:
            return 0.0
        by_size = self.entries.get(op)
        if not by_size:
            raise ValueError(f"the table {self.name!r} has no measurement of {op!r}")
        measured = sorted(int(g) for g in by_size)
        larger = [g for g in measured if g >= n]
        group = larger[0] if larger else measured[-1]
        sizes, times = by_size[str(group)]
        if nbytes <= sizes[0]:
            return times[0]
        if nbytes >= sizes[-1]:
            return times[-1] * nbytes / sizes[-1]
        i = bisect.bisect_right(sizes, nbytes) - 1
        return times[i] + (nbytes - sizes[i]) * (times[i + 1] - times[i]) / (sizes[i + 1] - sizes[i])

    def message_time(self, nbytes: float) -> float:
        """One point-to-point message (LinkModel's method of the same name)."""
        return self.seconds("send", nbytes, 2)


def collective_time(link, op: str, nbytes: float, n: int) -> float:
    """Seconds of one `op` on a tensor of `nbytes` (the full tensor, see the module docstring)
    over a group of n ranks, on a LinkModel (ring formulas of costmodel) or a CollectiveTable."""
    if op not in OPS:
        raise ValueError(f"op={op!r} must be one of {OPS}")
    if isinstance(link, CollectiveTable):
        return link.seconds(op, nbytes, n)
    if n <= 1:
        return 0.0
    if op == "send":
        return link.message_time(nbytes)
    return predict_time(ALGORITHM_OF[op], nbytes, n, link)


def table_to_dict(table: CollectiveTable) -> dict:
    fit = table.fit
    return {"kind": "table", "name": table.name, "entries": table.entries,
            "fit": None if fit is None else {"alpha": fit.alpha, "beta": fit.beta, "name": fit.name}}


def link_from_dict(d: dict):
    """A LinkModel or a CollectiveTable from its JSON form."""
    if d.get("kind") == "table":
        return CollectiveTable(d["name"], d["entries"], None if d["fit"] is None else LinkModel(**d["fit"]))
    return LinkModel(**{k: d[k] for k in ("alpha", "beta", "name") if k in d})


# ----------------------------------------------------------------------------- measuring (rank code)
def _call(op, group, peer, shard, recv, full):
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        all_gather_single(full, shard, group=group)
    elif op == "reduce_scatter":
        reduce_scatter_single(shard, full, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(recv, full, group=group)
    else:  # a round trip between the pair (rank, peer): one message each way
        if dist.get_rank() < peer:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)


def _alone(between, iters: int) -> float:
    """Seconds per call of between() on this rank, every rank timing its own at once (as the
    calls in measure_table are timed)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        between()
    return (time.perf_counter() - t0) / iters


def measure_table(sizes, group_sizes, ops=OPS, iters: int = 6, rounds: int = 2, name: str = "measured",
                  device=None, between=None) -> dict:
    """Rank code on every rank of the world: for each op, group size g (dividing the world; the
    world is cut into consecutive groups of g, all calling at once, as a layout's groups do) and
    size, the mean seconds of `iters` calls in a row, the smallest mean over `rounds` passes, the
    slowest rank's. Returns the `entries` of a CollectiveTable (the same on every rank). device:
    where the buffers live (as in costmodel.ping_pong: the rank's device on GPU ranks, None for
    the CPU).

    between: None, the calls back to back; or a function every rank runs before each call (a
    stretch of compute, as a training step runs between two collectives), whose own seconds,
    timed alone on every rank at once just before, are taken off: a call's seconds when it
    follows compute. On emulated ranks sharing cores that costs more than back to back, where
    the ranks of a group run in step (calibrate.spacing says how much). What is taken off is
    the SLOWEST rank's stretch, from the slowest rank's loop: the step-time model prices compute
    at the slowest rank's pace (calibrate.paced_seconds), so the wait for the slowest rank is
    already in it. Taking each rank's own stretch off its own loop and keeping the largest
    difference counted that wait twice: it took off the FASTEST rank's stretch, since every
    rank's loop ends with the same last call. Measured on 8 ranks and 2 cores: 0.2-0.4 ms
    stretches, a 2-rank call 0.3-0.8 ms (12-28%) dearer that way; read with those prices the
    planner's model put 16 of 19 layouts high (signed median +10%), with these 13 (+4%), in
    the same run of benchmarks/bench_planner.py."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for g in group_sizes:
        if world % g or g < 2:
            raise ValueError(f"group size {g} must be >= 2 and divide the world size {world}")
    # collective: every rank creates every group, one size after another
    groups = {g: own_group([range(start, start + g) for start in range(0, world, g)], rank) for g in group_sizes}
    entries = {op: {str(g): [list(sizes), [float("inf")] * len(sizes)] for g in group_sizes} for op in ops}
    for _ in range(rounds):
        for op in ops:
            for g in group_sizes:
                numels = [max(g, int(s) // 4 // g * g) for s in sizes]  # whole shards of float32
                for i, numel in enumerate(numels):
                    if op == "send" and g != 2:
                        continue
                    full, shard = torch.zeros(numel, device=device), torch.zeros(numel // g, device=device)
                    recv = shard if op == "reduce_scatter" else torch.zeros(numel, device=device)
                    peer, group = rank ^ 1, groups[g]
                    _call(op, group, peer, shard, recv, full)  # warm-up: connections, buffers
                    alone = 0.0 if between is None else _alone(between, iters)
                    dist.barrier()
                    synchronize(device)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        if between is not None:
                            between()
                        _call(op, group, peer, shard, recv, full)
                    synchronize(device)
                    # the slowest rank's loop less the slowest rank's stretch (see the docstring)
                    elapsed = torch.tensor([(time.perf_counter() - t0) / iters, alone], dtype=torch.float64,
                                           device=device)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    per_call = max(float(elapsed[0]) - float(elapsed[1]), 0.0)
                    if op == "send":
                        per_call /= 2  # a round trip is two messages
                    cell = entries[op][str(g)][1]
                    cell[i] = min(cell[i], per_call)
    if "send" in entries:  # point to point is measured on pairs only
        entries["send"] = {"2": entries["send"]["2"]} if "2" in entries["send"] else {}
    return entries
