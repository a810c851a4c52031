"""Muon under ZeRO-1-style sharding: each rank keeps a row block of every matrix's momentum.

Why the flat design (flat.py, sharded_optimizer.py) cannot run Muon without a gather: it lays the
parameters end to end and cuts the vector into N equal pieces wherever the boundary falls,

      flat:  | W0 ........... | W1 ...................... | W2 ..... |
             |<-- shard 0 -->|<-- shard 1 -->|<-- shard 2 -->|
                            ^ W0 spans shards 0 and 1; W1 spans 1 and 2

Adam's update of element i needs element i only, so each rank can step its piece. Muon's update is
Newton-Schulz of the WHOLE momentum matrix (course_lib.techniques.muon): every output element
depends on every input element (X X^T mixes all columns of a row with every other row), so
orthogonalising rank 0's piece of W0 and rank 1's piece separately is a different (wrong) update.
Some rank must hold the whole matrix; the flat engine keeps refusing Muon (ELEMENTWISE_OPTIMIZERS).

Here the shards are per matrix (FSDP2's dim-0 blocks, per_param.py's rule c = ceil(d0 / N) rows,
zero rows as padding), the parameters stay whole on every rank (ZeRO-1), and one step is, per
matrix W (d0 x d1) and rank r:

    g_r    = reduce_scatter(W.grad / N)[r]           the mean gradient's row block (c x d1)
    U_r    = momentum_update(B_r, g_r)                element-wise: the rows of the full update
    O      = the whole update orthogonalised, by one of three METHODS:
      gather    all_gather(U_r) -> U; O = NS(U) on every rank (N copies of the same work)
      owner     W's owner o (rank i mod N) gathers U, runs NS(U) alone, scatters O's row blocks
      balanced  as owner, owners chosen largest matrix first onto the least-loaded rank
    W_r   <- W_r (1 - lr wd) - lr' O_r               this rank's rows only (element-wise)
    W      = all_gather(W_r)                         every rank's parameters whole again

Liu et al. 2025 (Moonlight's "Distributed Muon") run the gather form over ZeRO-1; owner-compute is
how FSDP2 implementations of Muon split the work (e.g. the gather / scatter Muon in the repository
of Dion, Ahn et al. 2025, whose own optimizer avoids whole matrices altogether). The scatter
moves O in bf16 (Newton-Schulz's output dtype: nothing is lost). The step equals
course_lib.techniques.muon.Muon on the mean gradient, bit for bit when that mean is exact.
Bytes and FLOPs per rank: course_lib.estimate.muon.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.estimate.muon import METHODS, assign_owners, check_method, newton_schulz_flops, shard_rows
from course_lib.techniques.muon import (EPS, NS_COEFFICIENTS, NS_STEPS, adjusted_lr, apply_update, check_muon_params,
                                        momentum_update, newton_schulz)


def check_sharded_muon_args(named_shapes, method: str) -> None:
    """The parent's checks, before any rank starts: a known method and 2-D matrices only."""
    check_method(method)
    check_muon_params(named_shapes)


