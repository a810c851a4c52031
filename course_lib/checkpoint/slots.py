"""The records that describe what a rank holds for the checkpoint (see layouts.py): a Slot (this
rank's tensor holds a box of a global parameter), a Piece (a key, its global shape, the box and
this rank's view, as format.py saves and loads it) and a Layout (the slots to save, the slots to
load, and where the optimizer keeps each local tensor's state). layouts.py and hybrid.py both
build them; they sit here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from course_lib.checkpoint.reshard import Box


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
class Layout:
    kind: str
    save_slots: list[Slot]
    load_slots: list[Slot]
    state_of: Callable[[torch.Tensor], dict]  # local tensor -> the optimizer's state dict for it
