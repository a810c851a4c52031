"""The two pieces a GPT block is built from that other modules reuse or replace.

    MLP              the position-wise feed-forward network: the dense block's MLP and each
                     expert of a mixture-of-experts layer (moe.py)
    CausalAttention  the attention core, q, k, v -> out, without any weights: the one submodule
                     (`block.attn.attend`) a sequence-splitting strategy swaps for its own
                     (ring attention under context parallelism computes the same formula from
                     key/value blocks passed around the ranks)

Both sit below gpt.py and moe.py, so that those two import in one direction only
(gpt -> moe -> layers).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.config import ATTN_IMPLS


class MLP(nn.Module):
    """Position-wise feed-forward: proj(GELU(fc(x))), d -> ff_dim -> d.

    GELU uses the tanh approximation, as in the original GPT-2.
    """

    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ff_dim, bias=config.bias)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(config.ff_dim, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


def repeat_kv(t: torch.Tensor, n_q: int) -> torch.Tensor:
    """Grouped-query attention's K (or V), (B, n_kv, T, hd), repeated to n_q heads: query head h
    reads K head h // (n_q / n_kv) (Ainslie et al. 2023). Unchanged when n_kv = n_q."""
    n_kv = t.shape[1]
    if n_q % n_kv:
        raise ValueError(f"{n_kv} key/value heads must divide the {n_q} query heads")
    return t if n_kv == n_q else t.repeat_interleave(n_q // n_kv, dim=1)


class CausalAttention(nn.Module):
    """out = softmax(q k^T / sqrt(d) + M) v for every batch row and head, where d = head_dim
    and the mask M is -inf above the diagonal (query t sees keys 0..t; q and k cover the same
    positions). q: (B, n_head, T, head_dim), k, v: (B, n_kv, T, head_dim), repeated here to the
    query heads (repeat_kv; n_kv = n_head without grouped-query attention) -> out: (B, n_head, T,
    head_dim).

    impl "naive" materialises the (B, n_head, T, T) scores; "fused" calls one kernel
    (F.scaled_dot_product_attention, which on a GPU never stores them). Dropout, if any, acts
    on the attention weights. The module has no parameters, so replacing it changes no
    parameter name or state-dict key.
    """

    def __init__(self, impl: str = "naive", dropout: float = 0.0):
        super().__init__()
        if impl not in ATTN_IMPLS:
            raise ValueError(f"impl={impl!r} must be one of {ATTN_IMPLS}")
        self.impl, self.dropout = impl, dropout
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        if self.impl == "fused":
            p = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T, d = q.shape[-2], q.shape[-1]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        weights = self.attn_drop(F.softmax(scores, dim=-1))
        return weights @ v

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}"