class ShardedMuon:
    """Muon over 2-D parameters whose momentum is row-sharded over `group` (module docstring).

        opt = ShardedMuon(matrices, method="owner", lr=0.02)
        loss.backward(); opt.step(); opt.zero_grad()   # it averages the gradients itself

    The parameters must be equal on every rank; their .grad are the rank's local gradients.
    Same hyperparameters as torch.optim.Muon; `param_groups[0]` holds them (one group).
    ns_flops counts the Newton-Schulz FLOPs this rank ran (estimate.muon.newton_schulz_flops)."""

    def __init__(self, params, group=None, method: str = "gather", lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = EPS,
                 ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None):
        params = [p for p in params if p.requires_grad]
        check_sharded_muon_args([(str(i), p.shape) for i, p in enumerate(params)], method)
        adjusted_lr(lr, adjust_lr_fn, (1, 1))  # refuses an unknown adjust_lr_fn
        self.group, self.method = group, method
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.param_groups = [dict(params=params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                  nesterov=nesterov, ns_coefficients=tuple(ns_coefficients), eps=eps,
                                  ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)]
        shapes = [tuple(p.shape) for p in params]
        self.owners = assign_owners(shapes, self.world_size, method)
        self.rows = [shard_rows(d0, self.world_size) for d0, _ in shapes]
        self.momentum = [torch.zeros(c, p.shape[1], dtype=p.dtype, device=p.device) for c, p in zip(self.rows, params)]
        self.ns_flops = 0

    @property
    def params(self):
        return self.param_groups[0]["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _padded(self, t: torch.Tensor, c: int) -> torch.Tensor:
        out = torch.zeros(self.world_size * c, t.shape[1], dtype=t.dtype, device=t.device)
        out[:t.shape[0]].copy_(t)
        return out

    def _orthogonalised_block(self, i: int, u: torch.Tensor, d0: int, g: dict) -> torch.Tensor:
        """This rank's c rows of NS(the whole update of matrix i), from its block u of it."""
        n, c = self.world_size, self.rows[i]
        ns = lambda full: newton_schulz(full[:d0], g["ns_steps"], g["ns_coefficients"], g["eps"])
        if self.owners is None:  # gather: everyone assembles U and orthogonalises it
            full = torch.empty(n * c, u.shape[1], dtype=u.dtype, device=u.device)
            all_gather_single(full, u.contiguous(), group=self.group)
            self.ns_flops += newton_schulz_flops(full[:d0].shape, g["ns_steps"])
            return ns(full)[self.rank * c:(self.rank + 1) * c]
        owner = self.owners[i]
        block = torch.empty(c, u.shape[1], dtype=torch.bfloat16, device=u.device)
        if self.rank == owner:
            pieces = [torch.empty_like(u) for _ in range(n)]
            dist.gather(u.contiguous(), gather_list=pieces, dst=self._global(owner), group=self.group)
            full = torch.cat(pieces)
            self.ns_flops += newton_schulz_flops(full[:d0].shape, g["ns_steps"])
            out = self._padded(ns(full), c)
            dist.scatter(block, scatter_list=list(out.chunk(n)), src=self._global(owner), group=self.group)
        else:
            dist.gather(u.contiguous(), gather_list=None, dst=self._global(owner), group=self.group)
            dist.scatter(block, scatter_list=None, src=self._global(owner), group=self.group)
        return block

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported: the sharded step communicates, run forward/backward first")
        g = self.param_groups[0]
        n, r = self.world_size, self.rank
        for i, p in enumerate(self.params):
            d0, c = p.shape[0], self.rows[i]
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            flat = self._padded(grad, c).div_(n)  # the sum of g / N is the mean
            g_r = torch.empty(c, p.shape[1], dtype=p.dtype, device=p.device)
            reduce_scatter_single(g_r, flat, group=self.group)
            u = momentum_update(self.momentum[i], g_r, g["momentum"], g["nesterov"])
            o = self._orthogonalised_block(i, u, d0, g)
            lo, hi = min(r * c, d0), min((r + 1) * c, d0)  # this rank's real rows (none: all padding)
            apply_update(p.data[lo:hi], o[:hi - lo], g["lr"], g["weight_decay"],
                         adjusted_lr(g["lr"], g["adjust_lr_fn"], p.shape))
            mine = torch.zeros(c, p.shape[1], dtype=p.dtype, device=p.device)
            mine[:hi - lo].copy_(p.data[lo:hi])
            full = torch.empty(n * c, p.shape[1], dtype=p.dtype, device=p.device)
            all_gather_single(full, mine, group=self.group)
            p.data.copy_(full[:d0])  # the other ranks' updated rows (bitwise copies)

    def full_momentum(self) -> list[torch.Tensor]:
        """Every matrix's whole momentum buffer, gathered (collective: every rank calls it)."""
        out = []
        for p, c, m in zip(self.params, self.rows, self.momentum):
            full = torch.empty(self.world_size * c, m.shape[1], dtype=m.dtype, device=m.device)
            all_gather_single(full, m.contiguous(), group=self.group)
            out.append(full[:p.shape[0]].clone())
        return out


__all__ = ["ShardedMuon", "METHODS", "check_sharded_muon_args"]
