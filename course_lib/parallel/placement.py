"""Placement: how one mesh axis splits one tensor, in one small record every axis reports.

Take a tensor W of the single-process model and one mesh axis of n ranks. Rank r of the axis
holds one of three things:

    split  the indices table[r] of W along dim `dim`:   local_r = W.index_select(dim, table[r])
           Tensor parallelism: a column-parallel weight's rows, a row-parallel weight's columns,
           the fused QKV weight's rows of whole heads (three runs: Q, K, V), the vocabulary padded
           to a multiple of tp (indices >= `full`, W's length along dim, are zero padding rows).
           The tables of all ranks cover 0..full-1 exactly once: every element on one rank.
    whole  all of W, on the ranks `holders` of the axis: all n (replicated: a LayerNorm over tp,
           a dense weight over ep, every parameter over dp), one (an expert on its ep rank, a
           block on its pipeline stage) or two (the tied embedding on the first and last stage).
    flat   [start_r, stop_r) of W flattened row-major: its part of a ZeRO flat shard, a range of
           the axis's flat unit (course_lib.parallel.zero.flat); empty on ranks whose shard misses W.

A rank's tensor has one placement per axis, applied in order (outer first: a ZeRO range is a
range of the TP-local tensor). The ranks of the world holding an identical copy of one of its
elements number

    copies = prod over axes a of copies_a,     copies_a = 1 (split, flat) or len(holders) (whole),

so the global-norm clip (course_lib.parallel.clip) weights its squared norm by w = 1 / copies and
counts every element of the single-process model once. Gathering W back needs one copy of every
element: rank r is the *primary* holder when it is holders[0] on every whole axis. Every rank
writes its primary elements at their global positions into zeros and one sum over the ranks gives
W exactly, since each element is x + 0 + ... + 0 (`gather_full`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

KINDS = ("split", "whole", "flat")


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in (values.tolist() if torch.is_tensor(values) else values))


@dataclass(frozen=True)
class Placement:
    """What rank `rank` of mesh axis `axis` (n ranks) holds of one tensor (module docstring).
    Build one with `split`, `whole`, `replicated` or `flat`."""

    axis: str
    kind: str
    rank: int
    n: int
    dim: int | None = None  # split: the tensor dim that is split
    table: tuple[tuple[int, ...], ...] = ()  # split: table[r], rank r's global indices along dim
    full: int = 0  # split: W's length along dim (table entries >= full are padding)
    holders: tuple[int, ...] = ()  # whole: the ranks of the axis holding all of W
    ranges: tuple[tuple[int, int], ...] = ()  # flat: ranges[r] = [start, stop) of W.flatten() on rank r

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {KINDS}")
        if not 0 <= self.rank < self.n:
            raise ValueError(f"rank={self.rank} must be in [0, n={self.n}) on axis {self.axis!r}")
        if self.kind == "split":
            if len(self.table) != self.n or len({len(t) for t in self.table}) != 1:
                raise ValueError(f"axis {self.axis!r}: a split needs one index list per rank (n={self.n}), "
                                 f"all the same length; got lengths {[len(t) for t in self.table]}")
            real = sorted(i for t in self.table for i in t if i < self.full)
            pad = [i for t in self.table for i in t if i >= self.full]
            if real != list(range(self.full)) or len(set(pad)) != len(pad):
                raise ValueError(f"axis {self.axis!r}: the tables must hold every index 0..{self.full - 1} of dim "
                                 f"{self.dim} exactly once (plus distinct padding >= {self.full})")
        if self.kind == "whole" and (not self.holders or any(not 0 <= h < self.n for h in self.holders)
                                     or len(set(self.holders)) != len(self.holders)):
            raise ValueError(f"axis {self.axis!r}: holders={self.holders} must be distinct ranks in [0, {self.n})")
        if self.kind == "flat" and (len(self.ranges) != self.n or any(not 0 <= a <= b for a, b in self.ranges)):
            raise ValueError(f"axis {self.axis!r}: a flat placement needs one [start, stop) per rank (n={self.n})")

    # -- the four kinds of record -----------------------------------------------------------

    @classmethod
    def split(cls, axis: str, dim: int, table, rank: int, full: int) -> "Placement":
        """Rank r holds table[r] along dim (a (n, k) tensor or nested lists)."""
        table = tuple(_ints(row) for row in table)
        return cls(axis, "split", int(rank), len(table), dim=int(dim), table=table, full=int(full))

    @classmethod
    def whole(cls, axis: str, holders, rank: int, n: int) -> "Placement":
        return cls(axis, "whole", int(rank), int(n), holders=_ints(holders))

    @classmethod
    def replicated(cls, axis: str, rank: int, n: int) -> "Placement":
        return cls.whole(axis, range(n), rank, n)

    @classmethod
    def flat(cls, axis: str, ranges, rank: int) -> "Placement":
        ranges = tuple((int(a), int(b)) for a, b in ranges)
        return cls(axis, "flat", int(rank), len(ranges), ranges=ranges)

    @classmethod
    def of_flat_unit(cls, axis: str, offset: int, numel: int, shard_numel: int, rank: int, n: int) -> "Placement":
        """A tensor of `numel` elements at `offset` in a flat unit cut into n shards of S = shard_numel
        (rank r owns [r*S, (r+1)*S), course_lib.parallel.zero.flat): rank r's range of the tensor is
        [clamp(r*S - offset), clamp((r+1)*S - offset)), clamped to [0, numel]."""
        def clamp(i):
            return min(max(i, 0), numel)
        return cls.flat(axis, [(clamp(r * shard_numel - offset), clamp((r + 1) * shard_numel - offset))
                               for r in range(n)], rank)

    # -- what the consumers read ------------------------------------------------------------

    @property
    def copies(self) -> int:
        """Ranks of this axis holding an identical copy of each of this rank's elements."""
        return len(self.holders) if self.kind == "whole" else 1

    @property
    def primary(self) -> bool:
        """Whether this rank's copy is the one a gather takes (the first holder; every split/flat piece)."""
        return self.holders[0] == self.rank if self.kind == "whole" else True

    @property
    def rows(self) -> tuple[int, ...]:
        """split: this rank's global indices along dim (padding included)."""
        return self.table[self.rank]

    def global_shape(self, local_shape) -> tuple[int, ...]:
        """The tensor's shape before this axis split it (split: `full` along dim)."""
        shape = tuple(int(s) for s in local_shape)
        return shape[:self.dim] + (self.full,) + shape[self.dim + 1:] if self.kind == "split" else shape

    def local(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank `rank`'s (default this rank's) piece of the full tensor: a split's rows (zeros where
        padded), the whole tensor, or a flat range. A new tensor, except a whole's (`full` itself)."""
        r = self.rank if rank is None else rank
        if self.kind == "whole":
            return full
        if self.kind == "flat":
            a, b = self.ranges[r]
            return full.reshape(-1)[a:b].clone()
        index = torch.tensor(self.table[r], dtype=torch.long, device=full.device)
        valid = index < self.full
        shape = list(full.shape)
        shape[self.dim] = len(index)
        out = full.new_zeros(shape)
        out.index_copy_(self.dim, valid.nonzero().flatten(), full.index_select(self.dim, index[valid]))
        return out

    def scatter(self, piece: torch.Tensor, full: torch.Tensor) -> None:
        """Write rank's `piece` at its global positions in `full` (the inverse of `local`; padding dropped)."""
        if self.kind == "whole":
            full.copy_(piece)
        elif self.kind == "flat":
            a, b = self.ranges[self.rank]
            full.view(-1)[a:b] = piece.reshape(-1)
        else:
            index = torch.tensor(self.rows, dtype=torch.long, device=full.device)
            valid = index < self.full
            full.index_copy_(self.dim, index[valid], piece.index_select(self.dim, valid.nonzero().flatten()))


