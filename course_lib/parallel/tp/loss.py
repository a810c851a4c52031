"""Cross-entropy over logits split by vocabulary, without ever gathering the full logits.

Rank r holds z[:, V_r], the logits of its vocabulary slice V_r (N tokens x V/tp). For token i
with target y_i, the loss is  l_i = log sum_j exp(z_ij) - z_{i,y_i}. Computed stably:

    m_i = max_j z_ij                 all-reduce MAX of each rank's maximum       (N numbers)
    S_i = sum_j exp(z_ij - m_i)      all-reduce SUM of each rank's partial sum   (N numbers)
    t_i = z_{i,y_i} - m_i            all-reduce SUM: only the rank owning y_i adds a non-zero
    l_i = log S_i - t_i,             loss = mean_i l_i, the same number on every rank

Three all-reduces of N values instead of an all-gather of N x V logits. S and t are reduced with
g (`reduce_from_group`: all-reduce forward, identity backward), so autograd itself gives each
rank the gradient of its own slice, (softmax_ij - [j == y_i]) / N; m is a constant shift (it
cancels in l_i), so it is reduced without a gradient. Padded vocabulary columns (index >= V)
are set to -inf: exp(-inf) = 0, so they change neither the loss nor any gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.comm.autograd import reduce_from_group


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 vocab_size: int, group=None) -> torch.Tensor:
    """Mean cross-entropy; local_logits (..., V_local) hold columns [vocab_start, vocab_start +
    V_local) of the full logits, targets (...) global token ids < vocab_size."""
    z = local_logits.reshape(-1, local_logits.shape[-1]).float()
    y = targets.reshape(-1)
    columns = torch.arange(vocab_start, vocab_start + z.shape[1], device=z.device)
    z = z.masked_fill(columns >= vocab_size, float("-inf"))  # vocabulary padding

    m = z.detach().amax(dim=1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(1)
    sum_exp = reduce_from_group(shifted.exp().sum(dim=1), group)

    local_target = y - vocab_start
    mine = (local_target >= 0) & (local_target < z.shape[1])
    picked = shifted.gather(1, local_target.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    target_logit = reduce_from_group(picked.masked_fill(~mine, 0.0), group)
    return (sum_exp.log() - target_logit).mean()


class VocabParallelCrossEntropy:
    """GPT.loss_fn under tensor parallelism: loss_fn(local_logits, targets) -> the full loss."""

    def __init__(self, vocab_start: int, vocab_size: int, group=None):
        self.vocab_start, self.vocab_size, self.group = vocab_start, vocab_size, group

    def __call__(self, local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(local_logits, targets, self.vocab_start, self.vocab_size, self.group)

    def __repr__(self):
        return f"VocabParallelCrossEntropy(vocab_start={self.vocab_start}, vocab_size={self.vocab_size})"
