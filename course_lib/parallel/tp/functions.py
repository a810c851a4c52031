"""Where a tensor-parallel region begins and ends, as differentiable operators.

A transformer layer under tensor parallelism is a sequence of *regions*: inside one, every rank
holds a slice of the hidden features (its heads, its MLP columns); outside, every rank holds the
whole hidden vector of the tokens it is responsible for. Two operators enter and leave a region
(Shoeybi et al. 2019, "Megatron-LM"; Korthikanti et al. 2022 for sequence parallelism):

    without sequence parallelism (outside = all tokens, replicated on every rank)
        enter:  f = copy_to_group        forward identity         backward all-reduce
        leave:  g = reduce_from_group    forward all-reduce       backward identity

    with sequence parallelism (outside = a 1/tp slice of the sequence on each rank)
        enter:  all-gather along the sequence    backward reduce-scatter
        leave:  reduce-scatter along the sequence    backward all-gather

An all-reduce is a reduce-scatter followed by an all-gather, so sequence parallelism sends the
same bytes as plain tensor parallelism; it only moves the split so that the LayerNorm and
dropout between regions run on 1/tp of the tokens.

`gathered_linear` is the column-parallel matmul under sequence parallelism with Megatron's
memory trick: it keeps only this rank's sequence shard of the input for backward and gathers it
again there, instead of keeping the gathered (tp times larger) tensor. One more all-gather in
backward buys a 1/tp activation term; Korthikanti et al.'s activation formula assumes it. Its
backward overlaps that gather with the input-gradient matmul, and the input gradient's
reduce-scatter with the weight-gradient matmul (async collectives, waited for before use).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.comm.autograd import copy_to_group, gather_along_dim, reduce_from_group, scatter_along_dim
from course_lib.comm.compat import all_gather_single, reduce_scatter_single

SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden)


def enter_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """f (identity / all-reduce of the gradient), or all-gather along the sequence under SP."""
    return gather_along_dim(x, SEQUENCE_DIM, group) if sequence_parallel else copy_to_group(x, group)


def leave_region(y: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """g (all-reduce of the partial sums), or reduce-scatter along the sequence under SP."""
    return scatter_along_dim(y, SEQUENCE_DIM, group) if sequence_parallel else reduce_from_group(y, group)


def _gather_sequence(x: torch.Tensor, group, async_op: bool = False):
    """(work, result) of the all-gather along the sequence; with async_op, read result only
    after work.wait() (else work is None and result is ready)."""
    n = dist.get_world_size(group)
    moved = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0],) + tuple(moved.shape[1:]))
    return all_gather_single(out, moved, group=group, async_op=async_op), out.movedim(0, SEQUENCE_DIM)


def _scatter_sequence(x: torch.Tensor, group, async_op: bool = False):
    """(work, result) of the reduce-scatter along the sequence, as above."""
    n = dist.get_world_size(group)
    moved = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n,) + tuple(moved.shape[1:]))
    return reduce_scatter_single(out, moved, group=group, async_op=async_op), out.movedim(0, SEQUENCE_DIM)


class _GatheredLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T + b, saving x (the shard), not the gathered input."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        _, x_full = _gather_sequence(x_shard, group)
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x_shard, weight = ctx.saved_tensors
        # x gathered again (the memory trick's price), started first: the input gradient needs no
        # x, so it is computed while the gather runs; and its reduce-scatter (every rank's tokens
        # fed every rank's columns: sum, keep my shard) runs while the weight gradient is computed.
        # Megatron-LM's column-parallel linear overlaps both the same way; here it took the
        # course's SP step from 1.07-1.12x DTensor's to 0.99-1.07x in four runs each (bench_tensor_parallel).
        gathering, x_full = _gather_sequence(x_shard, ctx.group, async_op=True)
        grad_x_full = grad_y @ weight
        scattering, grad_x_shard = _scatter_sequence(grad_x_full, ctx.group, async_op=True)
        gathering.wait()
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x_full.reshape(-1, x_full.shape[-1])
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
        scattering.wait()
        return grad_x_shard, grad_w, grad_b, None


def gathered_linear(x_shard: torch.Tensor, weight: torch.Tensor, bias, group) -> torch.Tensor:
    """Column-parallel matmul on a sequence shard: all-gather forward (and again in backward),
    reduce-scatter of the input gradient in backward."""
    return _GatheredLinear.apply(x_shard, weight, bias, group)
