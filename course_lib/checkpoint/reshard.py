"""Resharding by global offsets: every shard is a box of a global tensor, and loading is box
intersection.

A sharded tensor is described by its *global* shape and, per rank, the boxes it holds:

    global W (6 x 8)                   box = (offsets, lengths): rows [o0, o0+l0) x cols [o1, o1+l1)
    +--------+--------+
    | rank 0 | rank 1 |   TP, column split:   rank r holds ((0, 4r), (6, 4))
    |        |        |
    +--------+--------+

Whatever the layout (replicated, ZeRO flat shards, tensor-parallel slices), a rank that wants
box B of tensor W at load time copies, from every saved box A of W that overlaps it,

    lo_d = max(A.offset_d, B.offset_d),   hi_d = min(A.offset_d + A.len_d, B.offset_d + B.len_d)

the block [lo, hi) (local indices lo - A.offset in the saved piece, lo - B.offset in its own).
Nothing about the old or the new world size enters: only global offsets. The saved boxes never
overlap (format.py drops duplicates when saving), so the wanted box is complete exactly when
the volumes of its intersections add up to its own volume.

A ZeRO flat shard [a, b) of a parameter flattened row-major is not a box in general: it is a
partial first row, whole rows, and a partial last row. `flat_range_boxes` cuts it into those
(recursively for more dims):

    shape (4, 5), flat range [3, 17):    row 0: cols [3, 5)   rows 1-2: all cols   row 3: cols [0, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Box:
    """The block offsets[d] <= i_d < offsets[d] + lengths[d] of a global tensor (0-d: one element)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def volume(self) -> int:
        return math.prod(self.lengths)

    def slices(self, origin: tuple[int, ...] | None = None) -> tuple[slice, ...]:
        """Index of this box inside a tensor whose element [0, ..., 0] sits at global `origin`."""
        origin = origin or (0,) * len(self.offsets)
        return tuple(slice(o - g, o - g + n) for o, g, n in zip(self.offsets, origin, self.lengths))

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def inside(self, shape) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape))


def whole(shape) -> Box:
    """The box of a whole tensor (a replicated one)."""
    return Box((0,) * len(shape), tuple(int(s) for s in shape))


def flat_range_boxes(shape, start: int, stop: int) -> list[tuple[Box, int]]:
    """Cut the row-major flat range [start, stop) of a tensor of `shape` into boxes.

    Returns [(box, flat position of the box's first element)]: the range's elements, box by box,
    are consecutive, so box k is the flat slice [pos_k, pos_k + box_k.volume) reshaped."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) must lie in [0, {math.prod(shape)}] for shape {shape}")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [(Box((start,) * len(shape), (stop - start,) * len(shape)), start)]
    row = math.prod(shape[1:])  # elements per index of dim 0
    out = []
    first_full, last_full = -(-start // row), stop // row  # whole rows [first_full, last_full)
    if first_full > last_full:  # the range lies inside one row
        r = start // row
        return [(Box((r,) + b.offsets, (1,) + b.lengths), r * row + p)
                for b, p in flat_range_boxes(shape[1:], start - r * row, stop - r * row)]
    if start < first_full * row:  # partial first row
        r = start // row
        out += [(Box((r,) + b.offsets, (1,) + b.lengths), r * row + p)
                for b, p in flat_range_boxes(shape[1:], start - r * row, row)]
    if last_full > first_full:
        out.append((Box((first_full,) + (0,) * (len(shape) - 1), (last_full - first_full,) + shape[1:]),
                    first_full * row))
    if stop > last_full * row:  # partial last row
        out += [(Box((last_full,) + b.offsets, (1,) + b.lengths), last_full * row + p)
                for b, p in flat_range_boxes(shape[1:], 0, stop - last_full * row)]
    return out


def index_runs(indices, size: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive global indices < size in a rank's index table (tensor parallelism's
    rows/cols): [(global start, local start, length)]. Indices >= size are padding and dropped."""
    runs, idx = [], [int(i) for i in indices]
    for local, g in enumerate(idx):
        if g >= size:
            continue
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == local:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, local, 1))
    return runs


def copy_overlaps(dst: torch.Tensor, dst_box: Box, saved) -> int:
    """Copy into `dst` (the local tensor of dst_box) every overlap with the saved pieces
    [(box, tensor)]; returns the number of elements written (the coverage)."""
    written = 0
    for box, src in saved:
        common = dst_box.intersect(box)
        if common is None:
            continue
        dst[common.slices(dst_box.offsets)] = src[common.slices(box.offsets)].to(dst.dtype)
        written += common.volume
    return written
