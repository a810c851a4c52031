"""The records that describe what a rank holds for the checkpoint (see layouts.py): a Slot (this
rank's tensor holds a box of a global parameter), a Piece (a key, its global shape, the box and
this rank's view, as format.py saves and loads it) and a RankSlots (the slots to save, the slots to
load, and where the optimizer keeps each local tensor's state). layouts.py and hybrid.py both
build them; they sit here, below both, with the two readings of an axis's Placement
(course_lib.parallel.placement) that both need: a split's boxes (`placed_boxes`) and a flat
range's boxes (`flat_boxes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from course_lib.checkpoint.reshard import Box, flat_range_boxes, index_runs, whole
from course_lib.parallel.placement import Placement, global_shape


@dataclass
class Slot:
    name: str  # the single-process parameter name
    shape: tuple  # its global shape
    box: Box
    local: torch.Tensor  # the rank's tensor that holds the box (a parameter, a flat master shard)
    select: Callable[[torch.Tensor], torch.Tensor]  # local-shaped tensor -> the box's view


@dataclass
class Piece:
    key: str
    shape: tuple  # global shape
    box: Box
    tensor: torch.Tensor  # this rank's view of the box (written into on load)


@dataclass
class RankSlots:
    """What one rank saves and loads (`kind`: one of layouts.LAYOUTS): the slots it saves, the
    slots it loads into (they differ under ZeRO stages 0-2: the rank saves its flat shard of the
    masters and loads whole parameters), and where its optimizer keeps each local tensor's state."""

    kind: str
    save_slots: list[Slot]
    load_slots: list[Slot]
    state_of: Callable[[torch.Tensor], dict]  # local tensor -> the optimizer's state dict for it


def placed_boxes(placements, local_shape) -> tuple[tuple, list[tuple[Box, Box]]]:
    """(global shape, [(global box, the same elements' box in the local tensor)]) of a tensor held
    as `placements` (split and whole axes). A split axis gives one box per run of consecutive
    indices of its table along its dim (qkv: three runs; padding rows dropped); a whole axis adds
    nothing: its identical copies give identical boxes, saved once (format.py)."""
    shape, local_shape = global_shape(placements, local_shape), tuple(int(s) for s in local_shape)
    splits = [p for p in placements if p.kind == "split"]
    if not splits:
        return shape, [(whole(shape), whole(local_shape))]
    if len(splits) > 1:
        raise ValueError(f"axes {[p.axis for p in splits]} all split this tensor: boxes for one split only")
    p = splits[0]
    out = []
    for g, local, n in index_runs(p.rows, p.full):
        lengths = tuple(n if d == p.dim else s for d, s in enumerate(local_shape))
        out.append((Box(tuple(g if d == p.dim else 0 for d in range(len(shape))), lengths),
                    Box(tuple(local if d == p.dim else 0 for d in range(len(shape))), lengths)))
    return shape, out


def flat_boxes(placement: Placement, local_shape) -> list[tuple[Box, int]]:
    """A flat placement's range of the (local) tensor on this rank as boxes of that tensor, each with
    the flat position of its first element (reshard.flat_range_boxes)."""
    if placement.kind != "flat":
        raise ValueError(f"axis {placement.axis!r} is {placement.kind!r}, not flat")
    start, stop = placement.ranges[placement.rank]
    return flat_range_boxes(local_shape, start, stop)
