"""Collectives that autograd can differentiate through (tensor, sequence and expert parallelism).

A collective inside a model's forward needs a matching collective in backward. Each pair here
is the adjoint of the other: if forward computes y = A x for a linear communication map A, the
backward computes dL/dx = A^T dL/dy. With N ranks of a group and x_r the tensor on rank r:

    forward                                  backward (the transpose)
    copy_to_group        y_r = x_r           g_x_r = sum_s g_y_s           all-reduce   (Megatron's f)
    copy_parameter_to_group   the same, for a parameter: its all-reduce deferred to the end of
                         the backward pass and made there with every other such parameter's, one
                         flat call per group (below)
    reduce_from_group    y_r = sum_s x_s     g_x_r = g_y_r                 identity     (Megatron's g)
    gather_along_dim     y = [x_0 ... x_N-1] g_x_r = (sum_s g_y_s)[chunk r] reduce-scatter
    scatter_along_dim    y = (sum_s x_s)[r]  g_x_r = [g_y_0 ... g_y_N-1]   all-gather
    split_along_dim      y = x[chunk r]      g_x = [g_y_0 ... g_y_N-1]     all-gather
    all_to_all_single    rows routed         rows routed back              all-to-all (swapped splits)

`gather_along_dim` and `scatter_along_dim` are sequence parallelism's pair (Korthikanti et al.
2022): all-gather + reduce-scatter replace one all-reduce, since an all-reduce *is* a
reduce-scatter followed by an all-gather. `split_along_dim` is for a tensor every rank already
holds whole (its backward gathers the chunks, summing nothing).

`copy_parameter_to_group` is f for the replicated parameters of sequence parallelism (a
LayerNorm's gain and bias, a row-parallel bias, the position table): each rank's copy sees 1/N
of the tokens, so its gradient is the sum over ranks, and it is read only after backward (by the
optimizer). One all-reduce per parameter, each a few KiB, costs a call's fixed time each: on 2
gloo ranks sharing 2 cores, 27 such calls of 1 KiB took 41 ms in all and one call of all 27 KiB
0.4 ms (the small calls' median is 0.2-0.4 ms, their tail 4-8 ms). So their gradients wait until
the end of the backward pass (torch's engine runs queued callbacks there, as the course's DDP
does) and are summed in one flat all-reduce per group and dtype, then added to .grad as autograd
would have (set when None, else accumulated), so micro-batches accumulate as before. Megatron-LM
does the same for its sequence-parallel LayerNorm gradients, after backward, in one flat buffer
(Korthikanti et al. 2022). A parameter's post-accumulate-grad hooks do not fire for this part:
what reads it waits for the end of backward.

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


_DEFERRED: dict = {}  # group -> [(parameter, its unreduced gradient)] of the running backward pass


def _sum_deferred() -> None:
    """End of a backward pass: each group's deferred gradients summed over the group in one
    flat all-reduce per dtype, then accumulated into .grad (None: set, else added in place)."""
    pending = dict(_DEFERRED)
    _DEFERRED.clear()
    for group, items in pending.items():
        for dtype in dict.fromkeys(g.dtype for _, g in items):
            same = [(p, g) for p, g in items if g.dtype == dtype]
            summed = _all_reduce(torch.cat([g.reshape(-1) for _, g in same]), group)
            for (p, _), part in zip(same, summed.split([g.numel() for _, g in same])):
                if p.grad is None:
                    p.grad = part.view_as(p).clone()
                else:
                    p.grad.add_(part.view_as(p))


class _CopyParameterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, group):
        ctx.param, ctx.group = p, group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        # run when the engine finishes this pass (the first queued sums them all, the rest find none)
        torch.autograd.Variable._execution_engine.queue_callback(_sum_deferred)
        _DEFERRED.setdefault(ctx.group, []).append((ctx.param, grad))
        return None, None  # nothing for autograd to accumulate now: _sum_deferred does it


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


def copy_parameter_to_group(p: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f for a replicated parameter (see the module docstring): identity forward; in
    backward its gradient is summed over the group at the end of the pass, in one flat
    all-reduce with every other such parameter's, and accumulated into p.grad."""
    if not (p.is_leaf and p.requires_grad):
        raise ValueError(f"copy_parameter_to_group needs a leaf tensor that requires grad (a parameter); got one "
                         f"with is_leaf={p.is_leaf}, requires_grad={p.requires_grad}: use copy_to_group")
    return _CopyParameterToGroup.apply(p, group)


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
