"""The boxes of a composed (3D) layout: course_lib.parallel.hybrid's dp x tp x pp, ZeRO-1 or not.

A rank of build_hybrid holds its pipeline stage's parameters (single-process names in
stage.param_names), each one tensor-parallel shard or whole. Those give *base* slots: a global
box and where it sits in the local tensor (`local_box`). Expert parallelism (ep > 1) keeps
whole experts under their single-process names (rank 1 of ep=2 with 4 experts holds
mlps.2 and mlps.3), so an expert is a whole base slot held by one ep rank, and the dense
parameters are identical boxes on every ep rank (saved once, like the tied matrix). ZeRO-1 over dp then flattens the local
tensors into units and keeps the range [r*S, (r+1)*S) of each: a range of a local tensor is
local boxes (reshard.flat_range_boxes), and each local box, intersected with a base slot's
local box, maps to a global box by the same shift:

    global = base.box.offsets + (local_part.offsets - base.local_box.offsets)

so the composed slot holds, inside the flat master shard, exactly the elements of that global
box. The tied embedding held by the first and the last stage gives identical boxes on both:
format.py keeps one copy when saving, and both stages fill theirs when loading. Expert
parallelism (ep > 1) is not described here yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.checkpoint.reshard import Box, flat_range_boxes, index_runs, whole
from course_lib.checkpoint.slots import Layout, Slot
from course_lib.parallel.hybrid import trained_module


@dataclass
class BaseSlot:
    name: str
    shape: tuple
    box: Box  # global
    local_box: Box  # the same elements in the local tensor
    param: torch.Tensor


def base_slots(parts) -> list[BaseSlot]:
    """Every (pipeline-stage) parameter of this rank: TP boxes from the layers' index tables, else whole."""
    module = trained_module(parts)
    params = list(module.parameters())
    names = parts.stage.param_names if parts.stage is not None else [n for n, _ in parts.model.named_parameters()]
    tp_rank = parts.coords["tp"]
    specs = {}
    for mod in parts.model.modules():
        for attr, dim, table, size in getattr(mod, "sharded", lambda: [])():
            specs[id(getattr(mod, attr))] = (dim, table[tp_rank], size)
    out = []
    for name, p in zip(names, params):
        if id(p) not in specs:
            out.append(BaseSlot(name, tuple(p.shape), whole(p.shape), whole(p.shape), p))
            continue
        dim, rows, size = specs[id(p)]
        shape = tuple(size if d == dim else s for d, s in enumerate(p.shape))
        for g, local, n in index_runs(rows, size):
            lengths = tuple(n if d == dim else s for d, s in enumerate(p.shape))
            out.append(BaseSlot(name, shape, Box(tuple(g if d == dim else 0 for d in range(p.dim())), lengths),
                                Box(tuple(local if d == dim else 0 for d in range(p.dim())), lengths), p))
    return out


def _as_slot(b: BaseSlot) -> Slot:
    return Slot(b.name, b.shape, b.box, b.param, lambda t, lb=b.local_box: t[lb.slices()])


def zero_composed_slots(optimizer, bases: list[BaseSlot]) -> list[Slot]:
    """The boxes of each flat master shard of a ShardedOptimizer over TP-local tensors."""
    by_param = {}
    for b in bases:
        by_param.setdefault(id(b.param), []).append(b)
    slots = []
    for s in optimizer.shards:
        u = s.unit
        for p, shape, off, n in zip(u.params, u.shapes, u.offsets, u.numels):
            a, e = max(u.start, off), min(u.stop, off + n)
            if a >= e:
                continue
            for local, pos in flat_range_boxes(shape, a - off, e - off):
                lo = off + pos - u.start  # where this local box starts inside the flat shard
                for b in by_param[id(p)]:
                    part = local.intersect(b.local_box)
                    if part is None:
                        continue
                    box = Box(tuple(g + o - lb for g, o, lb in zip(b.box.offsets, part.offsets, b.local_box.offsets)),
                              part.lengths)

                    def select(t, lo=lo, local=local, part=part):
                        return t[lo:lo + local.volume].view(local.lengths)[part.slices(local.offsets)]
                    slots.append(Slot(b.name, b.shape, box, s.master, select))
    return slots


def hybrid_layout(parts, optimizer=None) -> Layout:
    """The Layout of a build_hybrid rank (pass parts.optimizer or make_hybrid_optimizer's result)."""
    bases = base_slots(parts)
    params = [_as_slot(b) for b in bases]
    if optimizer is not None and hasattr(optimizer, "shards"):  # ZeRO-1 over dp
        return Layout("hybrid", zero_composed_slots(optimizer, bases), params,
                      lambda master: optimizer.optimizer.state[master])
    state = (lambda p: optimizer.state[p]) if optimizer is not None else (lambda p: {})
    return Layout("hybrid", params, params, state)
