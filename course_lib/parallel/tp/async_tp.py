"""Asynchronous tensor parallelism: a collective and the matmul that depends on it, decomposed
into p steps so that each step's send/receive hides behind the matmul of a chunk already there.

Under sequence parallelism (functions.py) a column-parallel matmul waits for a whole all-gather
of the sequence shards, and a row-parallel matmul's output waits for a whole reduce-scatter.
Neither has to wait whole: a matmul is row by row, so the rows of one shard can be multiplied
while the next shard travels (Wang et al. 2023, "Overlap communication with dependent
computation via decomposition in large deep learning models", ASPLOS; Megatron's
`--tp-comm-overlap` and PyTorch's asynchronous TP do the same on GPUs). With p tp ranks, rank r,
the sequence split into p chunks along `dim`, and w stored as nn.Linear stores it (out, in):

    all_gather_matmul(x_shard, w)      = F.linear(all_gather(x_shard), w)
        step t = 0..p-1: rank r holds chunk (r - t) mod p; it sends that chunk to r+1 and
        receives the next from r-1 WHILE it multiplies the chunk it holds.
    matmul_reduce_scatter(x, w_shard)  = reduce_scatter(F.linear(x, w_shard))
        step t = 0..p-1: rank r multiplies its rows of chunk (r + t + 1) mod p WHILE the sum
        so far (of the chunk before) travels to r-1; it adds the sum arriving from r+1. After
        p steps the sum of chunk r (every rank's partial) ends on rank r.

Each step is one torch.distributed.batch_isend_irecv (at most one send and one receive per ring),
so the calls pair up in issue order as NCCL requires (course_lib/observe/nccl_rules.py): every
rank posts the same rings in the same order. p - 1 exchanges of one chunk each per ring: the
bytes of the ring all-gather and reduce-scatter they replace.

The backward of each is the other, plus the weight gradient on the same ring (one step posts
both rings' sends when both run):

    all_gather_matmul      dX = reduce_scatter(dY @ w)         (a matmul_reduce_scatter ring)
                           dw = sum_c dY_c^T X_c               (X re-gathered on the same steps:
                                                               only the shard is saved, as
                                                               functions.gathered_linear does)
    matmul_reduce_scatter  dX = all_gather(dY) @ w_shard       (an all_gather_matmul ring)
                           dw = sum_c all_gather(dY)_c^T X_c

`use_async_tp(model)` (what `apply_tensor_parallel(..., sequence_parallel=True, async_tp=True)`
calls) turns every block's four tensor-parallel linears into the overlapped forms: qkv and fc
all_gather_matmul, the two projections matmul_reduce_scatter. Only under sequence parallelism:
without it the input of a column-parallel layer is already whole on every rank and the output of
a row-parallel one is all-reduced, and there is no all-gather or reduce-scatter to decompose.

The sums come out in another order than one matmul's (chunk by chunk, ring order), so results
equal the plain collective + matmul up to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.comm.autograd import copy_parameter_to_group
from course_lib.parallel.tp.functions import SEQUENCE_DIM
from course_lib.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear


def check_async_shapes(x: torch.Tensor, w: torch.Tensor, dim: int, tp: int, gathered: bool) -> None:
    """ValueError naming the value and the rule, raised on every rank before any send or wait:
    the matmul's inner sizes agree, `dim` is not the feature dim, and (reduce-scatter) the
    sequence splits into tp equal chunks."""
    if x.dim() < 2 or w.dim() != 2:
        raise ValueError(f"x of shape {tuple(x.shape)} needs >= 2 dims and w of shape {tuple(w.shape)} exactly 2")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x's last size {x.shape[-1]} must equal w's in_features w.shape[1]={w.shape[1]} "
                         "(w is stored as nn.Linear stores it: out x in)")
    if dim % x.dim() == x.dim() - 1:
        raise ValueError(f"dim={dim} is the feature dim of x: the chunks split another dim (the sequence)")
    if not gathered and x.shape[dim] % tp:
        raise ValueError(f"size {x.shape[dim]} of dim {dim} must be divisible by tp={tp} "
                         "(the reduce-scatter keeps one equal chunk per rank)")


def _chunk(x: torch.Tensor, dim: int, c: int, p: int) -> torch.Tensor:
    n = x.shape[dim] // p
    return x.narrow(dim, c * n, n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def ring(group, gather: torch.Tensor | None = None, on_chunk=None, partial=None) -> torch.Tensor | None:
    """p steps of the two rings, each step one batch_isend_irecv overlapped with its compute.

    gather: this rank's chunk; at step t on_chunk((r - t) mod p, chunk) sees chunk (r - t) mod p
    of the all-gather while the one it holds travels on to r+1.
    partial(c): this rank's contribution to chunk c of a reduce-scatter; the running sum of chunk
    (r + t) mod p travels to r-1 while partial((r + t + 1) mod p) is computed. Returns chunk r's
    sum over the ranks (None without partial).
    """
    g = group if group is not None else dist.group.WORLD
    p, r = dist.get_world_size(g), dist.get_rank(g)
    nxt, prv = dist.get_global_rank(g, (r + 1) % p), dist.get_global_rank(g, (r - 1) % p)
    held, acc = (gather.contiguous() if gather is not None else None), None
    for t in range(p):
        sends, recvs, got_held, got_acc = [], [], None, None
        if held is not None and t < p - 1:  # the all-gather ring: my chunk to r+1, the next from r-1
            got_held = torch.empty_like(held)
            sends.append(dist.P2POp(dist.isend, held, nxt, group))
            recvs.append(dist.P2POp(dist.irecv, got_held, prv, group))
        if partial is not None and t >= 1:  # the reduce-scatter ring: the sum so far to r-1, theirs from r+1
            got_acc = torch.empty_like(acc)
            sends.append(dist.P2POp(dist.isend, acc, prv, group))
            recvs.append(dist.P2POp(dist.irecv, got_acc, nxt, group))
        # Sends, then receives, each in ring order (all-gather first): at p = 2 both rings link
        # the same two ranks, and NCCL pairs a peer's k-th send with my k-th receive from it.
        reqs = dist.batch_isend_irecv(sends + recvs) if sends else []
        if held is not None:
            on_chunk((r - t) % p, held)  # the compute the exchange hides behind
        mine = partial((r + t + 1) % p) if partial is not None else None
        for req in reqs:
            req.wait()
        if got_held is not None:
            held = got_held
        if partial is not None:
            acc = mine if got_acc is None else got_acc + mine
    return acc


def _gather_matmul(x_shard, w, dim, group):
    """F.linear(all_gather(x_shard, dim), w), one chunk per ring step."""
    outs = [None] * dist.get_world_size(group)

    def on_chunk(c, xc):
        outs[c] = F.linear(xc, w)

    ring(group, gather=x_shard, on_chunk=on_chunk)
    return torch.cat(outs, dim)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, w, dim, group):
        ctx.dim, ctx.group = dim, group
        ctx.save_for_backward(x_shard, w)  # the shard only: backward gathers it again
        return _gather_matmul(x_shard, w, dim, group)

    @staticmethod
    def backward(ctx, grad_y):
        x_shard, w = ctx.saved_tensors
        dim, group, p = ctx.dim, ctx.group, dist.get_world_size(ctx.group)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_y = grad_y.contiguous()
        gw = [None]

        def on_chunk(c, xc):  # X re-gathered chunk by chunk: dw += dY_c^T X_c
            term = _rows(_chunk(grad_y, dim, c, p)).t() @ _rows(xc)
            gw[0] = term if gw[0] is None else gw[0] + term

        grad_x = ring(group, gather=x_shard if need_w else None, on_chunk=on_chunk,
                      partial=(lambda c: _chunk(grad_y, dim, c, p) @ w) if need_x else None)
        return grad_x, gw[0], None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_shard, dim, group):
        ctx.dim, ctx.group = dim, group
        ctx.save_for_backward(x, w_shard)
        p = dist.get_world_size(group)
        return ring(group, partial=lambda c: F.linear(_chunk(x, dim, c, p), w_shard))

    @staticmethod
    def backward(ctx, grad_y):
        x, w_shard = ctx.saved_tensors
        dim, group, p = ctx.dim, ctx.group, dist.get_world_size(ctx.group)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_xs, gw = [None] * p, [None]

        def on_chunk(c, gc):  # chunk c of all_gather(dY): dX_c = dY_c @ w_shard, dw += dY_c^T X_c
            if need_x:
                grad_xs[c] = gc @ w_shard
            if need_w:
                term = _rows(gc).t() @ _rows(_chunk(x, dim, c, p))
                gw[0] = term if gw[0] is None else gw[0] + term

        ring(group, gather=grad_y, on_chunk=on_chunk)
        return (torch.cat(grad_xs, dim) if need_x else None), gw[0], None, None


def all_gather_matmul(x_shard: torch.Tensor, w: torch.Tensor, group=None, bias: torch.Tensor | None = None,
                      dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """F.linear(all_gather(x_shard, dim), w, bias), decomposed into p overlapped ring steps.

    x_shard: this rank's chunk of the sequence (equal on every rank), w: (out, in) as nn.Linear
    stores it (a column-parallel shard of the weight). Backward: the input gradient by a
    matmul_reduce_scatter ring, the weight gradient on the same steps."""
    check_async_shapes(x_shard, w, dim, dist.get_world_size(group), gathered=True)
    y = _AllGatherMatmul.apply(x_shard, w, dim % x_shard.dim(), group)
    return y if bias is None else y + bias


def matmul_reduce_scatter(x: torch.Tensor, w_shard: torch.Tensor, group=None, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """reduce_scatter(F.linear(x, w_shard), dim): this rank's chunk of the sum over ranks,
    decomposed into p overlapped ring steps. x: the whole sequence, this rank's input features;
    w_shard: (out, in/tp), a row-parallel shard (its bias, whole, is added by the caller).
    Backward: an all_gather_matmul ring for the input gradient and the weight gradient."""
    check_async_shapes(x, w_shard, dim, dist.get_world_size(group), gathered=False)
    return _MatmulReduceScatter.apply(x, w_shard, dim % x.dim(), group)


class AsyncColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear under sequence parallelism, its all-gather decomposed into the matmul
    (with the weights the plain layer uses: key/value rows copied over ranks sum their gradients)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weights()
        return all_gather_matmul(x, w, self.group, bias=b)


class AsyncRowParallelLinear(RowParallelLinear):
    """RowParallelLinear under sequence parallelism, its reduce-scatter decomposed into the matmul;
    the whole bias meets this rank's sequence chunk through f, as in the plain layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul_reduce_scatter(x, self.weight, self.group)
        return y if self.bias is None else y + copy_parameter_to_group(self.bias, self.group)


