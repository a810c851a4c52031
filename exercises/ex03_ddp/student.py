"""Exercise 03: data parallelism with buckets, overlap and buckets that learn the backward order.
Write the three parts below, then run the check cells of ex03_ddp.ipynb. Each check prints PASS
when your code is right.

The contract (the notebook says why each rule exists):
  * after SimpleDDP(...), every rank holds rank 0's parameter values;
  * after finish_gradient_synchronization(), every p.grad holds (1/N) * sum over ranks of that
    rank's p.grad;
  * gradients travel in buckets, one dist.all_reduce per bucket per step, started with
    async_op=True from a gradient hook as soon as the bucket can leave: during backward, never
    waited for before backward has returned;
  * the first step's buckets follow the reverse of the registration order; from the second step
    on they follow the order the gradients really arrived in during the first step;
  * self.buckets is the current layout: a list of buckets, each a list of Parameters.
You may assume every trainable parameter gets a gradient in every step (no unused parameters)
and no gradient accumulation.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def build_buckets(order: list[int], sizes_bytes: list[int], bucket_cap_bytes: float) -> list[list[int]]:
    """Group parameter indices into buckets.

    order: the parameter indices in the order their gradients are expected to be ready;
    sizes_bytes[i]: parameter i's gradient size in bytes. Returns the buckets, each a list of
    indices, in the order of `order`. A bucket is closed as soon as it holds at least
    bucket_cap_bytes (PyTorch's rule); a last, unfilled bucket is kept.
    Raises ValueError unless `order` names every index of sizes_bytes exactly once.
    Example: build_buckets([3, 2, 1, 0], [4, 4, 4, 4], 8) -> [[3, 2], [1, 0]].
    """
    raise NotImplementedError("exercise 03: write build_buckets")


class SimpleDDP(nn.Module):
    """Bucketed data parallelism whose all-reduces start during backward."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        raise NotImplementedError("exercise 03: write SimpleDDP.__init__")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Called once per step, after backward and before the optimizer step. When it returns,
        every p.grad holds the average over the ranks, and the next step can begin."""
        raise NotImplementedError("exercise 03: write SimpleDDP.finish_gradient_synchronization")
