"""Exercise 08, reference solution: one ZeRO-2 optimizer step with AdamW."""

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    size = -(-numel // world_size)  # ceil: the buffer is padded to world_size * size
    return rank * size, (rank + 1) * size


class Zero2AdamW:
    def __init__(self, params, lr, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8, group=None):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.stop = shard_bounds(self.numel, self.world_size, self.rank)
        self.padded = (self.stop - self.start) * self.world_size
        with torch.no_grad():
            flat = self._flatten([p.detach() for p in self.params])
            self.master = flat[self.start:self.stop].clone()  # fp32 master weights of my shard only
        self.optimizer = torch.optim.AdamW([self.master], lr=lr, betas=betas, weight_decay=weight_decay, eps=eps,
                                           foreach=False)

    def _flatten(self, tensors):
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.params[0].device)
        offset = 0
        for t, p in zip(tensors, self.params):
            if t is not None:
                flat[offset:offset + p.numel()] = t.reshape(-1)
            offset += p.numel()
        return flat

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        grads = self._flatten([p.grad for p in self.params]).div_(self.world_size)
        shard = torch.empty(self.stop - self.start, dtype=grads.dtype, device=grads.device)
        reduce_scatter_single(shard, grads, group=self.group)
        for p in self.params:
            p.grad = None  # the full gradient is no longer needed: only the shard stays
        self.master.grad = shard
        self.optimizer.step()
        full = torch.empty(self.padded, dtype=self.master.dtype, device=self.master.device)
        all_gather_single(full, self.master.detach().clone(), group=self.group)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.master.grad = None
        return shard

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0)
