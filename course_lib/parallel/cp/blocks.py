"""Attention of a block of queries against a block of keys, and the merge of partial results:
the arithmetic every context-parallel method is built from. Pure torch, nothing communicates.

Causality by ABSOLUTE position: a rank holds queries and keys from anywhere in the sequence
(zig-zag chunks, a block received from another rank), so the mask is not "the lower triangle"
but "key position <= query position":

    S = scale · Q Kᵀ,   S[i, j] = -inf unless k_pos[j] <= q_pos[i]
    lse[i] = log sum_j exp(S[i, j])                 (the softmax denominator, in log space)
    out[i] = sum_j exp(S[i, j] - lse[i]) V[j]       (the softmax-weighted values)

The pair (out, lse) of one key block is a *partial* result: softmax over the union of two
key blocks a and b follows from the two partials alone (the online-softmax rule, Milakov &
Gimelshein 2018; FlashAttention's rescaling, Dao et al. 2022):

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

since exp(lse_a - lse) is the share of block a's keys in the whole denominator. A plain
average (out_a + out_b)/2 weighs a block of one visible key like a block of a thousand.

The backward of one block, given the FINAL lse and out of the whole row (FlashAttention-2's
backward, Dao 2023): P = exp(S - lse) is the block's slice of the final softmax, and

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP - D),   D[i] = sum_d dO[i, d] · O[i, d]
    dQ = scale · dS K,   dK = scale · dSᵀ Q

(D = rowsum(dO ∘ O) = rowsum(P ∘ dP) over ALL keys, the term the softmax's normalisation
subtracts.) Summing a block's dQ over the key blocks, and its dK, dV over the query blocks,
gives the full gradients: the ring's backward does exactly that.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    """1/sqrt(head_dim), as in CausalAttention, unless given."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def _scores(q, k, q_pos, k_pos, scale):
    visible = k_pos.to(q.device)[None, :] <= q_pos.to(q.device)[:, None]  # (sq, sk)
    return ((q @ k.transpose(-2, -1)) * scale).masked_fill(~visible, NEG_INF)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries q (B, H, sq, hd) at positions q_pos (sq,) against keys/values
    k, v (B, H, sk, hd) at positions k_pos (sk,): a key is visible iff k_pos <= q_pos.

    Returns out (B, H, sq, hd) and lse (B, H, sq), the logsumexp of the scaled visible scores.
    A query with no visible key gets lse = -inf and out = 0 (no NaN), the neutral element of
    merge_partials. Differentiable by autograd (out everywhere, lse where it is finite); it
    computes in the inputs' dtype."""
    scale = default_scale(q, scale)
    if k.shape[-2] == 0:
        return torch.zeros_like(q), q.new_full(q.shape[:-1], NEG_INF)
    s = _scores(q, k, q_pos, k_pos, scale)
    # The row maximum only keeps exp() in range; lse and out do not depend on it, so it carries
    # no gradient (detach). A row with no visible key has max -inf: use 0 there, exp(-inf) = 0.
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    # z >= 1 whenever a key is visible (its largest term is exp(0)), so clamping at 1 changes
    # nothing there and turns the empty row's 0/0 into 0/1 = 0.
    out = (e @ v) / z.clamp_min(1.0)
    lse = (m + torch.log(z)).squeeze(-1)  # log 0 = -inf for an empty row
    return out, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the keys of two blocks from each block's (out, lse):
    lse = logaddexp(lse_a, lse_b), out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
    Rows where both lse are -inf (no visible key in either block) stay out = 0, lse = -inf."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == NEG_INF, 0.0)  # exp(-inf - 0) = 0, not exp(-inf + inf) = nan
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


@torch.no_grad()
def block_attention_backward(q, k, v, q_pos, k_pos, lse, dout, delta, scale: float | None = None):
    """One block's share of the attention gradients (the module docstring's formulas), given
    the final lse (B, H, sq) of the query rows and delta = rowsum(dO ∘ O) (B, H, sq).
    Returns dq (this key block's contribution), dk, dv (this query block's contribution)."""
    scale = default_scale(q, scale)
    s = _scores(q, k, q_pos, k_pos, scale)
    # A row with lse = -inf has no visible key anywhere: its P is 0 (exp(s - inf) = 0).
    lse = lse.masked_fill(lse == NEG_INF, float("inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def visible_rectangle(q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[int, int]:
    """For increasing q_pos and k_pos: (q_lo, k_hi) such that only queries q_lo: and keys :k_hi
    have a visible pair; the rest of the block is all -inf and need not be computed. Empty
    (q_lo == len(q_pos) or k_hi == 0) when every key is after every query."""
    q_lo = int(torch.searchsorted(q_pos, k_pos[:1]).item())  # first query at or after the first key
    k_hi = int(torch.searchsorted(k_pos, q_pos[-1:], right=True).item())  # keys up to the last query
    return q_lo, k_hi
