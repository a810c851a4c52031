"""Exercise 08, reference solution: a ZeRO-2 optimizer, each gradient reduce-scattered as backward makes it;
part 2, Muon's owner-compute step."""

import math

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.techniques.muon import newton_schulz


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


# ---------------------------------------------------------------- part 2: Muon's owner step
def ns_work(shape) -> int:
    """Newton-Schulz's work on a (d0, d1) matrix, up to a constant: min(d0, d1)^2 * max(d0, d1)."""
    return min(shape) ** 2 * max(shape)


def assign_owners(shapes, world_size: int) -> list[int]:
    # Largest first, each onto the rank with the least work so far: the big matrices spread out
    # before the small ones fill the gaps.
    load, owners = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_work(shapes[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += ns_work(shapes[i])
    return owners


@torch.no_grad()
def muon_owner_step(weights, grads, momenta, shapes, owners, group=None, *, lr, momentum=0.95, nesterov=True,
                    weight_decay=0.1, ns_steps=5) -> None:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for w, g, b, (d0, d1), owner in zip(weights, grads, momenta, shapes, owners):
        c = w.shape[0]
        b.lerp_(g, 1 - momentum)  # B <- mu B + (1 - mu) G, row by row: my rows need my rows only
        u = g.lerp(b, momentum) if nesterov else b
        root = owner if group is None else dist.get_global_rank(group, owner)
        block = torch.empty(c, d1, dtype=torch.bfloat16)
        if rank == owner:
            pieces = [torch.empty_like(u) for _ in range(n)]
            dist.gather(u.contiguous(), gather_list=pieces, dst=root, group=group)
            o = newton_schulz(torch.cat(pieces)[:d0], ns_steps)  # the whole matrix, padding rows dropped
            o = torch.nn.functional.pad(o, (0, 0, 0, n * c - d0))
            # contiguous: for a tall matrix newton_schulz returns a transposed view, and a
            # collective sends a tensor's storage as it lies
            dist.scatter(block, scatter_list=[piece.contiguous() for piece in o.chunk(n)], src=root, group=group)
        else:
            dist.gather(u.contiguous(), gather_list=None, dst=root, group=group)
            dist.scatter(block, scatter_list=None, src=root, group=group)
        w.mul_(1 - lr * weight_decay)
        w.add_(block, alpha=-lr * math.sqrt(max(1, d0 / d1)))  # Muon's lr for a tall matrix
