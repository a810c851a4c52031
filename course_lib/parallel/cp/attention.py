"""Context-parallel causal attention: each rank holds a shard of the sequence (its queries, keys
and values, SequenceLayout says which positions) and computes exactly the rows of full causal
attention that belong to its queries. Attention is the only op of a transformer layer that
mixes positions, so it is the only one that communicates.

Three ways to let a rank's queries see the other ranks' keys (B batch, H heads, s = T/cp tokens
per rank, hd head dim; one "block" = B·H·s·hd elements, one K or V block B·H_kv·s·hd with H_kv
key/value heads under grouped-query attention, sent un-repeated and repeated to the H query
heads after the communication; counts per layer per rank):

    method      forward                                     backward
    allgather   1 all_gather_single of K||V (2 blocks in,   1 reduce_scatter_single of dK||dV
                2cp blocks out)                             (2cp blocks in, 2 blocks out)
    ring        cp-1 hops: 1 isend + 1 irecv of K||V        cp-1 isend + irecv of K||V and
                (2 blocks each)                             cp isend + irecv of dK||dV (2 blocks each)
    ulysses     2 all_to_all_single: Q||K||V (3 blocks),    2 all_to_all_single: dO (1 block),
                then O back (1 block)                       then dQ||dK||dV (3 blocks)

(ring: each hop is one torch.distributed.batch_isend_irecv call holding one isend and one irecv;
the tracer records them as isend / irecv. Ulysses' all-to-all keeps 1/cp of each tensor on the
rank itself, so it sends (cp-1)/cp of the blocks named. cp = 1 communicates nothing.)

    allgather  (Llama 3, Dubey et al. 2024 §3.3.2): gather K and V of the whole sequence, attend
               locally with positions. One collective, simple; holds the whole K, V (small
               under grouped-query attention, where K, V have fewer heads than Q).
    ring       (Liu et al. 2023): K/V blocks travel round the ring while each rank attends to
               the block it holds, merged by log-sum-exp (blocks.py); sends overlap compute
               and never hold more than two blocks; blocks wholly after the queries are skipped.
    ulysses    (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-all from (all heads, my tokens) to
               (H/cp heads, all tokens), plain attention, all-to-all back. Needs cp | H, H_kv.

All three equal single-process causal attention restricted to the rank's rows, forward and
backward (tests/test_cp_attention.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm.autograd import gather_along_dim
from course_lib.dims import CP_METHODS
from course_lib.model.layers import repeat_kv
from course_lib.parallel.cp.blocks import block_attention, merge_partials  # noqa: F401  (the interface)
from course_lib.parallel.cp.layout import SequenceLayout
from course_lib.parallel.cp.ring import ring_attention
from course_lib.parallel.cp.ulysses import ulysses_attention

SEQ_DIM = 2  # q, k, v are (B, H, s, hd)


def allgather_attention(q, k, v, q_pos, group, layout: SequenceLayout, scale=None):
    """All-gather K||V along the sequence (one all_gather_single), attend with positions.
    Backward (course_lib.comm.autograd.gather_along_dim): one reduce_scatter_single sums every
    rank's dK||dV for the whole sequence and leaves each rank its own shard. On gloo, torch's
    reduce-scatter is itself an all-reduce followed by a slice (same result, more bytes on the
    wire); the tracer counts the one reduce_scatter_single call."""
    kv = gather_along_dim(torch.stack([k, v]), SEQ_DIM + 1, group)  # (2, B, H_kv, T, hd), shards in rank order
    k_pos = layout.all_positions()  # K, V gathered KV-wide, repeated to the query heads here, after the gather
    out, _ = block_attention(q, repeat_kv(kv[0], q.shape[1]), repeat_kv(kv[1], q.shape[1]), q_pos, k_pos, scale)
    return out


def _check(q, k, v, q_pos, group, layout, method, positions_checked: bool = False):
    """The call's rules. positions_checked: q_pos was taken from the layout itself, once, and the
    method was checked against it (ContextParallelAttention), so the per-call comparison and the
    layout's rule book are skipped; the shapes are still checked on every call."""
    if method not in CP_METHODS:
        raise ValueError(f"method={method!r} must be one of {CP_METHODS}")
    cp = dist.get_world_size(group)
    if cp != layout.cp:
        raise ValueError(f"the group has {cp} ranks but layout.cp={layout.cp}")
    if not (k.shape == v.shape and q.shape[::2] == k.shape[::2] and q.shape[-1] == k.shape[-1]
            and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"q (B, H, s, hd) and k, v (B, H_kv, s, hd) with H_kv | H (grouped-query attention) "
                         f"must agree; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[SEQ_DIM] != layout.shard_len or tuple(q_pos.shape) != (layout.shard_len,):
        raise ValueError(f"this rank's shard holds {layout.shard_len} tokens (seq_len={layout.seq_len} over "
                         f"cp={layout.cp}); got q with {q.shape[SEQ_DIM]} and q_pos of shape {tuple(q_pos.shape)}")
    if positions_checked:
        return
    rank = dist.get_rank(group)
    if not torch.equal(q_pos.cpu(), layout.positions(rank)):
        raise ValueError(f"q_pos must be layout.positions({rank}) (the other ranks' positions are read off the "
                         f"layout, so the two must agree)")
    if method == "ulysses":
        layout.check(q.shape[1], method, k.shape[1])


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, group,
                      layout: SequenceLayout, method: str = "ring", *, positions_checked: bool = False) -> torch.Tensor:
    """Causal attention of this rank's queries against the whole sequence's keys.

    q: (B, H, s, hd), k, v: (B, H_kv, s, hd), this rank's shard (s = layout.shard_len tokens at
    positions q_pos = layout.positions(rank); H_kv | H key/value heads, each shared by H / H_kv
    query heads, sent un-repeated and repeated after the communication); group: the cp ranks (layout.cp of them). Returns out (B, H, s, hd),
    the rows of full causal attention at q_pos; differentiable in q, k, v. The calls each method
    makes are in the module docstring. positions_checked: see _check."""
    _check(q, k, v, q_pos, group, layout, method, positions_checked)
    if layout.cp == 1:
        return block_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), q_pos, q_pos)[0]
    if method == "allgather":
        return allgather_attention(q, k, v, q_pos, group, layout)
    if method == "ring":
        return ring_attention(q, k, v, q_pos, group, layout)
    return ulysses_attention(q, k, v, group, layout)


