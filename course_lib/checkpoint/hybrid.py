"""The boxes of a composed (3D) layout: course_lib.parallel.hybrid's dp x tp x pp, ZeRO-1 or not.

A rank of build_hybrid holds its pipeline stage's parameters (single-process names in
stage.param_names), each described on every axis by its Placement (course_lib.parallel.hybrid's
`placements`: tp split or whole, ep/pp/dp whole). Those give *base* slots: a global box and where
it sits in the local tensor (`local_box`). Expert parallelism (ep > 1) keeps
whole experts under their single-process names (rank 1 of ep=2 with 4 experts holds
mlps.2 and mlps.3), so an expert is a whole base slot held by one ep rank, and the dense
parameters are identical boxes on every ep rank (saved once, like the tied matrix). ZeRO-1 over dp then flattens the local
tensors into units and keeps the range [r*S, (r+1)*S) of each: a parameter's part of it (its flat
Placement on dp) is local boxes (reshard.flat_range_boxes), and each local box, intersected with
a base slot's local box, maps to a global box by the same shift:

    global = base.box.offsets + (local_part.offsets - base.local_box.offsets)

so the composed slot holds, inside the flat master shard, exactly the elements of that global
box. The tied embedding held by the first and the last stage gives identical boxes on both:
format.py keeps one copy when saving, and both stages fill theirs when loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.checkpoint.reshard import Box
from course_lib.checkpoint.slots import RankSlots, Slot, flat_boxes, placed_boxes
from course_lib.parallel.placement import Placement
from course_lib.parallel.hybrid.compose import placements, trained_parameters


@dataclass
class BaseSlot:
    name: str
    shape: tuple
    box: Box  # global
    local_box: Box  # the same elements in the local tensor
    param: torch.Tensor


def base_slots(parts) -> list[BaseSlot]:
    """Every (pipeline-stage) parameter of this rank: its boxes from its placements on every axis
    (a tp split's runs of rows/cols, else whole)."""
    placed = placements(parts)
    return [BaseSlot(name, shape, box, local_box, p) for name, p in trained_parameters(parts)
            for shape, boxes in [placed_boxes(placed[name], p.shape)] for box, local_box in boxes]


def _as_slot(b: BaseSlot) -> Slot:
    return Slot(b.name, b.shape, b.box, b.param, lambda t, lb=b.local_box: t[lb.slices()])


def zero_composed_slots(optimizer, bases: list[BaseSlot]) -> list[Slot]:
    """The boxes of each flat master shard of a ShardedOptimizer over TP-local tensors: each
    parameter's flat Placement on dp, its range of the unit's shard, cut into local boxes."""
    by_param = {}
    for b in bases:
        by_param.setdefault(id(b.param), []).append(b)
    slots = []
    for s in optimizer.shards:
        u = s.unit
        for p, shape, off, n in zip(u.params, u.shapes, u.offsets, u.numels):
            flat = Placement.of_flat_unit("dp", off, n, u.shard_numel, u.rank, u.world_size)
            for local, pos in flat_boxes(flat, shape):  # none when this rank's shard misses p
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


def hybrid_layout(parts, optimizer=None) -> RankSlots:
    """The RankSlots of a build_hybrid rank (pass parts.optimizer or make_hybrid_optimizer's result)."""
    bases = base_slots(parts)
    params = [_as_slot(b) for b in bases]
    if optimizer is not None and hasattr(optimizer, "shards"):  # ZeRO-1 over dp
        return RankSlots("hybrid", zero_composed_slots(optimizer, bases), params,
                      lambda master: optimizer.optimizer.state[master])
    state = (lambda p: optimizer.state[p]) if optimizer is not None else (lambda p: {})
    return RankSlots("hybrid", params, params, state)
