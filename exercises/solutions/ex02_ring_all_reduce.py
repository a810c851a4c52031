"""Reference solution for exercise 02 (kept apart from the learner's stubs)."""

import torch
import torch.distributed as dist


def _ring_step(send: torch.Tensor, recv: torch.Tensor, direction: int):
    """Send `send` to the neighbour `direction` away while receiving `recv` from the other one."""
    rank, n = dist.get_rank(), dist.get_world_size()
    works = [dist.isend(send, (rank + direction) % n), dist.irecv(recv, (rank - direction) % n)]
    for w in works:
        w.wait()


def ring_reduce_scatter(tensor: torch.Tensor, direction: int = 1) -> torch.Tensor:
    """After N-1 steps rank r holds the full sum of chunk r; returns that chunk (a view)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor.view(-1), n)
    scratch = torch.empty_like(chunks[0])  # chunk 0 is the longest
    for step in range(n - 1):
        # Chunk (r - d(k + 1)) leaves at step k; it arrived (and was summed) at step k-1. The chunk
        # arriving now is the one the upstream neighbour (r - d) sends, (r - d(k + 2)); at the last
        # step (k = N-2) that is chunk r, now complete. d = -1 mirrors the ring.
        send = chunks[(rank - direction * (step + 1)) % n]
        target = chunks[(rank - direction * (step + 2)) % n]
        incoming = scratch[: target.numel()]
        _ring_step(send, incoming, direction)
        target.add_(incoming)
    return chunks[rank]


def ring_all_gather(tensor: torch.Tensor, direction: int = 1) -> torch.Tensor:
    """Start by sending my own chunk r; forward what arrives. Received chunks land in place."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor.view(-1), n)
    for step in range(n - 1):
        _ring_step(chunks[(rank - direction * step) % n], chunks[(rank - direction * (step + 1)) % n], direction)
    return tensor


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Both directions of every link: one half of the elements around the ring to the right, the
    other half to the left. Each half: reduce-scatter, then all-gather."""
    first, second = torch.tensor_split(tensor.view(-1), 2)
    for half, direction in ((first, 1), (second, -1)):
        ring_reduce_scatter(half, direction)
        ring_all_gather(half, direction)
    return tensor
