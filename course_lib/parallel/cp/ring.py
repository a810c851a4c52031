"""Ring attention (Liu et al. 2023): keys and values travel round the ring of cp ranks.

At step t = 0..cp-1 rank r holds the K||V block of rank (r - t) mod cp. It sends that block on
to rank r+1 and receives the next from rank r-1 while it attends its queries to the block it
holds; the partial (out, lse) of each block is merged by log-sum-exp (blocks.merge_partials).
After cp steps every query has seen every key, and no rank ever held more than two K||V blocks.

    step 0      step 1      step 2            (cp = 3; rank r holds block b)
    r0: b0      r0: b2      r0: b1
    r1: b1      r1: b0      r1: b2            each arrow of the ring carries one block per step
    r2: b2      r2: b1      r2: b0

The causal saving: a block whose keys all come after all of the rank's queries contributes
nothing and is skipped; of the others only the rectangle of queries and keys that have a
visible pair is computed (blocks.visible_rectangle). Contiguous chunks skip whole blocks on the
early ranks (which then idle: the imbalance); the zig-zag layout computes half of every
off-diagonal block on every rank.

Backward is a second ring (autograd.Function, by hand; FlashAttention-2's backward formulas in
blocks.py, from the saved final lse and out). K||V go round again, and with them an accumulator
dK||dV for the block: at each step the rank adds its queries' contribution to the block it
holds and passes the accumulator on; after the cp-th step the accumulator of block r sits on
rank r-1, and one more hop brings it home. dQ stays local.

Grouped-query attention: the K||V blocks (and the dK||dV accumulators) travel H_kv heads wide, the
rank's own key/value heads, and are repeated to the H query heads only where a block is computed
(repeat_kv; its gradient folded back by fold_kv), so the ring moves H_kv/H of multi-head bytes.

Calls per layer per rank, each a torch.distributed.batch_isend_irecv of one isend to rank r+1
and one irecv from rank r-1 of a K||V-sized tensor (2 blocks of B·H_kv·s·hd elements):
    forward   cp-1 exchanges of K||V
    backward  cp-1 exchanges of K||V (posted before the step's compute, overlapping it) and
              cp exchanges of dK||dV (posted after the step's compute, overlapping the next
              step's; the last one, which brings each rank's dK||dV home, overlaps nothing)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.model.layers import repeat_kv
from course_lib.parallel.cp.blocks import (NEG_INF, block_attention, block_attention_backward, default_scale,
                                           merge_partials, visible_rectangle)

KV_TAG, GRAD_TAG = 0, 1  # the two streams of the backward ring, kept apart by tag


def _exchange(tensor: torch.Tensor, group, tag: int) -> tuple[torch.Tensor, list]:
    """Post send(tensor -> rank+1) and recv(<- rank-1); returns the receive buffer and the
    requests to wait on."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    g = group if group is not None else dist.group.WORLD
    nxt, prv = dist.get_global_rank(g, (me + 1) % cp), dist.get_global_rank(g, (me - 1) % cp)
    buf = torch.empty_like(tensor)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, nxt, group, tag),
                                   dist.P2POp(dist.irecv, buf, prv, group, tag)])
    return buf, reqs


def ring_schedule(layout, rank: int) -> list[tuple[int, int, int]]:
    """What rank computes at each ring step: (source rank of the K||V block held, q_lo, k_hi),
    the rectangle queries q_lo: x keys :k_hi; an empty rectangle (q_lo == s or k_hi == 0) is a
    skipped block. The forward and backward loops both follow it."""
    q_pos = layout.positions(rank)
    steps = []
    for step in range(layout.cp):
        src = (rank - step) % layout.cp
        steps.append((src, *visible_rectangle(q_pos, layout.positions(src))))
    return steps


def ring_work(layout) -> list[int]:
    """Per rank, the (query, key) scores the ring computes: the sum of its rectangles' areas.
    It exceeds attention_work's causal count by the masked half of each diagonal rectangle."""
    return [sum((layout.shard_len - q_lo) * k_hi for _, q_lo, k_hi in ring_schedule(layout, r))
            for r in range(layout.cp)]


