"""The point-to-point plumbing every collective of this package is built on.

    chunk_bounds(numel, N)           the N chunks of a flat tensor (torch.tensor_split's split)
    rank_and_size(group)             this rank's index in `group` and the group's size
    global_rank(group, group_rank)   send/recv take global ranks
    flat_view(tensor)                a 1-D view sharing memory (in-place collectives need one)
    exchange(send, dst, recv, src)   send and receive at the same time (isend + irecv, then wait)
    piece_count(tensor)              how many PIECE_BYTES (2 MiB) pieces a large message travels in

Sending and receiving at once matters: if every rank of a ring first did a blocking send,
nobody would be receiving yet.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


# A large message travels in pieces of at most PIECE_BYTES, one exchange after another, each piece
# added in place once it has arrived (the ring's chunks, recursive doubling's whole tensor), so
# the scratch a receive needs is one piece, allocated once per call. Measured on 4 emulated ranks
# sharing 2 CPU cores (benchmarks/bench_collectives.py): whole 16 MiB chunks in one message ran at
# half of gloo's speed or less on a busy machine (a message far larger than the kernel's socket
# buffers crosses in many refills, each waiting for a rank to be scheduled); 2 MiB pieces came
# within about 10% of gloo's C++ ring (which sends 1 MiB segments); 4 and 8 MiB pieces were slower
# again, and two 1 MiB pieces in flight (to overlap the add with the next transfer) cost more CPU
# time than they saved. A scratch the size of a 64 MiB tensor, by contrast, comes back from the
# allocator as fresh pages at every call: filling it took 26 ms against 8 ms for a reused one
# here.
PIECE_BYTES = 2 << 20


def piece_count(tensor: torch.Tensor) -> int:
    """How many pieces of at most PIECE_BYTES `tensor` is sent in: ceil(bytes / PIECE_BYTES), >= 1
    (cut with torch.tensor_split, so a sender's piece j is exactly its receiver's piece j)."""
    return max(1, math.ceil(tensor.numel() * tensor.element_size() / PIECE_BYTES))


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[(start, end)] of the N chunks of a flat tensor, same split as torch.tensor_split:
    the first numel % N chunks are one element longer; chunks may be empty when numel < N."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    q, rem = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + q + (1 if i < rem else 0)
        bounds.append((start, end))
        start = end
    return bounds


def rank_and_size(group) -> tuple[int, int]:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this rank is not a member of `group`: only members may call the collective")
    return rank, n


def global_rank(group, group_rank: int) -> int:
    """send/recv take global ranks; translate a rank within `group`."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def flat_view(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """A 1-D view sharing memory with `tensor` (in-place collectives need one flat buffer)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first): "
                         "the collectives work in place on one flat buffer")
    return tensor.view(-1)


def exchange(send_buf, dst, recv_buf, src, group=None, on_arrival=None) -> list:
    """Send to dst while receiving from src (group ranks); both directions overlap. Empty or
    None buffers are skipped, so a rank can only send or only receive. on_arrival(), if given,
    runs as soon as the receive has landed, while the send may still be on its way (the ring
    adds the piece it received meanwhile); exchange returns when both are done.

    Returns the finished works. A loop of exchanges (the ring) keeps them until its next
    exchange: a gloo work dropped the moment it completes waits for gloo's network thread to
    let go of its buffer, which cost the 4-rank ring about 10 ms of CPU time per 64 MiB
    all-reduce (benchmarks/bench_collectives.py's machine, 2 cores).

    The receive is posted first: gloo sends a message's bytes only once the receiver has posted
    its receive (it tells the sender so), and ours then reaches src before we spend time posting
    our own send. Except when dst and src are the same peer (a ring of 2, a tree's or
    Rabenseifner's partner): then the lower rank issues its send first and the higher its
    receive, since NCCL runs a pair's calls in issue order and if both received first, each
    receive would wait for a send queued behind the other's receive
    (course_lib/observe/nccl_rules.py)."""
    sending = send_buf is not None and send_buf.numel()
    receiving = recv_buf is not None and recv_buf.numel()
    send_first = sending and dst == src and dist.get_rank(group) < dst
    received = sent = None
    if receiving and not send_first:
        received = dist.irecv(recv_buf, global_rank(group, src), group=group)
    if sending:
        sent = dist.isend(send_buf, global_rank(group, dst), group=group)
    if receiving and send_first:
        received = dist.irecv(recv_buf, global_rank(group, src), group=group)
    if received is not None:
        received.wait()
    if on_arrival is not None:
        on_arrival()
    if sent is not None:
        sent.wait()
    return [work for work in (received, sent) if work is not None]
