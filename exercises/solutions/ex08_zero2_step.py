"""Exercise 08, reference solution: a ZeRO-2 optimizer, each gradient reduce-scattered as backward makes it."""

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    size = -(-numel // world_size)  # ceil: the tensor is padded to world_size * size
    return rank * size, (rank + 1) * size


class Zero2AdamW:
    def __init__(self, params, lr, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8, group=None):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.bounds = [shard_bounds(p.numel(), self.world_size, self.rank) for p in self.params]
        with torch.no_grad():
            # fp32 master weights of my shard of each parameter only (a copy, not a view of the model)
            self.master = [self._padded(p.detach())[start:stop].clone().float()
                           for p, (start, stop) in zip(self.params, self.bounds)]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps,
                                           foreach=False)
        # Hooks run in the order backward produces the gradients, the same on every rank, so the
        # ranks' reduce-scatters pair up one parameter at a time.
        self.hooks = [p.register_post_accumulate_grad_hook(self._reduce_scatter) for p in self.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        """t flattened and zero-padded to world_size * shard size (the padding stays 0 under AdamW)."""
        flat = t.reshape(-1)
        pad = -(-flat.numel() // self.world_size) * self.world_size - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)) if pad else flat

    @torch.no_grad()
    def _reduce_scatter(self, p: torch.Tensor) -> None:
        i = self.index[id(p)]
        start, stop = self.bounds[i]
        full = self._padded(p.grad.float()).div(self.world_size)  # sum over ranks of g/N = the mean
        p.grad = None  # the full gradient leaves now: only the shard stays
        shard = torch.empty(stop - start, dtype=full.dtype, device=full.device)
        reduce_scatter_single(shard, full, group=self.group)
        master = self.master[i]
        master.grad = shard if master.grad is None else master.grad.add_(shard)  # a second backward adds

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None

    @torch.no_grad()
    def step(self):
        shards = [m.grad if m.grad is not None else torch.zeros_like(m) for m in self.master]
        for m, g in zip(self.master, shards):
            m.grad = g
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            full = torch.empty(m.numel() * self.world_size, dtype=m.dtype, device=m.device)
            all_gather_single(full, m, group=self.group)
            p.copy_(full[:p.numel()].view_as(p))
            m.grad = None  # after the update the rank keeps no gradient at all
        return shards
