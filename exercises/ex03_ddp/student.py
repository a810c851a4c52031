"""Exercise 03: data parallelism with buckets and overlap. Fill in the parts marked TODO,
then run the check cells of ex03_ddp.ipynb. Each check prints PASS when your code is right.

Rules of the game (the notebook explains why):
  * every rank starts from rank 0's parameters;
  * gradients are averaged: after finish_gradient_synchronization(), every p.grad holds
    (1/N) * sum over ranks of that rank's p.grad;
  * parameters are grouped into buckets, walking from the LAST parameter to the first;
  * a bucket's all-reduce starts (async_op=True) from a gradient hook as soon as all of its
    gradients are ready, i.e. during backward, not after it.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def build_buckets(sizes_bytes: list[int], bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets.

    Walk the indices from len(sizes_bytes) - 1 down to 0. Add each index to the current
    bucket; as soon as the current bucket holds at least bucket_cap_bytes, close it and start
    a new one (PyTorch's rule: a bucket overshoots the cap by at most its last parameter). A
    last, unfilled bucket is kept.
    Examples: sizes [4, 4, 4, 4] with cap 8 -> [[3, 2], [1, 0]];
              sizes [4, 100, 4, 4] with cap 10 -> [[3, 2, 1], [0]].
    """
    raise NotImplementedError("exercise 03: write build_buckets")


class SimpleDDP(nn.Module):
    """Bucketed data parallelism whose all-reduces start during backward."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        # TODO 1: copy rank 0's parameters to every rank (dist.broadcast each parameter,
        #         inside torch.no_grad()).
        # TODO 2: self.buckets = list of lists of Parameters, from build_buckets over the
        #         parameters with requires_grad (sizes in bytes; cap = bucket_cap_mb * 2**20).
        # TODO 3: bookkeeping: which bucket each parameter is in, how many gradients of each
        #         bucket are ready, the index of the next bucket to launch (buckets are
        #         launched in index order on every rank), and the all-reduces in flight.
        # TODO 4: p.register_post_accumulate_grad_hook(self._on_grad_ready) for each parameter.
        raise NotImplementedError("exercise 03: write SimpleDDP.__init__")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Called by autograd once param.grad is complete. Count it; then launch every full
        bucket whose predecessors have all been launched, in index order: flatten the bucket's
        gradients into one tensor, divide by the world size and start
        dist.all_reduce(flat, group=self.group, async_op=True). Keep (work, flat)."""
        raise NotImplementedError("exercise 03: write SimpleDDP._on_grad_ready")

    def finish_gradient_synchronization(self) -> None:
        """Called after backward: start any bucket not started yet, wait for every all-reduce,
        copy each averaged slice back into its p.grad, and reset the bookkeeping."""
        raise NotImplementedError("exercise 03: write SimpleDDP.finish_gradient_synchronization")
