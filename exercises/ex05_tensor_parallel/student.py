"""Exercise 05: tensor parallelism's two operators, f and g, and the column- and row-parallel
linear layers built on them. Replace every `raise NotImplementedError` below with your code, then
run the check cells of ex05_tensor_parallel.ipynb: each prints PASS when your code is right.

What your code is held to (notebook 05, sections 1 to 3, explains why):

  * tp ranks of a process group (`group`; None means every rank) start from the same full
    nn.Linear. Each keeps a share of it. An MLP `fc -> GELU -> proj` built from your layers
    (fc column-parallel, proj row-parallel) must give, on every rank, the output the full layers
    give, the same gradient for its input, and for each weight shard exactly the matching slice
    of the full weight's gradient. The same holds for attention split by heads, and for the
    course GPT with every block's layers replaced by yours.
  * It communicates only where it must: one all-reduce of the input's size in forward, one in
    backward, per column-then-row pair.

You may use torch, torch.distributed and torch.nn freely. The course library's own tensor
parallelism is off limits (the notebook refuses a module that imports it) until your checks pass.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class CopyToGroup(torch.autograd.Function):
    """f: where a tensor-parallel region begins (before a column-parallel layer).

    Every rank of `group` holds the same tensor x, and each feeds it into its own share of the
    layer. Forward: the output on each rank equals x. Backward: the gradient that reaches x on
    each rank must be the gradient of the whole computation with respect to x, that is, the sum
    over the group's ranks of the gradients arriving at f's output.
    """

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("exercise 05: write CopyToGroup.forward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("exercise 05: write CopyToGroup.backward")


class ReduceFromGroup(torch.autograd.Function):
    """g: where a tensor-parallel region ends (after a row-parallel layer).

    Each rank of `group` holds a partial result x_r of the same shape. Forward: the output on
    every rank is the sum of x_r over the group's ranks, and x itself is left unchanged (autograd
    may still need it). Backward: the gradient of the loss with respect to this rank's x_r, given
    that every rank already holds the whole gradient arriving at g's output (each rank computes
    the same loss from the same sum). Work out what that is before you write it.
    """

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("exercise 05: write ReduceFromGroup.forward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("exercise 05: write ReduceFromGroup.backward")


def f(x, group=None):
    return CopyToGroup.apply(x, group)


def g(x, group=None):
    return ReduceFromGroup.apply(x, group)


def qkv_rows_for_rank(d_model: int, n_head: int, tp: int, rank: int) -> list[int]:
    """The rows of the fused qkv weight (3*d_model rows, one per output feature) that rank `rank`
    keeps when attention is split over tp ranks by heads.

    The fused layer's output features are [q (d_model) | k (d_model) | v (d_model)]; inside each
    part, head h owns the d_head = d_model/n_head features starting at h*d_head. On each rank the
    unchanged attention module cuts that rank's qkv output into three equal parts, q, k and v, and
    each part into heads of d_head features, in order. After attention, the row-parallel attn.proj
    on rank r reads the r-th contiguous 1/tp block of attention features (the heads' outputs side
    by side). Return the row indices, as a list of ints, that make both of those right.
    """
    raise NotImplementedError("exercise 05: write qkv_rows_for_rank")


class ColumnParallelLinear(nn.Module):
    """This rank's share of `full` (an nn.Linear, identical on every rank of `group`), split by
    output features.

    `rows`: the output features this rank computes (a list of indices); None means the rank's
    contiguous block, the r-th of tp equal blocks. `self.weight` and `self.bias` must be
    nn.Parameters holding exactly those features' weights and biases, copied from `full` (bias
    None if `full` has none); training the shard must leave `full` unchanged.

    forward(x): x is the full input, the same on every rank. Return this rank's output features
    of full(x), such that backward gives x its whole gradient (every rank's share used all of x).
    """

    def __init__(self, full: nn.Linear, group=None, rows=None):
        super().__init__()
        raise NotImplementedError("exercise 05: write ColumnParallelLinear.__init__")

    def forward(self, x):
        raise NotImplementedError("exercise 05: write ColumnParallelLinear.forward")


class RowParallelLinear(nn.Module):
    """This rank's share of `full` (an nn.Linear, identical on every rank of `group`), split by
    input features.

    Rank r keeps the r-th of tp contiguous blocks of input features: `self.weight` (an
    nn.Parameter) holds those input features' weights, copied from `full`; `self.bias` holds the
    whole bias (None if `full` has none).

    forward(x): x holds only this rank's block of input features (what a ColumnParallelLinear
    before it produced). Return what `full` returns on the whole input: the complete output, the
    same on every rank, with the bias counted once.
    """

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        raise NotImplementedError("exercise 05: write RowParallelLinear.__init__")

    def forward(self, x):
        raise NotImplementedError("exercise 05: write RowParallelLinear.forward")


def uneven_mlp(fc: nn.Linear, proj: nn.Linear, group=None) -> nn.Module:
    """This rank's share of the MLP `proj(GELU(fc(x)))` when tp (the size of `group`) does not
    divide the hidden width H = fc.out_features (for example H = 10 on 4 ranks; tp <= H).

    fc and proj are full nn.Linear layers, identical on every rank of `group`
    (fc: d -> H, proj: H -> d, both with a bias). Return an nn.Module with two attributes:

      * `.fc`, with nn.Parameters `.weight` (k, d) and `.bias` (k,): the rows of fc for the k
        hidden features this rank computes, copied from fc;
      * `.proj`, with nn.Parameters `.weight` (d, k): proj's columns for those same hidden
        features, and `.bias` (d,): a copy of proj's whole bias.

    Every hidden feature is computed on exactly one rank, and the ranks' shares differ in size
    by at most one. Its forward(x) takes the full input (the same on every rank) and returns
    the full proj(GELU(fc(x))) on every rank; backward gives x, every weight and every bias the
    full layers' gradients (each shard: the matching slice). One all-reduce in forward and one in
    backward, each of x's size (d = 16 in the check). Training the shards leaves fc and proj as
    they were. You may reuse f, g and your layers above where they fit.
    """
    raise NotImplementedError("exercise 05: write uneven_mlp")
