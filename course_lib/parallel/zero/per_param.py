"""Per-parameter sharding (FSDP2's design, Zhao et al. 2023): one unit and its parameters.

The flat design (flat.py, stage3.py) lays a unit's parameters end to end and replaces them by one
`flat_shard`. Here every parameter W of shape (d0, ...) keeps its name and is cut on dim 0 into S
row blocks of c = ceil(d0 / S) rows (S = the shard group's size), the last rank(s) padded with
zero rows, so `model.named_parameters()` yields rank j's rows [j*c, (j+1)*c) under W's name, and
its placement record (course_lib.parallel.placement, the course's Shard(0)) says which rows:

    Placement.split("dp_shard", dim=0, table=[[0..c), [c..2c), ...], rank=j, full=d0)

Flat buffers still exist, but only for the copy-in / copy-out around one all-gather per unit:

    copy-in     send = cat(local_i.flatten() for i in unit)           S_u = sum_i c_i * row_i elements
    all-gather  G = all_gather(send)  laid out (S, S_u): rank j's send is row j
    copy-out    W_i padded (S*c_i rows) = G[:, off_i : off_i + c_i*row_i] viewed (S, c_i, ...)

and in backward the mirror: each padded gradient is packed rank-major into one (S, S_u) buffer in
reduce_dtype, divided by N (the data-parallel world, so the sum is the mean) and reduce-scattered
(course_lib.comm.compat.reduce_scatter_single, the collective stage 3 uses; gloo runs it as an
all-reduce plus keeping one chunk); with HSDP the reduced shard is then all-reduced across the R
replicas (hsdp.py). A replicated unit (norms under a Linear/Embedding-only policy) keeps the whole
fp32 tensor; its "gather" is a cast to the compute dtype and its gradient an all-reduce (mean), so
every rank ends with the bitwise same gradient.

Gathered tensors live in storages that are freed (resized to 0) after forward and refilled before
backward; autograd's saved views of them see the refilled values (the trick stage3.py uses).
What stays gathered after a forward (the root, replicated units, reshard_after_forward=False; all
of them after a forward that no backward follows) is gathered again when the shards changed since:
a unit stamps its gather with every shard's version counter (bumped by any in-place change through
the parameter: foreach optimizers, load_state_dict, `p.mul_` under no_grad) and with the count of
torch optimizer steps in this process (a global step post-hook: fused kernels leave the version
counters alone), so any optimizer may step the shards, not only the course's.
reshard_after_forward = k (an int dividing S) keeps, instead of nothing, 1/k of each padded
tensor and re-gathers in backward from the k ranks of its subgroup only (FSDP2's "reshard to a
smaller world", e.g. inside a node).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.parallel.placement import Placement

AXIS = "dp_shard"
_STEPS = [0]  # torch optimizer steps taken in this process (any optimizer), counted by _count_step
_HOOK = []  # the global step post-hook's handle, registered once


def _count_step(optimizer, args, kwargs) -> None:
    _STEPS[0] += 1


def count_optimizer_steps() -> None:
    """Register (once per process) the global post-hook that counts every torch optimizer's steps."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_count_step))