ASYNC = {ColumnParallelLinear: AsyncColumnParallelLinear, RowParallelLinear: AsyncRowParallelLinear}


def check_async_tp(async_tp: bool, sequence_parallel: bool) -> None:
    """ValueError unless async TP has sequence parallelism's all-gathers and reduce-scatters to
    decompose (call it in the parent, before any rank starts, and before changing a model)."""
    if async_tp and not sequence_parallel:
        raise ValueError("async_tp=True needs sequence_parallel=True: it decomposes the all-gather before a "
                         "column-parallel matmul and the reduce-scatter after a row-parallel one, which only "
                         "sequence parallelism has (without it the input is whole and the output all-reduced)")


def use_async_tp(model) -> None:
    """Every block's four tensor-parallel linears (already made sequence parallel by
    apply_tensor_parallel) compute with the overlapped forms, in place. Each layer keeps its
    parameters, tables and placements: only its class, and so its forward, changes."""
    for block in model.blocks:
        for parent, name in ((block.attn, "qkv"), (block.attn, "proj"), (block.mlp, "fc"), (block.mlp, "proj")):
            layer = getattr(parent, name)
            if type(layer) not in ASYNC or not layer.sequence_parallel:
                raise ValueError(f"{name}={type(layer).__name__} (sequence_parallel="
                                 f"{getattr(layer, 'sequence_parallel', None)}): async TP swaps the plain "
                                 "sequence-parallel Column/RowParallelLinear of apply_tensor_parallel")
            layer.__class__ = ASYNC[type(layer)]
