"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade the sequence split for a head split.

Every rank holds all H heads of its s = T/cp tokens. One all-to-all sends head group j (H/cp
heads) of those tokens to rank j; afterwards rank j holds its H/cp heads for ALL T tokens, runs
ordinary causal attention on them (heads are independent), and a second all-to-all sends each
rank's tokens back with all heads:

    (B, H, s, hd) per rank  --all-to-all-->  (B, H/cp, T, hd)  --attention-->  --all-to-all-->  (B, H, s, hd)

The gathered sequence is in rank order, not position order under the zig-zag layout; the
attention masks by absolute position (layout.all_positions()), so the order does not matter.

Calls per layer per rank: forward 2 all_to_all_single (Q||K||V stacked: 3 blocks; then O:
1 block), backward 2 (dO: 1 block; dQ||dK||dV: 3 blocks), one block = B·H·s·hd elements, of
which (cp-1)/cp leave the rank. Autograd differentiates through course_lib.comm.autograd's
all_to_all_single, whose backward is the inverse routing. Needs cp | H.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.comm.autograd import all_to_all_single
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
    """Causal attention of this rank's tokens (q, k, v: (B, H, s, hd)) by the two all-to-alls."""
    cp = dist.get_world_size(group)
    if q.shape[1] % cp:
        raise ValueError(f"cp={cp} must divide n_head={q.shape[1]} for method='ulysses'")
    qkv = seq_to_heads(torch.stack([q, k, v]), cp, group)  # (3, B, H/cp, T, hd)
    pos = layout.all_positions()
    out, _ = block_attention(qkv[0], qkv[1], qkv[2], pos, pos, scale)
    return heads_to_seq(out, cp, group)
