"""Collectives that autograd can differentiate through (tensor, sequence and expert parallelism).

A collective inside a model's forward needs a matching collective in backward. Each pair here
is the adjoint of the other: if forward computes y = A x for a linear communication map A, the
backward computes dL/dx = A^T dL/dy. With N ranks of a group and x_r the tensor on rank r:

    forward                                  backward (the transpose)
    copy_to_group        y_r = x_r           g_x_r = sum_s g_y_s           all-reduce   (Megatron's f)
    reduce_from_group    y_r = sum_s x_s     g_x_r = g_y_r                 identity     (Megatron's g)
    gather_along_dim     y = [x_0 ... x_N-1] g_x_r = (sum_s g_y_s)[chunk r] reduce-scatter
    scatter_along_dim    y = (sum_s x_s)[r]  g_x_r = [g_y_0 ... g_y_N-1]   all-gather
    split_along_dim      y = x[chunk r]      g_x = [g_y_0 ... g_y_N-1]     all-gather
    all_to_all_single    rows routed         rows routed back              all-to-all (swapped splits)

`gather_along_dim` and `scatter_along_dim` are sequence parallelism's pair (Korthikanti et al.
2022): all-gather + reduce-scatter replace one all-reduce, since an all-reduce *is* a
reduce-scatter followed by an all-gather. `split_along_dim` is for a tensor every rank already
holds whole (its backward gathers the chunks, summing nothing).

Every communication goes through the public `torch.distributed` functions (via comm.compat), so
`CommTracer` counts it. Tensors along `dim` must split evenly: size % N == 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()  # never reduce into a tensor autograd may still need
    dist.all_reduce(x, group=group)
    return x


def _check_divisible(x: torch.Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n:
        raise ValueError(f"size {x.shape[dim]} of dim {dim} must be divisible by the group size {n}")


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along dim (all equal shapes)."""
    n = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum x over the ranks and keep chunk `rank` along dim."""
    n = dist.get_world_size(group)
    _check_divisible(x, dim, n)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    _check_divisible(x, dim, n)
    return x.chunk(n, dim=dim)[r].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ScatterAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _SplitAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(output_splits),
                               input_split_sizes=list(input_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # The transpose of a routing is the routing back: swap what was sent and received.
        back = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=list(ctx.input_splits),
                               input_split_sizes=list(ctx.output_splits), group=ctx.group)
        return back, None, None, None


def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient in backward."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: all-reduce forward (sum of partial results), identity backward."""
    return _ReduceFromGroup.apply(x, group)


def gather_along_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """All-gather along dim forward; reduce-scatter along dim backward."""
    return _GatherAlongDim.apply(x, dim, group)


def scatter_along_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Reduce-scatter along dim forward (sum, keep my chunk); all-gather backward."""
    return _ScatterAlongDim.apply(x, dim, group)


def split_along_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Keep my chunk of a tensor every rank holds whole; backward all-gathers the chunks."""
    return _SplitAlongDim.apply(x, dim, group)


def all_to_all_single(x: torch.Tensor, output_splits, input_splits, group=None) -> torch.Tensor:
    """Route rows of x (dim 0): input_splits[s] rows go to rank s, output_splits[s] arrive from it.
    Backward routes the gradient rows back the same way (uneven splits allowed)."""
    return _AllToAllSingle.apply(x, list(output_splits), list(input_splits), group)