def parameter_names(model) -> dict[str, str]:
    """{every name of every parameter (a tied one under each of its names): its first name}, the
    name named_parameters() lists it under and the placements are keyed by."""
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def copies(placements) -> int:
    """Ranks of the world holding an identical copy of each element: the product over the axes."""
    return math.prod(p.copies for p in placements)


def weight(placements) -> float:
    """The global-norm clip's weight w = 1 / copies (course_lib.parallel.clip)."""
    return 1 / copies(placements)


def global_shape(placements, local_shape) -> tuple[int, ...]:
    """Undo the axes from the innermost out: the single-process tensor's shape (no flat axis)."""
    shape = tuple(int(s) for s in local_shape)
    for p in reversed(placements):
        if p.kind == "flat":
            raise ValueError(f"axis {p.axis!r} is flat: a flat range has no shape; pass the placements above it")
        shape = p.global_shape(shape)
    return shape


def embed(local: torch.Tensor, placements, shape) -> torch.Tensor | None:
    """This rank's piece at its global positions in a zero tensor of the global `shape`, or None when
    another rank holds the primary copy (split and whole axes, outer first)."""
    if not all(p.primary for p in placements):
        return None
    out = local
    for p in reversed(placements):  # innermost axis first: a piece of the tensor one axis further out
        outer = local.new_zeros(p.global_shape(out.shape))
        p.scatter(out, outer)
        out = outer
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"placements give the global shape {tuple(out.shape)}, expected {tuple(shape)}")
    return out


@torch.no_grad()
def gather_full(pieces, group=None, device=None) -> dict[str, torch.Tensor]:
    """{name: single-process tensor} on every rank of `group` (a collective: all must call it).

    pieces: this rank's (name, local tensor, placements) triples (split and whole axes). Ranks may
    hold different names (pipeline stages, experts): the names, global shapes and dtypes are
    exchanged first, then one all-reduce (sum) per dtype of the primary pieces put in zeros
    (module docstring), which is exact."""
    mine = {name: (global_shape(pl, t.shape), str(t.dtype).split(".")[-1]) for name, t, pl in pieces}
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    meta = {}
    for d in every:  # rank order, each rank's own order: the first holder's names first
        for name, m in d.items():
            if meta.setdefault(name, m) != m:
                raise ValueError(f"{name}: ranks disagree on its global shape/dtype: {meta[name]} vs {m}")
    device = device or (pieces[0][1].device if pieces else torch.device("cpu"))
    local = {name: (t.detach(), pl) for name, t, pl in pieces}
    out = {}
    for dtype in sorted({m[1] for m in meta.values()}):
        names = [n for n, m in meta.items() if m[1] == dtype]
        full = {n: torch.zeros(meta[n][0], dtype=getattr(torch, dtype), device=device) for n in names}
        for n in names:
            if n in local:
                e = embed(local[n][0].to(device), local[n][1], meta[n][0])
                if e is not None:
                    full[n].copy_(e)
        flat = torch.cat([full[n].reshape(-1) for n in names])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        offset = 0
        for n in names:
            out[n] = flat[offset:offset + full[n].numel()].view(meta[n][0]).clone()
            offset += full[n].numel()
    return {n: out[n] for n in meta}
