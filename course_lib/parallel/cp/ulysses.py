"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade the sequence split for a head split.

Every rank holds all H heads of its s = T/cp tokens. One all-to-all sends head group j (H/cp
heads) of those tokens to rank j; afterwards rank j holds its H/cp heads for ALL T tokens, runs
ordinary causal attention on them (heads are independent), and a second all-to-all sends each
rank's tokens back with all heads:

    (B, H, s, hd) per rank  --all-to-all-->  (B, H/cp, T, hd)  --attention-->  --all-to-all-->  (B, H, s, hd)

The gathered sequence is in rank order, not position order under the zig-zag layout; the
attention masks by absolute position (layout.all_positions()), so the order does not matter.

Calls per layer per rank: forward 2 all_to_all_single (Q||K||V: B·(H + 2 H_kv)·s·hd elements,
H_kv the rank's key/value heads under grouped-query attention; then O: B·H·s·hd), backward 2
(dO, then dQ||dK||dV, the same sizes), of which (cp-1)/cp leave the rank. Autograd
differentiates through course_lib.comm.autograd's all_to_all_single, whose backward is the
inverse routing. Needs cp | H and cp | H_kv (each rank whole K/V heads; K, V are repeated to the
query heads after the all-to-all, so they travel H_kv wide).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.comm.autograd import all_to_all_single
from course_lib.model.layers import repeat_kv
from course_lib.parallel.cp.blocks import block_attention


def _exchange(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """All-to-all of dim 0 (cp rows, one per rank): row j goes to rank j, row i arrives from i."""
    return all_to_all_single(x.contiguous(), [1] * cp, [1] * cp, group)


def seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(..., H, s, hd) shard of the sequence -> (..., H/cp, cp·s, hd), whole sequence in rank
    order. The leading dims (a stack of q, k, v) travel along."""
    *lead, H, s, hd = x.shape
    x = x.reshape(*lead, cp, H // cp, s, hd).movedim(-4, 0)  # (cp, ..., H/cp, s, hd): row j for rank j
    x = _exchange(x, cp, group)  # row i = rank i's tokens of my heads
    return x.movedim(0, -3).reshape(*lead, H // cp, cp * s, hd)


def heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse: (..., H/cp, cp·s, hd) -> (..., H, s, hd), this rank's tokens, all heads."""
    *lead, h, T, hd = x.shape
    x = x.reshape(*lead, h, cp, T // cp, hd).movedim(-3, 0)  # (cp, ..., h, s, hd): rank j's tokens
    x = _exchange(x, cp, group)  # row i = my tokens of rank i's heads
    return x.movedim(0, -4).reshape(*lead, cp * h, T // cp, hd)


def ulysses_attention(q, k, v, group, layout, scale=None):
    """Causal attention of this rank's tokens (q: (B, H, s, hd), k, v: (B, H_kv, s, hd)) by the
    two all-to-alls. One all-to-all carries Q, K and V: the row for rank j is its H/cp query heads
    and the H_kv/cp key/value heads they read (head h reads K/V head h // (H/H_kv), so rank j's
    query heads read exactly K/V heads j H_kv/cp ...); K, V are repeated to the query heads after it."""
    cp = dist.get_world_size(group)
    n_q, n_kv = q.shape[1], k.shape[1]
    for name, heads in (("n_head", n_q), ("n_kv_head", n_kv)):
        if heads % cp:
            raise ValueError(f"cp={cp} must divide the rank's {name}={heads} for method='ulysses'")
    rows = [t.unflatten(-3, (cp, t.shape[-3] // cp)) for t in (q, k, v)]  # (B, cp, heads/cp, s, hd)
    qkv = seq_to_heads(torch.cat(rows, dim=-3).flatten(-4, -3), cp, group)  # (B, (H + 2 H_kv)/cp, T, hd)
    q, k, v = qkv.split([n_q // cp, n_kv // cp, n_kv // cp], dim=-3)
    pos = layout.all_positions()
    out, _ = block_attention(q, repeat_kv(k, n_q // cp), repeat_kv(v, n_q // cp), pos, pos, scale)
    return heads_to_seq(out, cp, group)