def fold_kv(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """The adjoint of repeat_kv: a gradient (B, H, s, hd) on the repeated heads summed over each
    K/V head's group of H / n_kv query heads -> (B, n_kv, s, hd)."""
    return grad if grad.shape[1] == n_kv else grad.unflatten(1, (n_kv, -1)).sum(2)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, group, layout, scale):
        cp, me, n_q = layout.cp, dist.get_rank(group), q.shape[1]
        kv = torch.stack([k, v])  # H_kv heads: the blocks go round un-repeated (grouped-query attention)
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], NEG_INF)
        for step, (src, q_lo, k_hi) in enumerate(ring_schedule(layout, me)):
            buf, reqs = _exchange(kv, group, KV_TAG) if step < cp - 1 else (None, [])
            k_pos = layout.positions(src)
            if q_lo < len(q_pos) and k_hi > 0:  # else every key is after every query: skipped
                o_b, l_b = block_attention(q[..., q_lo:, :], repeat_kv(kv[0, ..., :k_hi, :], n_q),
                                           repeat_kv(kv[1, ..., :k_hi, :], n_q), q_pos[q_lo:], k_pos[:k_hi], scale)
                out[..., q_lo:, :], lse[..., q_lo:] = merge_partials(out[..., q_lo:, :], lse[..., q_lo:], o_b, l_b)
            _wait(reqs)
            kv = buf
        ctx.save_for_backward(q, k, v, q_pos, out, lse)
        ctx.group, ctx.layout, ctx.scale = group, layout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_pos, out, lse = ctx.saved_tensors
        group, layout, scale = ctx.group, ctx.layout, ctx.scale
        cp, me, n_q = layout.cp, dist.get_rank(group), q.shape[1]
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # D = rowsum(dO ∘ O), once for all blocks
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the accumulator of the block held (step 0: my own, empty)
        received, grad_reqs = None, []  # the accumulator arriving for the next step's block
        for step, (src, q_lo, k_hi) in enumerate(ring_schedule(layout, me)):
            kv_next, kv_reqs = _exchange(kv, group, KV_TAG) if step < cp - 1 else (None, [])
            k_pos = layout.positions(src)
            grads = None
            if q_lo < len(q_pos) and k_hi > 0:
                grads = block_attention_backward(
                    q[..., q_lo:, :], repeat_kv(kv[0, ..., :k_hi, :], n_q), repeat_kv(kv[1, ..., :k_hi, :], n_q),
                    q_pos[q_lo:], k_pos[:k_hi], lse[..., q_lo:], dout[..., q_lo:, :], delta[..., q_lo:], scale)
                dq[..., q_lo:, :] += grads[0]
            # The accumulator of this step's block arrived during the compute above (posted by
            # rank r-1 at the end of its previous step): the gradient hop overlaps compute too.
            _wait(grad_reqs)
            if step > 0:
                dkv = received
            if grads is not None:
                dkv[0, ..., :k_hi, :] += fold_kv(grads[1], kv.shape[2])  # the repeat's adjoint: a
                dkv[1, ..., :k_hi, :] += fold_kv(grads[2], kv.shape[2])  # sum over each head's group
            # Pass the accumulator on; after the last step this hop takes block r+1's home.
            received, grad_reqs = _exchange(dkv, group, GRAD_TAG)
            _wait(kv_reqs)
            kv = kv_next
        _wait(grad_reqs)  # the last hop: exposed, nothing left to compute
        dkv = received
        return dq, dkv[0], dkv[1], None, None, None, None


def ring_attention(q, k, v, q_pos, group, layout, scale=None):
    """Causal attention of this rank's queries (q: (B, H, s, hd), k, v: (B, H_kv, s, hd) at positions q_pos, the
    layout's positions of this rank) by the ring; the calls are in the module docstring."""
    if dist.get_world_size(group) == 1:
        return block_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), q_pos, q_pos, scale)[0]
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), q_pos, group, layout,
                                default_scale(q, scale))
