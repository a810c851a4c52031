"""Collectives built from point-to-point messages only (send / recv / isend / irecv).

Every function here runs inside rank code (e.g. under `run_on_ranks`) and gives the same
answer as its `torch.distributed` built-in; what differs is *how the bytes travel*, which
is the point of notebook 02. With N ranks, a tensor of S bytes per rank, and the alpha-beta
model of `course_lib.comm.costmodel` (one message: alpha + S/beta, beta a bandwidth):

    algorithm                 messages on the critical path   bytes sent by the busiest rank
    ring_reduce_scatter       N-1                              (N-1)/N * S
    ring_all_gather           N-1                              (N-1)/N * S
    ring_all_reduce           2(N-1)                           2(N-1)/N * S   (RS then AG)
    tree_all_reduce           log2(p) (+2 if N != p)           log2(p) * S (+S), p = 2**floor(log2 N)
    rabenseifner_all_reduce   2 log2(p) (+2 if N != p)         2(p-1)/p * S (+S)  (trees.py)
    ps_all_reduce             2(N-1) through the server        (N-1) * S      (the server)
    sharded_ps_all_reduce     2(N-1)                           2(N-1)/N * S   (every rank serves 1/N)
    pairwise_all_to_all       N-1                              (N-1)/N * S

The ring's per-rank traffic barely grows with N (it tends to 2S), every link is busy at
every step, and no all-reduce can send less: it is bandwidth-optimal (Patarasuk & Yuan
2009). Baidu (Gibiansky 2017) and Horovod (Sergeev & Del Balso 2018) brought it to deep
learning, where it replaced the single parameter server, whose traffic grows with N.

Chunks: a tensor of numel elements is cut into N contiguous chunks exactly like
`torch.tensor_split(flat, N)` (`p2p.chunk_bounds`). Rank r owns chunk r after a
reduce-scatter, as with the built-in. Empty chunks send no message. The ring sends a large
chunk as several messages of at most PIECE_BYTES (2 MiB) each: the same bytes, the same
additions in the same order, fewer stalls (see the comment above PIECE_BYTES in p2p.py).

The ring schedule lives in ONE function, `ring_send_chunk`, used by the ring code below
and by the pure-Python simulation in `course_lib.comm.ringviz`, so the picture cannot drift
from the code.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.comm.p2p import PIECE_BYTES  # noqa: F401  (the ring's piece size, still importable from here)
from course_lib.comm.p2p import chunk_bounds, exchange, flat_view, global_rank, piece_count, rank_and_size
from course_lib.comm.trees import rabenseifner_all_reduce, tree_all_reduce

__all__ = ["chunk_bounds", "ring_send_chunk", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "tree_all_reduce", "rabenseifner_all_reduce", "ps_all_reduce", "sharded_ps_all_reduce",
           "pairwise_all_to_all", "ALL_REDUCE_ALGORITHMS", "theory_bytes_sent"]


def ring_send_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk `rank` sends to its right neighbour (rank+1) at `step` of a ring all-reduce.

    Steps 0..N-2 are the reduce-scatter phase (the receiver adds the chunk to its own),
    steps N-1..2N-3 the all-gather phase (the receiver overwrites its copy). One formula
    serves both phases:

        send chunk = (rank - step - 1) mod N,    receive chunk = ring_send_chunk(rank - 1, step)

    Each rank forwards at step k+1 exactly the chunk it received (and summed) at step k, so
    chunk c travels once around the ring picking up one contribution per hop; after step N-2
    rank r holds the complete sum of chunk r (what a reduce-scatter must leave), and at step
    N-1 it starts by sending that chunk.
    """
    return (rank - step - 1) % world_size



# ----------------------------------------------------------------------------- the ring


