"""Exercise 09, reference solution: the log-sum-exp merge and the zig-zag chunks."""

import torch


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) over the keys of both parts: exp(lse) is a part's softmax denominator, so
    lse = log(exp(lse_a) + exp(lse_b)) and part a's share of the union is exp(lse_a - lse)."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: exp(-inf - 0) = 0, not NaN
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # <= 1 each: no overflow
    total = w_a + w_b  # >= 1 when either part has a visible key (its larger term is exp(0))
    lse = m + torch.log(total)  # log 0 = -inf: still nothing seen
    out = (w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * out_b) / total.clamp_min(1.0).unsqueeze(-1)
    return out, lse


def zigzag_chunks(cp: int, rank: int) -> list[int]:
    """Chunk r and its mirror 2cp-1-r: their start positions add up to the same total on every
    rank, so every rank's causal work is equal."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in 0 ... cp-1 = {cp - 1}")
    return [rank, 2 * cp - 1 - rank]
