"""The same pieces through torch.distributed.checkpoint (DCP) as the storage layer.

DCP is PyTorch's production sharded checkpoint: every rank writes its chunks (`__<rank>_0.distcp`)
and the coordinator a `.metadata` file mapping each tensor's global shape to the chunks'
offsets and sizes — the course's format.py written by hand is the same idea. DCP reshards on
load the same way too: a rank asks for chunks of a global tensor and DCP reads the saved
chunks that overlap them.

Our boxes become DCP values as follows:

    a tensor every holder has whole     a plain tensor (DCP treats it as replicated and
                                        writes it once)
    a tensor held in boxes              a ShardedTensor whose local shards are this rank's
                                        boxes, with their global offsets (ShardMetadata)

Why ShardedTensor and not DTensor: a DTensor's placements shard whole dimensions evenly, but a
ZeRO flat shard cut into rectangles, or tensor parallelism's qkv rows (three separate runs:
its Q, K and V heads) are arbitrary boxes, which ShardedTensor states directly. PyTorch marks
ShardedTensor deprecated in favour of DTensor; DCP still reads and writes it, and we silence
only that warning. Limitation: the boxes of a sharded tensor must not overlap between ranks
(true for ZeRO and for pure tensor parallelism; a 2-D layout where two ranks hold the same
slice would pass it once, as format.py does when saving).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from course_lib.checkpoint.format import _all_gather_object, _world
from course_lib.checkpoint.layouts import Piece
from course_lib.checkpoint.reshard import whole


@contextlib.contextmanager
def _quiet_sharded_tensor():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*DTensor instead.*")
        yield


def _dedupe(pieces: list[Piece]) -> list[Piece]:
    seen, out = set(), []
    for p in pieces:
        if (p.key, p.box) not in seen:
            seen.add((p.key, p.box))
            out.append(p)
    return out


def to_dcp_state(pieces: list[Piece], group=None, drop_replicas: bool = True) -> dict:
    """Collective: {key: plain tensor | ShardedTensor} for dcp.save / dcp.load. Keys are decided
    together (every rank builds the same ShardedTensors in the same order). drop_replicas
    (saving): a box a lower rank holds too is left to that rank."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank, _ = _world(group)
    pieces = _dedupe(pieces)
    descs = {}
    for p in pieces:  # whole only if every box this rank holds of the key is the whole tensor
        descs[p.key] = (tuple(p.shape), descs.get(p.key, (None, True))[1] and p.box == whole(p.shape))
    everyone = _all_gather_object(descs, group)
    sharded = sorted({k for d in everyone for k, (_, is_whole) in d.items() if not is_whole})
    held_before = set()
    if drop_replicas:
        boxes = _all_gather_object([(p.key, p.box) for p in pieces], group)
        held_before = {b for r in range(rank) for b in boxes[r]}
    state = {}
    with _quiet_sharded_tensor():
        for key in sharded:  # the same order on every rank: init_from_local_shards is collective
            mine = [p for p in pieces if p.key == key and (p.key, p.box) not in held_before]
            shape = next(d[key][0] for d in everyone if key in d)
            local = [Shard(p.tensor.contiguous() if not p.tensor.is_contiguous() else p.tensor,
                           ShardMetadata(list(p.box.offsets), list(p.box.lengths), f"rank:{rank}/{p.tensor.device}"))
                     for p in mine]
            state[key] = init_from_local_shards(local, list(shape), process_group=group)
    for p in pieces:
        if p.key not in state:
            state[p.key] = p.tensor
    return state


def save_with_dcp(path, pieces: list[Piece], objects: dict | None = None, group=None) -> None:
    """Collective: dcp.save of the pieces (+ replicated tensor/number objects) into directory path."""
    import torch.distributed.checkpoint as dcp

    state = to_dcp_state(pieces, group)
    state.update(objects or {})
    with _quiet_sharded_tensor():
        dcp.save(state, checkpoint_id=str(path), process_group=group)


def load_with_dcp(path, pieces: list[Piece], objects: dict | None = None, group=None) -> dict:
    """Collective: fill the pieces from a DCP checkpoint saved at any layout; returns the objects
    (pass templates: {"step": 0}). Non-contiguous views are loaded into a copy, then copied back."""
    import torch.distributed.checkpoint as dcp

    pieces = _dedupe(pieces)
    staged = [Piece(p.key, p.shape, p.box, p.tensor if p.tensor.is_contiguous() else p.tensor.contiguous())
              for p in pieces]
    state = to_dcp_state(staged, group, drop_replicas=False)
    state.update(objects or {})
    with _quiet_sharded_tensor():
        dcp.load(state, checkpoint_id=str(path), process_group=group)
    with torch.no_grad():
        for p, s in zip(pieces, staged):
            if s.tensor is not p.tensor:
                p.tensor.copy_(s.tensor)
    return {k: state[k] for k in (objects or {})}
