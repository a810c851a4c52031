"""Exercise 02: ring all-reduce from send/recv. Fill in the three functions, then run the
check cells of ex02_ring_all_reduce.ipynb. Each check prints PASS when your code is right.

Rules: use only point-to-point calls (dist.send, dist.recv, dist.isend, dist.irecv or
dist.batch_isend_irecv), always as `dist.<name>(...)` so the course's tracer can count them.
No dist.all_reduce, all_gather, reduce_scatter, broadcast, ... inside these functions.

Chunks: split the flattened tensor into N chunks exactly like
    chunks = torch.tensor_split(tensor.view(-1), N)
(views sharing memory with `tensor`; when N does not divide the size the first chunks are one
element longer, and when the tensor has fewer than N elements some chunks are empty).
"""

import torch
import torch.distributed as dist


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """Inside rank code: after N-1 ring steps, chunk r of `tensor` on rank r holds the sum over
    all ranks of chunk r. Work in place (the other chunks may hold partial sums afterwards) and
    return chunk r (a view of `tensor`).

    At each step every rank sends one chunk to its right neighbour (rank + 1) % N and adds the
    chunk arriving from its left neighbour (rank - 1) % N into its own copy of that chunk.
    Work out which chunk rank r must send at step k so that chunk r is the one completed on
    rank r at the end. Each rank must send (N-1)/N of the tensor's bytes, no more.

    Hint: send and receive at the same time (isend + irecv, then wait on both): if every
    rank first does a blocking send, nobody is receiving yet.
    """
    raise NotImplementedError("exercise 02: write ring_reduce_scatter")


def ring_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Inside rank code: on entry chunk r of `tensor` on rank r holds rank r's piece (the other
    chunks hold anything). After N-1 ring steps every rank holds every rank's piece in its
    chunk. Work in place and return `tensor`. Each rank sends (N-1)/N of the bytes.

    At step 0 rank r sends its own chunk r; afterwards it forwards the chunk it just received.
    """
    raise NotImplementedError("exercise 02: write ring_all_gather")


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Inside rank code: sum `tensor` over all ranks, in place, and return it.
    (Two lines: a reduce-scatter, then an all-gather.) Each rank sends 2(N-1)/N of the bytes."""
    raise NotImplementedError("exercise 02: write ring_all_reduce")
