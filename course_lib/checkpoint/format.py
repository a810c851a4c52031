"""The course's own sharded checkpoint format, written by hand: one file per rank plus metadata.

    step_00000020/
      rank00000.pt      this rank's pieces (tensors) and objects (its RNG states, ...)
      rank00001.pt
      metadata.json     written last, by rank 0:
        "tensors": {"model.blocks.0.attn.qkv.weight": {"shape": [192, 64], "dtype": "float32",
                     "pieces": [{"file": "rank00001.pt", "index": 3,
                                 "offsets": [64, 0], "lengths": [32, 64]}, ...]}, ...}
        "objects": {"step": "rank00000.pt", "rank1/rng": "rank00001.pt", ...}
        "files":   {"rank00000.pt": {"bytes": 81233, "sha256": "9f2c..."}, ...}

Saving (every rank, `save_sharded`): the ranks exchange the boxes they hold; a box another rank
(of lower number) already holds is dropped, so each element is written once (a replicated
parameter by rank 0 only); the kept boxes of a tensor must tile it exactly. Each rank copies its
pieces to host memory (`stage`), writes its file (`write_staged`: serialised, hashed and fsync'd
in one pass), and rank 0 writes the metadata with every file's size and SHA-256 and renames the
directory into place (`finish`, atomic.py). Two exchanges and one barrier per save: the staging
directory is made before the first exchange, which is all the waiting it needs.

Loading (`CheckpointReader`, no collectives: any world size, even one process) reads the
metadata, checks that every file exists with its recorded size, and fills each wanted box from
the saved boxes it overlaps (reshard.py), reading only the files it needs, each checked against
its SHA-256 and loaded with torch.load(weights_only=True) (tensors and plain containers only,
never arbitrary pickled code). Anything wrong raises CheckpointError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.checkpoint.atomic import METADATA, commit, prepare_staging, staging_path, write_file_durably
from course_lib.checkpoint.reshard import Box
from course_lib.checkpoint.slots import Piece

FORMAT = "course_lib.checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or does not match what is being loaded."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _world(group):
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_gather_object(obj, group):
    rank, world = _world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class StagedSave:
    """One rank's save after the (blocking) exchange of boxes and copy to host memory."""

    final: pathlib.Path
    rank: int
    world_size: int
    payload: dict  # what this rank's file holds: {"pieces": [...], "objects": {...}}
    tensors: dict  # metadata "tensors" (identical on every rank)
    objects: dict  # metadata "objects"
    extra: dict = field(default_factory=dict)
    file_info: dict | None = None  # {"bytes", "sha256"} once written


def _plan(all_descs, world):
    """Which rank writes which of its pieces: the first (lowest) rank holding a box keeps it.
    Checks that the kept boxes of every tensor agree on shape/dtype and tile it exactly."""
    tensors, keep = {}, [[] for _ in range(world)]
    for r, descs in enumerate(all_descs):
        for i, (key, shape, dtype, offsets, lengths) in enumerate(descs):
            meta = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "pieces": []})
            if meta["shape"] != list(shape) or meta["dtype"] != dtype:
                raise ValueError(f"ranks disagree about {key}: shape {meta['shape']} / {meta['dtype']} vs "
                                 f"{list(shape)} / {dtype} on rank {r}")
            box = Box(tuple(offsets), tuple(lengths))
            if not box.inside(shape):
                raise ValueError(f"rank {r}'s box {box} of {key} lies outside its global shape {tuple(shape)}")
            saved = [Box(tuple(p["offsets"]), tuple(p["lengths"])) for p in meta["pieces"]]
            if box in saved:
                continue  # replicated: a lower rank writes it
            if any(box.intersect(b) for b in saved):
                raise ValueError(f"rank {r}'s box {box} of {key} partly overlaps a box another rank saves: "
                                 f"shards must be disjoint or identical")
            meta["pieces"].append({"file": rank_file(r), "index": len(keep[r]),
                                   "offsets": list(offsets), "lengths": list(lengths)})
            keep[r].append(i)
    for key, meta in tensors.items():
        total, covered = torch.Size(meta["shape"]).numel(), sum(
            Box(tuple(p["offsets"]), tuple(p["lengths"])).volume for p in meta["pieces"])
        if covered != total:
            raise ValueError(f"the ranks' boxes of {key} cover {covered} of its {total} elements: "
                             f"every element must be held by some rank")
    return tensors, keep


