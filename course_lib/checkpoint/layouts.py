"""What each rank holds, described as boxes of global tensors: the bridge from a parallel layout to
the checkpoint.

A *slot* says: this rank's tensor `local` holds box `box` of the global parameter `name` (global
shape `shape`), at `select(local)`. The optimizer's per-element state (Adam's exp_avg and
exp_avg_sq) has the local tensor's shape, so the same `select` finds its box in the state too;
scalar state (Adam's step) is replicated. From the slots come the pieces a rank saves and loads:

    model.<name>              the parameter                  box of the slot
    optim.<name>.<state>      exp_avg, exp_avg_sq, ...       box of the slot
    optim.<name>.step         a 0-d tensor                   the whole (empty) box

The keys are the single-process model's parameter names, so a checkpoint written by one layout
loads into any other: replicated -> ZeRO, ZeRO at 4 ranks -> ZeRO at 2, tensor parallel ->
one process. Layouts described here:

    replicated   every rank holds every parameter whole (one process, data parallel)
    zero         course_lib.parallel.zero: rank r owns [r*S, (r+1)*S) of each flat unit; a
                 parameter's part of that range (its flat Placement) is cut into boxes
                 (reshard.flat_range_boxes).
                 Stages 0-2 also hold the whole parameters: they save only their flat shard
                 (each element once, every rank writes 1/N) but load the whole parameters.
    tp           course_lib.parallel.tp: each split parameter's rows/cols on this rank come
                 from its layer's Placement (course_lib.parallel.placement); runs of consecutive
                 indices are boxes (qkv: three runs, its Q, K and V heads; padded vocabulary
                 rows are dropped)
    hybrid       course_lib.parallel.hybrid (dp x tp x pp, ZeRO-1 or not): hybrid.py composes
                 the two above: a flat range of TP-local tensors, mapped through the TP boxes
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.checkpoint.hybrid import hybrid_layout
from course_lib.checkpoint.reshard import whole
from course_lib.checkpoint.slots import RankSlots, Piece, Slot, flat_boxes, placed_boxes
from course_lib.parallel.placement import Placement
from course_lib.parallel.tp.apply import tp_placements

LAYOUTS = ("replicated", "zero", "tp", "hybrid")


def _full(t):
    return t


def _named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())  # a tied weight appears once, under its first name


def replicated_slots(model: nn.Module) -> list[Slot]:
    return [Slot(n, tuple(p.shape), whole(p.shape), p, _full) for n, p in _named(model)]


def zero_slots(model: nn.Module, optimizer) -> list[Slot]:
    """Boxes of each parameter inside this rank's flat shard [start, stop) of each unit."""
    names = {id(p): n for n, p in _named(model)}
    slots = []
    for s in optimizer.shards:
        u = s.unit
        unit_names = getattr(s, "names", None) or [names[id(p)] for p in u.params]
        for name, shape, off, n in zip(unit_names, u.shapes, u.offsets, u.numels):
            placement = Placement.of_flat_unit("dp", off, n, u.shard_numel, u.rank, u.world_size)
            for box, pos in flat_boxes(placement, shape):  # none when this rank's shard misses it
                lo = off + pos - u.start  # where the box starts inside the shard

                def select(t, lo=lo, box=box):
                    return t[lo:lo + box.volume].view(box.lengths)
                slots.append(Slot(name, tuple(shape), box, s.master, select))
    return slots


def tp_slots(model: nn.Module) -> list[Slot]:
    """Every parameter's boxes from its Placement over tp: a split one's runs of rows/cols, the others whole."""
    if getattr(model, "tensor_parallel", None) is None:
        raise ValueError("layout='tp' needs a model after course_lib.parallel.tp.apply_tensor_parallel")
    placed, slots = tp_placements(model), []
    for name, p in _named(model):
        shape, boxes = placed_boxes((placed[name],), p.shape)
        for box, local_box in boxes:
            slots.append(Slot(name, shape, box, p, lambda t, lb=local_box: t[lb.slices()]))
    return slots


def describe_layout(model: nn.Module, optimizer=None, kind: str = "replicated") -> RankSlots:
    """The RankSlots of (model, optimizer) on this rank. kind: one of LAYOUTS ("hybrid": pass the
    HybridParts of course_lib.parallel.hybrid.build_hybrid as `model`; see hybrid.py)."""
    if kind not in LAYOUTS:
        raise ValueError(f"kind={kind!r} must be one of {LAYOUTS}")
    if kind == "hybrid":  # `model` is course_lib.parallel.hybrid's HybridParts
        return hybrid_layout(model, optimizer)
    plain_state = (lambda p: optimizer.state[p]) if optimizer is not None else (lambda p: {})
    if kind == "replicated":
        slots = replicated_slots(model)
        return RankSlots(kind, slots, slots, plain_state)
    if kind == "tp":
        slots = tp_slots(model)
        return RankSlots(kind, slots, slots, plain_state)
    if optimizer is None or not hasattr(optimizer, "shards"):
        raise ValueError("kind='zero' needs the optimizer returned by course_lib.parallel.zero")
    slots = zero_slots(model, optimizer)
    load = slots if optimizer.stage == 3 else replicated_slots(model)  # stages 0-2 hold whole params
    return RankSlots(kind, slots, load, lambda master: optimizer.optimizer.state[master])


def model_pieces(slots: list[Slot]) -> list[Piece]:
    return [Piece(f"model.{s.name}", s.shape, s.box, s.select(s.local)) for s in slots]


def state_pieces(layout: RankSlots, slots: list[Slot] | None = None) -> list[Piece]:
    """optim.<name>.<k> pieces: per-element state shaped like the slot's local tensor takes the
    slot's box; a 0-d state (Adam's step) is one replicated element."""
    out, seen = [], set()
    for s in layout.save_slots if slots is None else slots:
        for k, v in layout.state_of(s.local).items():
            if not torch.is_tensor(v):
                raise ValueError(f"optimizer state {s.name}.{k}={v!r} is not a tensor: not supported")
            key = f"optim.{s.name}.{k}"
            if v.dim() == 0:
                if key not in seen:
                    seen.add(key)
                    out.append(Piece(key, (), whole(()), v))
            elif v.shape == s.local.shape:
                out.append(Piece(key, s.shape, s.box, s.select(v)))
            else:
                raise ValueError(f"optimizer state {key} of shape {tuple(v.shape)} is neither per-element "
                                 f"{tuple(s.local.shape)} nor a scalar: not supported")
    return out


def materialize_state(layout: RankSlots, tensor_meta: dict) -> None:
    """Create the optimizer state a checkpoint holds (zeros; the load then fills it), so a fresh
    optimizer can be loaded before its first step. tensor_meta: the checkpoint's {key: {shape, dtype}}."""
    for s in layout.save_slots:  # the state lives where the saved (owned) slots live
        state = layout.state_of(s.local)
        prefix = f"optim.{s.name}."
        for key, meta in tensor_meta.items():
            name = key[len(prefix):]
            if not key.startswith(prefix) or name in state:
                continue
            dtype = getattr(torch, meta["dtype"].split(".")[-1])
            state[name] = torch.zeros((), dtype=dtype) if meta["shape"] == [] else torch.zeros_like(s.local, dtype=dtype)
