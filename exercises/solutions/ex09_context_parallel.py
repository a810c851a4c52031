"""Exercise 09, reference solution: merging a partial that holds some of the query rows, and
the zig-zag layout of a sequence that 2cp does not divide."""

import torch


def merge_rows(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
               rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) with the partial of the query rows `rows` merged in. exp(lse) is a
    part's softmax denominator, so the union's lse is log(exp(lse_a) + exp(lse_b)) and part a's
    share of it is exp(lse_a - lse). A row the partial does not hold is a row where it saw nothing."""
    lse_a, out_a = lse[..., rows], out[..., rows, :]
    m = torch.maximum(lse_a, part_lse)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: exp(-inf - 0) = 0, not NaN
    w_a, w_b = torch.exp(lse_a - m), torch.exp(part_lse - m)  # <= 1 each: no overflow
    total = w_a + w_b  # >= 1 when either part has a visible key (its larger term is exp(0))
    merged_out = (w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * part_out) / total.clamp_min(1.0).unsqueeze(-1)
    new_out, new_lse = out.clone(), lse.clone()
    new_out[..., rows, :] = merged_out
    new_lse[..., rows] = m + torch.log(total)  # log 0 = -inf: still nothing seen
    return new_out, new_lse


def zigzag_positions(T: int, cp: int, rank: int) -> list[int]:
    """Deal the T tokens to the cp ranks as evenly as possible (shares differ by at most one),
    then split each rank's share in two: the front halves fill the sequence from its start in
    rank order, the back halves from its end in reverse rank order. A rank's early half is paired
    with a late one, as in the even case, and the remainder tokens are spread one per rank."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in 0 ... cp-1 = {cp - 1}")
    shares = [T // cp + (r < T % cp) for r in range(cp)]
    front = [(s + 1) // 2 for s in shares]
    back = [s // 2 for s in shares]
    lengths = front + back[::-1]  # the 2cp chunks in position order
    starts = [sum(lengths[:i]) for i in range(2 * cp + 1)]
    return [p for i in (rank, 2 * cp - 1 - rank) for p in range(starts[i], starts[i + 1])]
