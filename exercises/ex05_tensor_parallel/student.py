"""Exercise 05: Megatron's f and g, and the column- and row-parallel linear layers. Fill in the
parts marked TODO, then run the check cells of ex05_tensor_parallel.ipynb. Each check prints
PASS when your code is right.

Rules of the game (notebook 05 explains why):
  * f (CopyToGroup): forward returns its input unchanged; backward all-reduces (sums) the gradient
    over the group.
  * g (ReduceFromGroup): forward all-reduces (sums) over the group; backward passes the gradient
    through unchanged.
  * A column-parallel layer keeps some OUTPUT features of the full layer (rows of nn.Linear's
    weight, and the matching bias entries) and enters its region with f.
  * A row-parallel layer keeps a contiguous 1/tp of the INPUT features (columns of the weight),
    sums the partial results with g, then adds the whole bias once.
  * Never all-reduce in place into a tensor autograd may still need: clone first.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class CopyToGroup(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        # TODO: remember the group (ctx.group = group) and return x unchanged (x.view_as(x)).
        raise NotImplementedError("exercise 05: write CopyToGroup.forward")

    @staticmethod
    def backward(ctx, grad):
        # TODO: return (the gradient summed over the group's ranks, None for the group).
        raise NotImplementedError("exercise 05: write CopyToGroup.backward")


class ReduceFromGroup(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # TODO: return x summed over the group's ranks (a new tensor: clone, then dist.all_reduce).
        raise NotImplementedError("exercise 05: write ReduceFromGroup.forward")

    @staticmethod
    def backward(ctx, grad):
        # TODO: return (the gradient unchanged, None).
        raise NotImplementedError("exercise 05: write ReduceFromGroup.backward")


def f(x, group=None):
    return CopyToGroup.apply(x, group)


def g(x, group=None):
    return ReduceFromGroup.apply(x, group)


def qkv_rows_for_rank(d_model: int, n_head: int, tp: int, rank: int) -> list[int]:
    """Rows of the fused qkv weight that rank `rank` keeps when attention is split by heads.

    The fused weight has 3 * d_model rows: [Q rows | K rows | V rows], d_model rows each, and
    head h occupies rows h*d_head ... (h+1)*d_head - 1 inside each part (d_head = d_model / n_head).
    Rank r takes heads r*n_head/tp ... (r+1)*n_head/tp - 1: return their Q rows, then their K rows,
    then their V rows, in increasing order within each part.
    Example: d_model=8, n_head=2, tp=2, rank=1 -> [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23].
    """
    raise NotImplementedError("exercise 05: write qkv_rows_for_rank")


class ColumnParallelLinear(nn.Module):
    """This rank's output features of `full` (rows: which ones; None means a contiguous 1/tp)."""

    def __init__(self, full: nn.Linear, group=None, rows=None):
        super().__init__()
        self.group = group
        # TODO: self.weight = nn.Parameter(copy of the chosen rows of full.weight)
        #       self.bias = nn.Parameter(copy of the chosen entries of full.bias), or None
        raise NotImplementedError("exercise 05: write ColumnParallelLinear.__init__")

    def forward(self, x):
        # TODO: enter the region with f, then a linear layer with this rank's weight and bias.
        raise NotImplementedError("exercise 05: write ColumnParallelLinear.forward")


class RowParallelLinear(nn.Module):
    """This rank's contiguous 1/tp of the input features of `full`; the bias whole, added once."""

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        self.group = group
        # TODO: self.weight = nn.Parameter(copy of this rank's columns of full.weight)
        #       self.bias = nn.Parameter(copy of full.bias), or None
        raise NotImplementedError("exercise 05: write RowParallelLinear.__init__")

    def forward(self, x):
        # TODO: the partial product with this rank's weight, summed with g, then + the bias.
        raise NotImplementedError("exercise 05: write RowParallelLinear.forward")
