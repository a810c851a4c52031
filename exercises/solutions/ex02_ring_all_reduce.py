"""Reference solution for exercise 02 (kept apart from the learner's stubs)."""

import torch
import torch.distributed as dist


def _ring_step(send: torch.Tensor, recv: torch.Tensor):
    """Send `send` to the right neighbour while receiving `recv` from the left one."""
    rank, n = dist.get_rank(), dist.get_world_size()
    works = [dist.isend(send, (rank + 1) % n), dist.irecv(recv, (rank - 1) % n)]
    for w in works:
        w.wait()


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """After N-1 steps rank r holds the full sum of chunk r; returns that chunk (a view)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor.view(-1), n)
    scratch = torch.empty_like(chunks[0])  # chunk 0 is the longest
    for step in range(n - 1):
        # Chunk (r - k - 1) leaves at step k; it arrived (and was summed) at step k-1. The chunk
        # arriving now is the one the left neighbour sends, (r - k - 2); at the last step
        # (k = N-2) that is chunk r, now complete.
        send = chunks[(rank - step - 1) % n]
        target = chunks[(rank - step - 2) % n]
        incoming = scratch[: target.numel()]
        _ring_step(send, incoming)
        target.add_(incoming)
    return chunks[rank]


def ring_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Start by sending my own chunk r; forward what arrives. Received chunks land in place."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor.view(-1), n)
    for step in range(n - 1):
        _ring_step(chunks[(rank - step) % n], chunks[(rank - step - 1) % n])
    return tensor


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter, then all-gather: 2(N-1) steps, 2(N-1)/N of the bytes per rank."""
    ring_reduce_scatter(tensor)
    return ring_all_gather(tensor)
