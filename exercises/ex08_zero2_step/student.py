"""Exercise 08: one ZeRO-2 optimizer step with AdamW. Fill in the parts marked TODO, then run
the check cells of ex08_zero2_step.ipynb. Each check prints PASS when your code is right.

The rules (notebook 08 explains why):
  * the parameters are laid end to end in one flat fp32 vector, padded with zeros to a multiple
    of the world size N, and cut into N equal shards; rank r owns shard r;
  * each rank keeps the fp32 master weights and AdamW's state of ITS shard only;
  * a step: reduce-scatter the (padded, flattened) gradients so that rank r receives the MEAN
    gradient of shard r; drop the full gradients; update the shard with AdamW; all-gather the
    updated shards and copy them back into the parameters.

Collectives (torch 2.13 names, with fallbacks): from course_lib.comm.compat import
reduce_scatter_single, all_gather_single
    reduce_scatter_single(output, input, group=group)   input: N*S elements, output: S
    all_gather_single(output, input, group=group)       input: S elements,   output: N*S
"""

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single  # noqa: F401 (you will need them)


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's shard of a flat vector of `numel` elements padded to N * S,
    S = ceil(numel / N). Example: numel 10, N 4 -> S 3: rank 0 (0, 3), ..., rank 3 (9, 12)."""
    raise NotImplementedError("exercise 08: write shard_bounds")


class Zero2AdamW:
    """ZeRO stage 2 with AdamW over `params` (a plain model's parameters, the same on every rank)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8, group=None):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # TODO 1: this rank's shard bounds over the total number of parameter elements.
        # TODO 2: self.master = an fp32 COPY of this rank's slice of the flattened, padded
        #         parameters (a plain tensor, not a view of the model).
        # TODO 3: self.optimizer = torch.optim.AdamW([self.master], lr=lr, betas=betas,
        #         weight_decay=weight_decay, eps=eps, foreach=False): it only ever sees the shard.
        raise NotImplementedError("exercise 08: write Zero2AdamW.__init__")

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """After backward. Returns this rank's shard of the MEAN gradient (S elements).

        1. flatten every p.grad into one padded fp32 vector (zeros in the padding), divide by N,
           reduce-scatter it: rank r receives the sum over ranks of shard r;
        2. set every p.grad to None (only the shard stays);
        3. self.master.grad = the gradient shard; self.optimizer.step();
        4. all-gather the updated master shards into one padded vector and copy each
           parameter's slice back into it (p.copy_(...)).
        """
        raise NotImplementedError("exercise 08: write Zero2AdamW.step")

    def state_bytes(self) -> int:
        """Bytes of AdamW's per-element state this rank holds (m and v; not the 0-dim step)."""
        raise NotImplementedError("exercise 08: write Zero2AdamW.state_bytes")