class ContextParallelAttention(nn.Module):
    """Drop-in for CausalAttention (block.attn.attend): forward(q, k, v) -> out on this rank's
    sequence shard, through context_attention.

    The positions of this rank's tokens are fixed by the layout and the rank's place in the
    group: they are computed here (the buffer `q_pos`, not saved in the state dict, so swapping
    the module changes no state-dict key). To run another sequence length, call
    `set_layout(SequenceLayout(...))`, which recomputes them. The same positions must reach the
    model's position embedding (GPT.forward(idx, targets, pos=layout.positions(rank))).
    No dropout on the attention weights (CausalAttention's dropout is not reproduced)."""

    def __init__(self, group, layout: SequenceLayout, method: str = "ring", rank: int | None = None):
        super().__init__()
        if method not in CP_METHODS:
            raise ValueError(f"method={method!r} must be one of {CP_METHODS}")
        self.group, self.method = group, method
        self.rank = dist.get_rank(group) if rank is None else rank
        self.register_buffer("q_pos", torch.empty(0, dtype=torch.long), persistent=False)
        self.set_layout(layout)

    def set_layout(self, layout: SequenceLayout) -> None:
        """Use `layout` from now on; q_pos becomes layout.positions(rank)."""
        self.layout = layout
        self.q_pos = layout.positions(self.rank).to(self.q_pos.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q_pos is the layout's own (set_layout): not compared again on every call
        return context_attention(q, k, v, self.q_pos, self.group, self.layout, self.method, positions_checked=True)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, cp={self.layout.cp}, load_balance={self.layout.load_balance}"