def shard_rows(d0: int, shards: int) -> int:
    """c = ceil(d0 / S): the rows every rank holds of a dim-0 length d0 (the last padded)."""
    return -(-d0 // shards)


class _Unshard(torch.autograd.Function):
    """local shards -> the unit's gathered (padded) tensors; backward: reduce the gradients."""

    @staticmethod
    def forward(ctx, unit, *shards):
        ctx.unit = unit
        return tuple(unit.padded)  # filled by the gather; returned objects become outputs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.unit.reduce_gradients(grads))


class Entry:
    """One parameter of a unit: its name, full shape, local shard and where the model uses it."""

    def __init__(self, name, param, locations, unit):
        self.name, self.locations, self.shape = name, locations, tuple(param.shape)
        if param.dim() == 0 and not unit.replicate:
            raise ValueError(f"{name}: a 0-dim parameter has no dim 0 to shard; replicate it (policy)")
        self.rest = self.shape[1:]
        self.row = int(torch.Size(self.rest).numel())
        n, j = unit.shards, unit.shard_rank
        with torch.no_grad():
            full = param.detach().float()
            if unit.replicate:
                self.c, local = self.shape[0] if self.shape else 1, full.clone()
                self.placement = Placement.replicated(AXIS, j, unit.manager.shards)
            else:
                self.c = shard_rows(self.shape[0], n)
                padded = full.new_zeros((n * self.c,) + self.rest)
                padded[:self.shape[0]] = full
                local = padded[j * self.c:(j + 1) * self.c].clone()
                self.placement = Placement.split(AXIS, 0, [range(r * self.c, (r + 1) * self.c) for r in range(n)],
                                                 j, self.shape[0])
        self.local = nn.Parameter(local, requires_grad=param.requires_grad)


class Unit:
    """A group of parameters gathered together (one all-gather, one reduce-scatter per step)."""

    def __init__(self, name, modules, params, manager, replicate=False, root=False):
        self.name, self.modules, self.manager, self.replicate, self.root = name, modules, manager, replicate, root
        self.shards = 1 if replicate else manager.shards
        self.shard_rank = manager.shard_rank
        self.entries = [Entry(n, p, locs, self) for n, p, locs in params]
        self.numel = sum(e.c * e.row for e in self.entries)  # S_u (replicated: the whole unit)
        self.padded, self.partial, self.work, self.started, self.stamp = [], None, None, 0.0, None
        self.installed = self.freed = self.pending = False  # views in the modules / storage freed / backward due
        self.seen = set()

    # ---------------------------------------------------------------- storage
    def _alloc(self) -> None:
        dtype = self.manager.param_dtype
        if not self.padded:
            self.padded = [torch.empty((self.shards * e.c,) + e.rest if e.shape else (), dtype=dtype,
                                       device=e.local.device) for e in self.entries]
        else:
            for t in self.padded:
                t.untyped_storage().resize_(t.numel() * t.element_size())

    def gathered(self) -> bool:
        return bool(self.padded) and not self.freed

    def free(self) -> None:
        for t in self.padded:
            t.untyped_storage().resize_(0)
        self.freed = True

    def forget(self) -> None:
        """After backward: drop the tensors; the next forward allocates fresh ones."""
        self.free()
        self.padded, self.partial, self.freed, self.pending = [], None, False, False

    def _stamp(self) -> tuple:
        return (_STEPS[0], self.manager.generation, tuple(e.local._version for e in self.entries))

    def stale(self) -> bool:
        """Gathered (or being gathered) from shards that changed since: an optimizer step or any
        in-place change of a shard (module docstring)."""
        return (self.work is not None or bool(self.padded)) and self.stamp != self._stamp()

    def drop_stale(self) -> None:
        """Forget a stale gather (waiting for one still in flight first): the next gather is fresh."""
        if self.work is not None:
            self.work.wait()
            self.work = self.buffer = None
        self.forget()

    # ---------------------------------------------------------------- gather
    def start_gather(self, from_partial: bool = False) -> None:
        """Allocate and start the async all-gather (the shard group, or the reshard subgroup)."""
        if self.work is not None or self.gathered():
            return
        self._alloc()
        self.freed = False
        m = self.manager
        self.stamp = self._stamp()
        if self.replicate:  # nothing to fetch: a cast into the compute dtype
            with torch.no_grad():
                for t, e in zip(self.padded, self.entries):
                    t.data.copy_(e.local.detach())
            return
        if from_partial:
            send, group, parts = self.partial, m.sub_group, m.reshard_size
        else:
            send = torch.cat([e.local.detach().to(m.param_dtype).reshape(-1) for e in self.entries])
            group, parts = m.shard_group, self.shards
        self.buffer = torch.empty(self.numel * self.shards, dtype=m.param_dtype, device=send.device)
        self.parts, self.started = parts, time.perf_counter()
        self.work = all_gather_single(self.buffer, send.contiguous(), group=group, async_op=True)
        m.gather_calls += 1
        m.log("gather", self)
        m.gather_bytes += self.buffer.numel() * self.buffer.element_size() * (parts - 1) // parts

    def wait_gather(self, from_partial: bool = False) -> None:
        if self.work is None and not self.gathered():
            self.start_gather(from_partial)
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        self._copy_out(self.buffer, self.parts)
        self.buffer = None
        self.manager.span(f"all-gather {self.name}", self.started)

    def _copy_out(self, flat, parts) -> None:
        """Padded tensor i = the (parts, rows_i, ...) pieces of flat laid out (parts, S_u * S / parts)."""
        view, off = flat.view(parts, -1), 0
        with torch.no_grad():
            for t, e in zip(self.padded, self.entries):
                rows = self.shards * e.c // parts
                k = rows * e.row
                t.data.view((parts, rows) + e.rest).copy_(view[:, off:off + k].view((parts, rows) + e.rest))
                off += k

    def keep_partial(self) -> None:
        """reshard_after_forward = k: keep rows chunk (rank mod k) of k of every padded tensor."""
        k, j = self.manager.reshard_size, self.shard_rank % self.manager.reshard_size
        self.partial = torch.cat([t.detach().view((k, -1))[j].clone() for t in self.padded])

    # ---------------------------------------------------------------- the model's view
    def install(self) -> None:
        """Run the gather's autograd node and point every use of every parameter at its full view."""
        outs = _Unshard.apply(self, *[e.local for e in self.entries])
        for out, e in zip(outs, self.entries):
            full = out if self.replicate or out.shape[0] == e.shape[0] else out.narrow(0, 0, e.shape[0])
            for mod, attr in e.locations:
                mod._parameters.pop(attr, None)
                setattr(mod, attr, full)
        self.installed, self.pending = True, torch.is_grad_enabled()

    def restore(self) -> None:
        """Register the local shards again: outside forward, named_parameters() yields them."""
        for e in self.entries:
            for mod, attr in e.locations:
                mod.__dict__.pop(attr, None)
                mod._parameters[attr] = e.local
        self.installed = False

    # ---------------------------------------------------------------- backward
    def reduce_gradients(self, grads):
        m = self.manager
        started = time.perf_counter()
        rd = m.reduce_dtype
        if self.replicate:
            out = []
            for g, e in zip(grads, self.entries):
                g = (torch.zeros(e.shape, dtype=rd, device=e.local.device) if g is None else g.to(rd)).div(m.world).contiguous()
                dist.all_reduce(g, group=m.world_group)
                out.append(g.to(e.local.dtype))
        else:
            flat = torch.zeros(self.shards, self.numel, dtype=rd, device=self.entries[0].local.device)
            off = 0
            for g, e in zip(grads, self.entries):
                k = e.c * e.row
                if g is not None:
                    flat[:, off:off + k].copy_(g.reshape(self.shards, k))
                off += k
            flat.div_(m.world)  # the sum over N ranks of g / N is the mean
            shard = torch.empty(self.numel, dtype=rd, device=flat.device)
            reduce_scatter_single(shard, flat.view(-1), group=m.shard_group)
            if m.replicate_group is not None:  # HSDP: the same shard on each replica is summed
                dist.all_reduce(shard, group=m.replicate_group)
            out, off = [], 0
            for e in self.entries:
                k = e.c * e.row
                out.append(shard[off:off + k].view((e.c,) + e.rest).to(e.local.dtype))
                off += k
        m.span(f"reduce {self.name}", started)
        m.log("reduce", self)
        self.forget()
        return out

    def __repr__(self):
        kind = "replicated" if self.replicate else f"sharded over {self.shards}"
        return f"Unit({self.name}: {len(self.entries)} params, {kind}, {self.numel} local elements)"
