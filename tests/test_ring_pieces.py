"""The ring sends each step's chunk in pieces, and recursive doubling its whole tensor
(course_lib.comm.p2p.PIECE_BYTES, 2 MiB). Tensors large enough to need several pieces would make
these tests slow, so the rank code lowers PIECE_BYTES for one call: the same code path, on tensors
of a few hundred bytes. Every tensor is made on the rank's device (checked under COURSE_NCCL_RULES=1).
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from course_lib import CommTracer, comm, run_on_ranks
from course_lib.comm import p2p, ringviz
from course_lib.runtime.device import rank_device

PIECE = 16  # bytes: 2 float64 / int64 or 4 float32 elements per piece, at most


@contextlib.contextmanager
def _pieces_of(nbytes):
    saved = p2p.PIECE_BYTES  # read by p2p.piece_count, which the ring and the tree call
    p2p.PIECE_BYTES = nbytes
    try:
        yield
    finally:
        p2p.PIECE_BYTES = saved


def _cases(n):
    # (dtype, numel): N divides numel; it does not (uneven chunks, and pieces uneven within
    # them); a tensor smaller than N (empty chunks and pieces); one chunk in exactly 3 pieces
    return [(torch.float32, 8 * n), (torch.float64, 5 * n + 3), (torch.int64, n - 1 or 1),
            (torch.float32, 3 * 4 * n)]


def _random(numel, dtype):
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (numel,), dtype=dtype, device=rank_device())
    return torch.randn(numel, dtype=torch.float64).to(rank_device(), dtype)


def _pieced_against_whole():
    """Rank code: for each case, the ring in pieces of PIECE bytes against the ring in one piece
    per chunk (the default at these sizes) and against dist.all_reduce; with the messages the
    pieced ring sent, per call (bytes, peer)."""
    n = dist.get_world_size()
    rows = []
    for dtype, numel in _cases(n):
        x = _random(numel, dtype)
        whole = x.clone()
        comm.ring_all_reduce(whole)
        pieced = x.clone()
        with _pieces_of(PIECE), CommTracer() as tracer:
            out = comm.ring_all_reduce(pieced)
        ref = x.clone()
        dist.all_reduce(ref)
        if dtype.is_floating_point:
            # Any summation order is within (N-1) * eps * sum|x_i| of the exact sum, so two orders
            # (the ring's and gloo's) are within twice that.
            bound = x.abs().double()
            dist.all_reduce(bound)
            close = bool(((pieced.double() - ref.double()).abs() <= 2 * (n - 1) * torch.finfo(dtype).eps * bound).all())
        else:
            close = torch.equal(pieced, ref)
        sent = [(r.bytes_sent, r.peer) for r in tracer.records if r.op == "isend"]
        received = sum(r.bytes_recv for r in tracer.records)
        # exact: cutting into pieces does not change which terms are added in which order
        rows.append((str(dtype), numel, torch.equal(pieced, whole), close, out is pieced, sent, received))
    return rows


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pieced_ring_is_bitwise_the_whole_ring_with_the_same_bytes(world_size):
    n = world_size
    per_rank = run_on_ranks(_pieced_against_whole, world_size=n, timeout_s=60, check_collectives=False)
    for rank, rows in enumerate(per_rank):
        for (dtype, numel, same, close, in_place, sent, received), (dt, _) in zip(rows, _cases(n)):
            where = f"rank {rank} {dtype} numel={numel}"
            assert same and close and in_place, where
            itemsize = dt.itemsize
            # every message goes right, none is empty, none exceeds a piece
            assert all(peer == (rank + 1) % n and 0 < b <= PIECE for b, peer in sent), (where, sent)
            # bytes: the formula 2(N-1)/N * S, exactly when N divides numel, else within one
            # element per step (chunk rounding, as for the whole ring)
            total = sum(b for b, _ in sent)
            formula = comm.theory_bytes_sent("ring", numel * itemsize, n)
            if numel % n == 0:
                assert total == received == formula, where
            else:
                assert abs(total - formula) <= 2 * (n - 1) * itemsize, where
            # messages: each step sends ceil(chunk bytes / PIECE) pieces of the chunk it sends
            chunk_elems = -(-numel // n)
            pieces = -(-chunk_elems * itemsize // PIECE)
            if numel % n == 0:
                assert len(sent) == 2 * (n - 1) * pieces, where


def _halves_pieced():
    """Rank code: ring reduce-scatter and all-gather in pieces against one piece per chunk."""
    n = dist.get_world_size()
    x = _random(7 * n + 2, torch.float64)
    whole_rs, pieced_rs = x.clone(), x.clone()
    comm.ring_reduce_scatter(whole_rs)
    with _pieces_of(PIECE):
        mine = comm.ring_reduce_scatter(pieced_rs)
    whole_ag, pieced_ag = x.clone(), x.clone()
    comm.ring_all_gather(whole_ag)
    with _pieces_of(PIECE):
        comm.ring_all_gather(pieced_ag)
    s, e = comm.chunk_bounds(x.numel(), n)[dist.get_rank()]
    return torch.equal(pieced_rs, whole_rs), mine.numel() == e - s, torch.equal(pieced_ag, whole_ag)


def test_pieced_halves_equal_the_whole_ones():
    assert run_on_ranks(_halves_pieced, world_size=3, timeout_s=60) == [(True, True, True)] * 3


def _observed_in_pieces():
    with _pieces_of(8):  # one int64 per piece: every chunk of 2-3 elements in 2-3 messages
        return ringviz.observe_ring_all_reduce()


@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_pieced_ring_goes_through_the_simulated_states(world_size):
    """on_step still sees whole steps: the real ring's state after every step is the simulation's."""
    n = world_size
    per_rank = run_on_ranks(_observed_in_pieces, world_size=n, timeout_s=60)
    sim = ringviz.simulate_ring(n)
    assert [[per_rank[r][step] for r in range(n)] for step in range(len(sim))] == sim



def _tree_pieced_against_whole():
    """Rank code: recursive doubling in pieces of PIECE bytes against one message per round (the
    default at these sizes) and against dist.all_reduce, with the messages it sent (bytes, peer)."""
    rows = []
    for dtype, numel in _cases(dist.get_world_size()):
        x = _random(numel, dtype)
        whole, pieced, ref = x.clone(), x.clone(), x.clone()
        comm.tree_all_reduce(whole)
        with _pieces_of(PIECE), CommTracer() as tracer:
            comm.tree_all_reduce(pieced)
        dist.all_reduce(ref)
        sent = [(r.bytes_sent, r.peer) for r in tracer.records if r.op == "isend"]
        # int64 sums are exact, so equal to gloo's; floats: the same additions as the whole tree
        rows.append((str(dtype), numel, torch.equal(pieced, whole), dtype != torch.int64 or torch.equal(pieced, ref),
                     sent))
    return rows


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_pieced_tree_is_bitwise_the_whole_tree_with_the_same_bytes(world_size):
    n = world_size
    p = 1 << (n.bit_length() - 1)
    per_rank = run_on_ranks(_tree_pieced_against_whole, world_size=n, timeout_s=60, check_collectives=False)
    for rank, rows in enumerate(per_rank):
        for (dtype, numel, same, exact, sent), (dt, _) in zip(rows, _cases(n)):
            where = f"rank {rank} {dtype} numel={numel}"
            nbytes = numel * dt.itemsize
            pieces = -(-nbytes // PIECE)
            assert same and exact, where
            assert sum(b for b, _ in sent) == comm.theory_bytes_sent("tree", nbytes, n, rank), where
            if rank >= p:  # folded in: its tensor to rank - p, in pieces
                assert [peer for _, peer in sent] == [rank - p] * pieces and all(b <= PIECE for b, _ in sent), where
                continue
            butterfly = [(b, peer) for b, peer in sent if peer < p]
            # log2 p rounds, each the whole tensor in pieces to the partner rank XOR 2^j
            assert [peer for _, peer in butterfly] == [rank ^ (1 << j) for j in range(p.bit_length() - 1)
                                                      for _ in range(pieces)], where
            assert all(0 < b <= PIECE for b, _ in butterfly), where
            # and the answer, whole, to the folded-in partner
            assert [(b, peer) for b, peer in sent if peer >= p] == ([(nbytes, rank + p)] if rank < n - p else []), where
