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

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single  # noqa: F401 (you will need them)


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
