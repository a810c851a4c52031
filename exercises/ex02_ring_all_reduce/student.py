"""Exercise 02: ring all-reduce from send/recv, in both directions. Fill in the three functions,
then run the check cells of ex02_ring_all_reduce.ipynb. Each check prints PASS when your code is
right.

Rules: use only point-to-point calls (dist.send, dist.recv, dist.isend, dist.irecv or
dist.batch_isend_irecv), always as `dist.<name>(...)` so the course's tracer can count them.
No dist.all_reduce, all_gather, reduce_scatter, broadcast, ... inside these functions.

Chunks: split the flattened tensor into N chunks exactly like
    chunks = torch.tensor_split(tensor.view(-1), N)
(views sharing memory with `tensor`; when N does not divide the size the first chunks are one
element longer, and when the tensor has fewer than N elements some chunks are empty).

Directions: with direction=+1 every rank sends to its right neighbour (rank + 1) % N and
receives from its left neighbour (rank - 1) % N, as in notebook 02; with direction=-1 every
rank sends to its left neighbour and receives from its right one.
"""

import torch
import torch.distributed as dist


def ring_reduce_scatter(tensor: torch.Tensor, direction: int = 1) -> torch.Tensor:
    """Inside rank code: after N-1 ring steps in `direction`, chunk r of `tensor` on rank r
    holds the sum over all ranks of chunk r (in both directions: rank r ends with chunk r).
    Work in place (the other chunks may hold partial sums afterwards) and return chunk r (a view
    of `tensor`). At each step every rank sends one chunk and receives one. Each rank sends
    (N-1)/N of the tensor's bytes, no more.
    """
    raise NotImplementedError("exercise 02: write ring_reduce_scatter")


def ring_all_gather(tensor: torch.Tensor, direction: int = 1) -> torch.Tensor:
    """Inside rank code: on entry chunk r of `tensor` on rank r holds rank r's piece (the other
    chunks hold anything). After N-1 ring steps in `direction` every rank holds every rank's
    piece in its chunk. Work in place and return `tensor`. Each rank sends (N-1)/N of the bytes.
    """
    raise NotImplementedError("exercise 02: write ring_all_gather")


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Inside rank code: sum `tensor` over all ranks, in place, and return it, using both
    directions of every link: one half of the elements travels around the ring to the right,
    the other half to the left, so each rank sends each of its two neighbours (N-1)/N of the
    tensor's bytes (when 2N divides its size)."""
    raise NotImplementedError("exercise 02: write ring_all_reduce")
