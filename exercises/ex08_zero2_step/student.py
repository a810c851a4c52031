"""Exercise 08: a ZeRO-2 optimizer with AdamW. Write the parts that raise NotImplementedError,
then run the check cells of ex08_zero2_step.ipynb. Each check prints PASS when your code is right.

The goal: train exactly as one process with torch.optim.AdamW on the whole batch would, while
no rank ever holds the full gradient of the model (ZeRO stage 2). Every rank runs the same
model on its own share of the batch; the caller does zero_grad(), forward, loss.backward(),
step(), as with any torch optimizer.

The rules (notebook 08 explains why):
  * each parameter is sharded on its own: flattened, padded with zeros to a multiple of the
    world size N, cut into N equal pieces; rank r owns piece r (`shard_bounds`);
  * a rank keeps, for its pieces only, the fp32 master weights and AdamW's state, updated with
    torch.optim.AdamW(..., foreach=False);
  * gradients: a rank may hold its gradient shards plus the ONE full gradient that backward has
    just produced. As soon as a parameter's gradient exists, rank r must end up with piece r of
    the MEAN of that gradient over the ranks, and the full gradient must be gone. Wait until
    backward ends and the rank has held them all: that is stage 1, and the check measures it;
  * step() updates the shards, brings every parameter back whole on every rank, keeps no
    gradient afterwards, and returns this rank's gradient shards (one per parameter, in the
    order of `params`, each S_i = ceil(P_i / N) elements, zeros in the padding).

Tools you may want (torch 2.13 names, with fallbacks): from course_lib.comm.compat import
reduce_scatter_single, all_gather_single (see notebook 08, §3 and §7), and torch's
Tensor.register_post_accumulate_grad_hook. Every rank's backward produces the gradients in the
same order. The course's own ZeRO (course_lib.parallel.zero), torch's ZeroRedundancyOptimizer
and FSDP are refused: write it yourself, then compare.
"""

import math  # noqa: F401 (part 2)

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single  # noqa: F401 (you will need them)
from course_lib.techniques.muon import newton_schulz  # noqa: F401 (part 2: allowed, it is not the answer)


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's piece of a flat tensor of `numel` elements padded to N * S,
    S = ceil(numel / N). Example: numel 10, N 4 -> S 3: rank 0 (0, 3), ..., rank 3 (9, 12)."""
    raise NotImplementedError("exercise 08: write shard_bounds")


class Zero2AdamW:
    """ZeRO stage 2 with AdamW over `params` (a plain model's parameters, the same on every rank)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8, group=None):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        raise NotImplementedError("exercise 08: write Zero2AdamW.__init__")

    def zero_grad(self, set_to_none: bool = True):
        """Forget every gradient this rank holds (full or shard), before the next backward."""
        raise NotImplementedError("exercise 08: write Zero2AdamW.zero_grad")

    @torch.no_grad()
    def step(self) -> list[torch.Tensor]:
        """After backward: update, bring the parameters back whole, return the gradient shards."""
        raise NotImplementedError("exercise 08: write Zero2AdamW.step")


# ---------------------------------------------------------------- part 2: Muon's owner step
# Muon (notebook 08, section 13) orthogonalises each WHOLE weight matrix, so a rank that keeps
# only a row block of its momentum cannot step its block alone. Owner-compute: each matrix has
# one owner rank, which gathers the matrix, runs Newton-Schulz once, and scatters the rows back.
# The course's sharded Muon (course_lib.parallel.zero.muon, course_lib.estimate.muon) is refused.

def ns_work(shape) -> int:
    """Newton-Schulz's work on a (d0, d1) matrix, up to a constant: min(d0, d1)^2 * max(d0, d1)
    (each step multiplies the wide orientation by its transpose and by a small square matrix)."""
    return min(shape) ** 2 * max(shape)


def assign_owners(shapes, world_size: int) -> list[int]:
    """The owner rank (0 .. N-1) of each matrix of `shapes` [(d0, d1), ...], N = world_size.

    Contract: one owner per matrix, the same answer every time it is called (every rank calls it
    and they must agree), and balanced Newton-Schulz work: with W_r the sum of ns_work over the
    matrices rank r owns, the most loaded rank must stay within
        max_r W_r  <=  sum(W) / N  +  (1 - 1/N) * max_i ns_work(shape_i).
    A rank may own nothing (fewer matrices than ranks)."""
    raise NotImplementedError("exercise 08, part 2: write assign_owners")


@torch.no_grad()
def muon_owner_step(weights, grads, momenta, shapes, owners, group=None, *, lr, momentum=0.95, nesterov=True,
                    weight_decay=0.1, ns_steps=5) -> None:
    """One Muon step (torch.optim.Muon's maths, adjust_lr_fn=None) with each matrix orthogonalised
    by its owner only. Every rank calls it with the same shapes and owners.

    For matrix i of shape (d0, d1), every list holds THIS rank's block of c = ceil(d0 / N) rows
    (rank r: rows r*c .. r*c + c - 1; rows past d0 are zero padding): weights[i] and momenta[i]
    (fp32, update them in place) and grads[i] (the mean gradient's rows, already reduced). Per matrix:
      B <- mu B + (1 - mu) G;  U = (1 - mu) G + mu B if nesterov else B     (row by row)
      O = newton_schulz(the whole U, ns_steps), computed on owners[i] only: gather the N blocks
          of U there (dist.gather), and send each rank its rows of O back (dist.scatter)
      W <- W (1 - lr * weight_decay) - lr * sqrt(max(1, d0 / d1)) * O      (this rank's rows)
    Only the owner may receive a whole matrix: the others receive their own rows of O.
    `owners` are ranks of `group` (dist.get_global_rank(group, owner) converts when group is set).
    Collectives take contiguous tensors; newton_schulz returns a transposed view for a tall matrix."""
    raise NotImplementedError("exercise 08, part 2: write muon_owner_step")
