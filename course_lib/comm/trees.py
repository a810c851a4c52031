"""Logarithmic all-reduces: recursive doubling and Rabenseifner's halving-doubling.

Both pair rank r with rank r XOR 2^j, so they need only ~log2 N rounds instead of the
ring's 2(N-1). They differ in what each round carries (N ranks, S bytes per rank,
p = the largest power of two <= N):

    tree_all_reduce          log2 p rounds, each swapping the WHOLE partial sum (S bytes):
                             time (log2 p) (alpha + S/beta); bytes per rank (log2 p) S
    rabenseifner_all_reduce  a reduce-scatter by recursive HALVING (S/2, S/4, ..., S/p), then
                             an all-gather by recursive DOUBLING (S/p, ..., S/2):
                             time 2 log2(p) alpha + 2 (p-1)/p S/beta; bytes 2 (p-1)/p S,
                             the ring's bandwidth with logarithmic latency (Rabenseifner 2004;
                             Thakur, Rabenseifner & Gropp 2005)

When N is not a power of two, ranks p..N-1 first hand their tensor to rank r - p (which adds
it), sit out, and get the result back at the end: two more messages of S bytes on the
critical path.

Under the alpha-beta model, for N a power of two, Rabenseifner is never slower than the ring
(for other N its fold-in adds 2S to the busiest rank's bytes, so large tensors favour the
ring). Rings are used anyway
because the model assumes every pair of ranks has its own full-speed link: halving and
doubling talk to partners N/2, N/4, ... ranks away, which on real topologies share links,
while a ring only ever uses neighbour links that any topology has.
"""

from __future__ import annotations

import torch

from course_lib.comm.p2p import chunk_bounds, exchange, flat_view, piece_count, rank_and_size


def _add_from(flat, partner, group, swap: bool) -> None:
    """flat += partner's tensor, received piece by piece (p2p.piece_count) into one scratch piece;
    with swap, ours goes to partner at the same time, piece for piece (recursive doubling). The
    add waits for the exchange to end: the piece it adds into is the piece being sent."""
    pieces = torch.tensor_split(flat, piece_count(flat))
    scratch = torch.empty_like(pieces[0])
    for piece in pieces:
        incoming = scratch[: piece.numel()]
        done = exchange(piece if swap else None, partner, incoming, partner, group)  # noqa: F841  (held: see exchange)
        piece.add_(incoming)


def _fold_in(flat, rank, n, p, group) -> bool:
    """Ranks >= p hand their tensor to rank - p and wait; returns True for those ranks (done
    once they have the answer). Ranks < n - p add their partner's tensor first."""
    if rank >= p:
        for piece in torch.tensor_split(flat, piece_count(flat)):
            done = exchange(piece, rank - p, None, None, group)  # noqa: F841  (held: see exchange)
        exchange(None, None, flat, rank - p, group)
        return True
    if rank < n - p:
        _add_from(flat, rank + p, group, swap=False)
    return False


def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum in place by recursive doubling (a butterfly of log2 N pairwise exchanges).

    At round j rank r swaps its whole partial sum with rank r XOR 2**j and adds: after
    log2(p) rounds every rank holds the total. Few messages (good for small, latency-bound
    tensors) but each carries the full S bytes (bad for large ones), in pieces of at most
    PIECE_BYTES like the ring's chunks. Partners add the same two values (a+b == b+a exactly),
    so all ranks end bit-identical. Returns `tensor`.
    """
    flat = flat_view(tensor)
    rank, n = rank_and_size(group)
    p = 1 << (n.bit_length() - 1)
    if _fold_in(flat, rank, n, p, group):
        return tensor
    mask = 1
    while mask < p:
        _add_from(flat, rank ^ mask, group, swap=True)
        mask <<= 1
    if rank < n - p:
        exchange(flat, rank + p, None, None, group)
    return tensor


def rabenseifner_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum in place: reduce-scatter by recursive halving, then all-gather by recursive doubling.

    The tensor is cut into p chunks (torch.tensor_split). Halving: at mask = p/2, p/4, ..., 1
    rank r and r XOR mask split their current range of chunks in two; the rank whose `mask` bit
    is 0 keeps the lower half, the other the upper half; each sends the half it gives away and
    adds the half it receives. After log2 p rounds rank r holds the full sum of chunk r.
    Doubling reverses it: at mask = 1, 2, ..., p/2 partners swap their ranges, so each range
    doubles until every rank has every chunk.

        rank 0 of 4, chunks [0 1 2 3]:  keep [0 1] (send [2 3] to rank 2), keep [0] (send [1]
        to rank 1): chunk 0 complete; then get [1] from rank 1, get [2 3] from rank 2.

    Each chunk's sum is formed on one rank and copied, so all ranks end bit-identical.
    Returns `tensor`.
    """
    flat = flat_view(tensor)
    rank, n = rank_and_size(group)
    p = 1 << (n.bit_length() - 1)
    if _fold_in(flat, rank, n, p, group):
        return tensor
    bounds = chunk_bounds(flat.numel(), p)

    def span(lo, hi):  # the elements of chunks lo..hi-1
        return flat[bounds[lo][0]:bounds[hi - 1][1]]

    lo, hi = 0, p
    scratch = torch.empty_like(flat)
    mask = p >> 1
    while mask:  # recursive halving: reduce-scatter
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))
        target = span(*keep)
        incoming = scratch[: target.numel()]
        exchange(span(*give), rank ^ mask, incoming, rank ^ mask, group)
        target.add_(incoming)
        lo, hi = keep
        mask >>= 1
    mask = 1
    while mask < p:  # recursive doubling: all-gather
        size = hi - lo
        other = (lo + size, hi + size) if rank & mask == 0 else (lo - size, hi - size)
        exchange(span(lo, hi), rank ^ mask, span(*other), rank ^ mask, group)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        mask <<= 1
    if rank < n - p:
        exchange(flat, rank + p, None, None, group)
    return tensor