def stage(final, pieces: list[Piece], objects: dict | None = None, rank_objects: dict | None = None,
          group=None, extra: dict | None = None) -> StagedSave:
    """Collective. Rank 0 makes an empty staging directory (removing one a killed save left); the
    ranks exchange box descriptions, decide who writes what, and copy their share to host memory
    (training may change the tensors as soon as this returns).
    objects: replicated values written once (rank 0); rank_objects: this rank's own values,
    stored as 'rank<r>/<key>'. Values: tensors, numbers, strings, lists/tuples/dicts of them."""
    rank, world = _world(group)
    if rank == 0:  # done before rank 0 joins the exchange below: once it returns, every rank may write there
        prepare_staging(final)
    unique, seen = [], set()
    for p in pieces:
        ident = (p.key, p.box)
        if ident not in seen:  # a rank may list a replicated scalar more than once
            seen.add(ident)
            unique.append(p)
    descs = [(p.key, tuple(p.shape), _dtype_name(p.tensor.dtype), p.box.offsets, p.box.lengths) for p in unique]
    # one exchange: every rank's object names and box descriptions
    every = _all_gather_object((sorted(rank_objects or {}), sorted(objects or {}), descs), group)
    tensors, keep = _plan([d for _, _, d in every], world)
    meta_objects = {k: rank_file(0) for k in every[0][1]}
    for r, (names, _, _) in enumerate(every):
        meta_objects.update({f"rank{r}/{k}": rank_file(r) for k in names})
    own = {f"rank{rank}/{k}": v for k, v in (rank_objects or {}).items()}
    if rank == 0:
        own.update(objects or {})
    host = [unique[i].tensor.detach().to("cpu", copy=True) for i in keep[rank]]
    payload = {"format": FORMAT, "rank": rank, "pieces": host, "objects": own}
    return StagedSave(pathlib.Path(final), rank, world, payload, tensors, meta_objects, dict(extra or {}))


class _HashingWriter:
    """A file object's write(), counting and hashing (SHA-256) the bytes on their way to the file:
    torch.save streams into it, so the file is serialised, hashed and written in one pass with no
    copy of it in memory (a BytesIO and its getvalue() were two whole copies)."""

    def __init__(self, f):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_staged(staged: StagedSave) -> dict:
    """Not collective (may run in a background thread): serialise and write this rank's file into
    the staging directory (fsync'd: durable before the commit); returns {"bytes", "sha256"}."""
    with open(staging_path(staged.final) / rank_file(staged.rank), "wb") as f:
        out = _HashingWriter(f)
        torch.save(staged.payload, out)  # the same bytes torch.save writes into a BytesIO
        f.flush()
        os.fsync(f.fileno())
    staged.file_info = {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}
    return staged.file_info


def finish(staged: StagedSave, group=None) -> pathlib.Path:
    """Collective. Rank 0 writes metadata.json (every file's size and hash) and renames the
    staging directory into place; every rank returns once the checkpoint is complete."""
    infos = _all_gather_object(staged.file_info, group)
    failed = [r for r, i in enumerate(infos) if i is None]
    if failed:  # every rank raises, none waits in the barrier below
        raise CheckpointError(f"{staging_path(staged.final)}: rank(s) {failed} did not write their file; not committing")
    if staged.rank == 0:
        meta = {"format": FORMAT, "world_size": staged.world_size, "extra": staged.extra,
                "tensors": staged.tensors, "objects": staged.objects,
                "files": {rank_file(r): info for r, info in enumerate(infos)}}
        # compact JSON: json's C encoder (with indent= it falls back to pure Python, ~40 ms at d_model 256)
        write_file_durably(staging_path(staged.final) / METADATA, json.dumps(meta, separators=(",", ":")).encode())
        commit(staging_path(staged.final), staged.final)
    if staged.world_size > 1:
        dist.barrier(group=group)
    return staged.final


def save_sharded(final, pieces, objects=None, rank_objects=None, group=None, extra=None) -> pathlib.Path:
    """Collective: stage, write, finish. Returns the checkpoint directory."""
    staged = stage(final, pieces, objects, rank_objects, group, extra)
    write_staged(staged)
    return finish(staged, group)