def _ring_steps(flat: torch.Tensor, steps: range, group, on_step) -> None:
    """Run ring steps `steps` on `flat` in place (see ring_send_chunk for the schedule)."""
    rank, n = rank_and_size(group)
    chunks = [flat[s:e] for s, e in chunk_bounds(flat.numel(), n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    # Every chunk is cut into the same number of pieces (tensor_split, like the chunks), so the
    # sender's piece j is exactly the receiver's piece j. chunks[0] is the longest.
    n_pieces = piece_count(chunks[0])
    # One scratch piece for the whole call (no per-step allocation): in the reduce-scatter
    # phase the incoming piece must be added, so it cannot land directly in place.
    longest = torch.tensor_split(chunks[0], n_pieces)[0].numel()
    scratch = torch.empty(longest, dtype=flat.dtype, device=flat.device)
    for step in steps:
        send = torch.tensor_split(chunks[ring_send_chunk(rank, step, n)], n_pieces)
        target = torch.tensor_split(chunks[ring_send_chunk(left, step, n)], n_pieces)
        for outgoing, into in zip(send, target):
            # `done` holds each exchange's works until the next one replaces them (see exchange)
            if step < n - 1:  # reduce-scatter: receive into scratch, add it in place on arrival
                incoming = scratch[: into.numel()]
                done = exchange(outgoing, right, incoming, left, group, on_arrival=lambda: into.add_(incoming))
            else:  # all-gather: the incoming piece is final, receive it straight into place
                done = exchange(outgoing, right, into, left, group)
        if on_step is not None:
            on_step(step, flat)


def ring_reduce_scatter(tensor: torch.Tensor, group=None, on_step=None) -> torch.Tensor:
    """Sum `tensor` over ranks; rank r ends with the complete sum of chunk r. N-1 steps.

    Works in place: `tensor` is the send buffer and the work space (its other chunks hold
    partial sums afterwards). Returns the view of chunk r (`torch.tensor_split` chunking).
    Each rank sends and receives (N-1)/N * S bytes.
    on_step(step, flat_tensor), if given, is called after every step (for visualisation).
    """
    flat = flat_view(tensor)
    rank, n = rank_and_size(group)
    _ring_steps(flat, range(0, n - 1), group, on_step)
    start, end = chunk_bounds(flat.numel(), n)[rank]
    return flat[start:end]


def ring_all_gather(tensor: torch.Tensor, group=None, on_step=None) -> torch.Tensor:
    """In-place all-gather: on entry chunk r of `tensor` holds rank r's piece; on return every
    rank holds every piece. N-1 steps, (N-1)/N * S bytes sent and received per rank.

    This is the all-gather phase of the ring all-reduce (steps N-1..2N-3 of the schedule).
    Returns `tensor`.
    """
    flat = flat_view(tensor)
    _, n = rank_and_size(group)
    _ring_steps(flat, range(n - 1, 2 * (n - 1)), group, on_step)
    return tensor


def ring_all_reduce(tensor: torch.Tensor, group=None, on_step=None) -> torch.Tensor:
    """Sum `tensor` over ranks in place: ring reduce-scatter, then ring all-gather.

    Time ~ 2(N-1) * alpha + 2(N-1)/N * S / beta: the bandwidth term is almost independent
    of N, which is why rings scale. Each chunk is summed in one fixed order on one rank and
    then copied, so every rank ends with bit-identical values. Returns `tensor`.
    """
    flat = flat_view(tensor)
    _, n = rank_and_size(group)
    _ring_steps(flat, range(0, 2 * (n - 1)), group, on_step)
    return tensor


# ----------------------------------------------------------------------------- parameter server
def ps_all_reduce(tensor: torch.Tensor, group=None, server: int = 0) -> torch.Tensor:
    """Sum in place through one parameter server: everyone sends to `server`, it adds the
    N-1 tensors (in rank order, so the result is deterministic) and sends the sum back.

    The server receives and sends (N-1) * S bytes while workers send and receive only S:
    its link is the bottleneck, time ~ 2(N-1) * (alpha + S / beta). Returns `tensor`.
    """
    flat = flat_view(tensor)
    rank, n = rank_and_size(group)
    if not 0 <= server < n:
        raise ValueError(f"server={server} must be a rank of the group (0..{n - 1})")
    if rank != server:
        exchange(flat, server, None, None, group)   # push my gradient
        exchange(None, None, flat, server, group)   # pull the sum
        return tensor
    scratch = torch.empty_like(flat)
    for src in range(n):
        if src != server:
            exchange(None, None, scratch, src, group)
            flat.add_(scratch)
    works = [dist.isend(flat, global_rank(group, dst), group=group) for dst in range(n) if dst != server and flat.numel()]
    for w in works:
        w.wait()
    return tensor


def sharded_ps_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum in place through N parameter-server shards, one on every rank: rank j serves chunk j.

    Push: in round k = 1..N-1 every rank sends chunk (r+k) mod N to its server r+k and receives
    chunk r from worker r-k; the server adds the N contributions in rank order. Pull: in
    round k every server sends its summed chunk to r+k and receives chunk r-k from r-k. Each
    rank sends (N-1)/N * S in each phase: 2(N-1)/N * S in all, exactly the ring's traffic,
    because push is a reduce-scatter and pull an all-gather. The single server was the
    bottleneck, not the parameter-server idea. Returns `tensor`.
    """
    flat = flat_view(tensor)
    rank, n = rank_and_size(group)
    chunks = [flat[s:e] for s, e in chunk_bounds(flat.numel(), n)]
    mine = chunks[rank]
    contributions = torch.empty((n, mine.numel()), dtype=flat.dtype, device=flat.device)
    contributions[rank] = mine
    for k in range(1, n):  # push: every worker sends each server its chunk
        dst, src = (rank + k) % n, (rank - k) % n
        exchange(chunks[dst], dst, contributions[src], src, group)
    total = contributions[0].clone()
    for src in range(1, n):  # rank order: the sum does not depend on arrival order
        total.add_(contributions[src])
    mine.copy_(total)
    for k in range(1, n):  # pull: every server sends its summed chunk to every worker
        dst, src = (rank + k) % n, (rank - k) % n
        exchange(mine, dst, chunks[src], src, group)
    return tensor


# ----------------------------------------------------------------------------- all-to-all
def pairwise_all_to_all(output_list: list[torch.Tensor], input_list: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """input_list[j] goes to rank j; output_list[j] receives what rank j sent here.

    Same contract as `dist.all_to_all`, but sizes may differ per pair (expert-parallel token
    dispatch needs that). N-1 rounds: at round k rank r sends to r+k and
    receives from r-k, so every rank is busy sending and receiving in every round, and
    each pair talks exactly once. (N-1)/N * S bytes each way per rank when splits are even.
    """
    rank, n = rank_and_size(group)
    if len(input_list) != n or len(output_list) != n:
        raise ValueError(f"input_list and output_list need one tensor per rank ({n}), "
                         f"got {len(input_list)} and {len(output_list)}")
    output_list[rank].copy_(input_list[rank])
    for k in range(1, n):
        dst, src = (rank + k) % n, (rank - k) % n
        exchange(input_list[dst], dst, output_list[src], src, group)
    return output_list


ALL_REDUCE_ALGORITHMS = {"ring": ring_all_reduce, "tree": tree_all_reduce, "rabenseifner": rabenseifner_all_reduce,
                         "ps": ps_all_reduce, "sharded_ps": sharded_ps_all_reduce}


def theory_bytes_sent(algorithm: str, nbytes: int, world_size: int, rank: int | None = None) -> float:
    """Bytes a rank sends under `algorithm` (the busiest rank when rank is None; the parameter
    server is rank 0), from the formulas in the module docstring, ignoring chunk rounding
    (exact when N divides numel)."""
    n, s = world_size, nbytes
    p = 1 << (n.bit_length() - 1)
    table = {
        "ring": 2 * (n - 1) / n * s,
        "reduce_scatter": (n - 1) / n * s,
        "all_gather": (n - 1) / n * s,
        "all_to_all": (n - 1) / n * s,
        "ps": (n - 1) * s if rank in (None, 0) else s,
        "sharded_ps": 2 * (n - 1) / n * s,
    }
    if algorithm == "rabenseifner":
        halving_doubling = 2 * (p - 1) / p * s
        if rank is None:
            return halving_doubling + (s if n > p else 0)
        if rank >= p:
            return s
        return halving_doubling + (s if rank < n - p else 0)
    if algorithm == "tree":
        if rank is None:
            return (math.log2(p) + (1 if n > p else 0)) * s
        if rank >= p:
            return s
        return (math.log2(p) + (1 if rank < n - p else 0)) * s
    if algorithm not in table:
        raise ValueError(f"algorithm={algorithm!r} is unknown: use one of {sorted(table) + ['rabenseifner', 'tree']}")
    return table[algorithm]
