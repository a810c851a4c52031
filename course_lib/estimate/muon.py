"""Sharded Muon's formulas (notebook 08): who orthogonalises which matrix, bytes and FLOPs per rank.

The runtime is course_lib.parallel.zero.muon (its docstring has the picture). Each 2-D matrix of
shape (d0, d1) is cut on dim 0 into N blocks of c = ceil(d0 / N) rows (the last padded with zero
rows), so a rank's block holds s = c * d1 elements; momentum and gradients are fp32 (e = 4 bytes),
Newton-Schulz's output bf16 (2 bytes). Per matrix and step, as CommTracer counts them (the logical
payload of each call: a rank's input buffers sent, its output buffers received):

    reduce_scatter_single  the mean gradient's block       every rank: sent N s e, recv s e
    method "gather":
      all_gather_single    the momentum update, whole      every rank: sent s e,   recv N s e
    methods "owner" / "balanced" (o = the matrix's owner):
      gather               the momentum update to o        every rank: sent s e;   o recv N s e
      scatter              o's orthogonalised blocks       o sent N s 2;           every rank recv s 2
    all_gather_single      the updated parameter blocks    every rank: sent s e,   recv N s e

So "gather" moves N s e into every rank (N^2 s e in all) to run Newton-Schulz N times on the same
matrix; "owner" moves N s e into one rank and N s 2 out of it, and runs it once. Which rank owns
which matrix is `assign_owners`: "owner" deals the matrices out in order (rank i mod N), which can
leave one rank the big MLP matrices; "balanced" gives each matrix, largest first, to the rank with
the fewest elements so far (greedy longest-processing-time scheduling, Graham 1969).

Newton-Schulz's FLOPs on a matrix with m = min(d0, d1) rows after the transpose and n = max(d0, d1):
each step is X X^T (2 m^2 n), A A (2 m^3) and (b A + c A A) X (2 m^2 n).
"""

from __future__ import annotations

METHODS = ("gather", "owner", "balanced")
MOMENTUM_BYTES, UPDATE_BYTES = 4, 2  # fp32 momentum, gradients and parameters; bf16 Newton-Schulz output


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {METHODS}")


def shard_rows(d0: int, world_size: int) -> int:
    """c = ceil(d0 / N): the rows of every rank's block (the last ones padded)."""
    return -(-d0 // world_size)


def assign_owners(shapes, world_size: int, method: str) -> list[int] | None:
    """The rank that orthogonalises each matrix (None for "gather": every rank does)."""
    check_method(method)
    if method == "gather":
        return None
    if method == "owner":
        return [i % world_size for i in range(len(shapes))]
    load, owners = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))  # least loaded, lowest rank on a tie
        owners[i] = rank
        load[rank] += shapes[i][0] * shapes[i][1]
    return owners


def newton_schulz_flops(shape, steps: int = 5) -> int:
    """Multiply-adds times two of `steps` Newton-Schulz iterations on a matrix of `shape`."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def flops_per_rank(shapes, world_size: int, method: str, steps: int = 5) -> list[int]:
    """Newton-Schulz FLOPs each rank runs in one optimizer step."""
    owners = assign_owners(shapes, world_size, method)
    if owners is None:
        return [sum(newton_schulz_flops(s, steps) for s in shapes)] * world_size
    out = [0] * world_size
    for s, o in zip(shapes, owners):
        out[o] += newton_schulz_flops(s, steps)
    return out


def muon_traffic(shapes, world_size: int, method: str) -> list[dict[str, dict[str, int]]]:
    """Per rank, {op: {"calls", "bytes_sent", "bytes_recv"}} of one sharded Muon step, in the form
    of CommTracer.summary() (the table in the module docstring)."""
    owners = assign_owners(shapes, world_size, method)
    n, e, u = world_size, MOMENTUM_BYTES, UPDATE_BYTES
    per_rank = [{} for _ in range(n)]

    def add(rank, op, sent, recv):
        rec = per_rank[rank].setdefault(op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
        rec["calls"] += 1
        rec["bytes_sent"] += sent
        rec["bytes_recv"] += recv

    for i, (d0, d1) in enumerate(shapes):
        s = shard_rows(d0, n) * d1
        for r in range(n):
            add(r, "reduce_scatter_single", n * s * e, s * e)
            if owners is None:
                add(r, "all_gather_single", s * e, n * s * e)
            else:
                mine = owners[i] == r
                add(r, "gather", s * e, n * s * e if mine else 0)
                add(r, "scatter", n * s * u if mine else 0, s * u)
            add(r, "all_gather_single", s * e, n * s * e)
    return [dict(sorted(d.items())) for d in per_rank]


def load_imbalance(per_rank: list[int]) -> float:
    """max / mean of a per-rank load (1.0 is perfectly balanced)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0
