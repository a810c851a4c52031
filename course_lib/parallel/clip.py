"""The one global-norm gradient clip, for every way of splitting a model over ranks.

On one process `torch.nn.utils.clip_grad_norm_(params, max_norm)` scales every gradient by

    c = min(1, max_norm / (||g|| + 1e-6)),      ||g||^2 = sum over every element e of the model of g_e^2.

Split over the ranks of a group, a rank holds pieces of g of two kinds: a shard (its elements
live on this rank only) or a copy (the same values on k ranks of the group). Rank r passes
(g_i, w_i) pairs, one per piece, with

    w_i = 1 / (number of ranks of the group holding an identical copy of g_i)      (0 < w_i <= 1)

and one all-reduce (sum) over the group gives

    ||g||^2 = sum over ranks r  sum over its pieces i  w_i * ||g_i||^2,

because an element held as k identical copies is counted k times with weight 1/k, and a shard's
element (k = 1) once: every element of the single-process model is counted exactly once, which
is the single process's sum. Every rank receives the same ||g|| and scales its pieces by the same
c, so each piece ends as the single process's clipped slice of g.

Each axis knows its own k: a tensor-parallel shard 1, a LayerNorm replicated over tp 1/tp, an
expert 1 and a dense weight after EP's averaging 1/ep, the tied matrix on the first and last
pipeline stage 1/2, a ZeRO-1 shard 1 and a full DDP gradient 1/dp; composed, the weights multiply.

The squares are summed in float64 (a weight 1/3 then costs nothing visible) and ||g|| returned in
float32. A wrong weight (a replicated tensor given 1) counts that tensor k times: a larger norm,
a smaller c, a different update, which the equality-with-one-process tests catch.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.distributed as dist

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: c = max_norm / (||g|| + EPS)


class _ThisRank:
    def __repr__(self):
        return "THIS_RANK"


THIS_RANK = _ThisRank()  # group=THIS_RANK: this rank holds the whole gradient, nothing to reduce


def _check(pairs, max_norm, group) -> None:
    """ValueError (naming the value and the rule) before any rank waits in the all-reduce."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, Real) or not math.isfinite(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm={max_norm!r} must be a finite number >= 0 (the largest global gradient norm kept)")
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"grads_and_weights[{i}]={pair!r} must be a (gradient, weight) pair")
        g, w = pair
        if g is not None and not (torch.is_tensor(g) and g.is_floating_point()):
            raise ValueError(f"grads_and_weights[{i}]: the gradient must be a floating-point tensor or None, "
                             f"got {type(g).__name__}")
        if isinstance(w, bool) or not isinstance(w, Real) or not 0 < w <= 1:
            raise ValueError(f"grads_and_weights[{i}]: weight={w!r} must be in (0, 1]: 1 / the number of ranks of "
                             f"the group holding an identical copy of this gradient (a shard: 1)")
        if group is THIS_RANK and w != 1:
            raise ValueError(f"grads_and_weights[{i}]: weight={w!r} says the gradient has copies on other ranks, "
                             f"but group=THIS_RANK reduces over none: every weight must be 1")


@torch.no_grad()
def clip_grad_norm_(grads_and_weights, max_norm: float, group=None, device=None) -> torch.Tensor:
    """Scale every gradient in place by min(1, max_norm / (||g|| + 1e-6)) and return ||g||, the
    global norm of the single-process gradient (module docstring):

        ||g|| = sqrt( all_reduce_sum over group of  sum_i w_i * ||g_i||^2 )

    grads_and_weights: (gradient or None, weight) pairs of this rank; None is skipped, as torch
    skips parameters without .grad. group: the ranks the weights count copies over (None: the
    default group; THIS_RANK, or no process group at all: no collective). device: where the
    scalar is all-reduced (default: the first gradient's; NCCL needs the GPU even when the
    gradients were offloaded to the host). Every rank of the group must call it.
    """
    pairs = list(grads_and_weights)
    _check(pairs, max_norm, group)
    pairs = [(g.detach(), float(w)) for g, w in pairs if g is not None]
    if device is None:
        device = pairs[0][0].device if pairs else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g, w in pairs:
        part = g.double().square().sum().to(device)
        sq += part if w == 1 else part * w
    if group is not THIS_RANK and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt().float()
    coef = torch.clamp(max_norm / (norm + EPS), max=1.0)
    for g, _ in pairs:
        g.mul_(coef.to(g.device, g.dtype))
    return norm
