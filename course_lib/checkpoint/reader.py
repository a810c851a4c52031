"""Reading the course's sharded format (format.py) at any layout, with every corruption named.

    reader = CheckpointReader(path)       metadata read, every listed file present with its size
    reader.fill(pieces)                   each wanted box filled from the saved boxes it overlaps
    reader.object("step")                 a replicated object; reader.object("rank1/rng") a rank's

What is checked, and the error (CheckpointError, naming the file):

    no such directory / no metadata.json      incomplete checkpoint (a save never finished)
    metadata.json not JSON / wrong format      corrupted metadata
    a listed shard file missing                missing shard
    a shard smaller/larger than recorded       truncated (or overwritten) file
    a shard whose SHA-256 differs              corrupted file (a flipped bit, another run's file)
    a piece whose shape/dtype differs from     metadata does not match the file
      what the metadata says
    a wanted tensor not in the checkpoint, or  the checkpoint does not match the model
      of another global shape, or not covered

Loads use torch.load(weights_only=True): a checkpoint is data, and unpickling arbitrary
objects from a file would run code from it.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib

import torch

from course_lib.checkpoint.atomic import METADATA, staging_path
from course_lib.checkpoint.format import FORMAT, CheckpointError, _dtype_name
from course_lib.checkpoint.reshard import Box, copy_overlaps
from course_lib.checkpoint.slots import Piece


class CheckpointReader:
    def __init__(self, path, verify_hashes: bool = True):
        self.path = pathlib.Path(path)
        self.verify_hashes = verify_hashes
        meta_path = self.path / METADATA
        if not self.path.is_dir():
            hint = " (a save was interrupted: only its .partial staging directory exists)" \
                if staging_path(self.path).exists() else ""
            raise CheckpointError(f"incomplete checkpoint: directory {self.path} does not exist{hint}")
        if not meta_path.exists():
            raise CheckpointError(f"incomplete checkpoint: {meta_path} is missing (it is written last, "
                                  f"so the save never finished)")
        try:
            self.meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"corrupted metadata: {meta_path} is not valid JSON ({e})") from e
        if not isinstance(self.meta, dict) or self.meta.get("format") != FORMAT:
            raise CheckpointError(f"corrupted metadata: {meta_path} is not a {FORMAT} checkpoint")
        for name, info in self.meta["files"].items():
            f = self.path / name
            if not f.exists():
                raise CheckpointError(f"missing shard: {f} is listed in {meta_path} but does not exist")
            size = f.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"truncated file: {f} has {size} bytes, {meta_path} records {info['bytes']}")
        self._files: dict[str, dict] = {}
        self.bytes_read = 0

    @property
    def world_size(self) -> int:
        return self.meta["world_size"]

    @property
    def extra(self) -> dict:
        return self.meta.get("extra", {})

    @property
    def tensors(self) -> dict:
        return self.meta["tensors"]

    def _load(self, name: str) -> dict:
        if name in self._files:
            return self._files[name]
        f = self.path / name
        data = f.read_bytes()
        self.bytes_read += len(data)
        info = self.meta["files"][name]
        if len(data) != info["bytes"]:
            raise CheckpointError(f"truncated file: {f} has {len(data)} bytes, metadata records {info['bytes']}")
        if self.verify_hashes and hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(f"corrupted file: the SHA-256 of {f} differs from the one in {self.path / METADATA}")
        try:
            payload = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a corrupted file
            raise CheckpointError(f"corrupted file: {f} cannot be loaded ({type(e).__name__}: {e})") from e
        self._files[name] = payload
        return payload

    def _saved_piece(self, key: str, meta: dict, p: dict) -> tuple[Box, torch.Tensor]:
        payload = self._load(p["file"])
        where = self.path / p["file"]
        if p["index"] >= len(payload["pieces"]):
            raise CheckpointError(f"metadata mismatch: {where} has {len(payload['pieces'])} pieces, "
                                  f"metadata says piece {p['index']} of it is {key}")
        t = payload["pieces"][p["index"]]
        if list(t.shape) != p["lengths"] or _dtype_name(t.dtype) != meta["dtype"]:
            raise CheckpointError(f"metadata mismatch: piece {p['index']} of {where} is {tuple(t.shape)} "
                                  f"{_dtype_name(t.dtype)}, metadata says {key} box {p['lengths']} {meta['dtype']}")
        return Box(tuple(p["offsets"]), tuple(p["lengths"])), t

    def fill(self, pieces: list[Piece]) -> None:
        """Copy into every piece's tensor its box of the saved global tensor (any saved layout)."""
        for piece in pieces:
            meta = self.tensors.get(piece.key)
            if meta is None:
                raise CheckpointError(f"{piece.key} is not in the checkpoint {self.path / METADATA}: "
                                      f"it was saved from another model or optimizer")
            if meta["shape"] != list(piece.shape):
                raise CheckpointError(f"metadata mismatch: {self.path / METADATA} says {piece.key} has global "
                                      f"shape {tuple(meta['shape'])}, the model being loaded has {tuple(piece.shape)}")
            overlapping = [p for p in meta["pieces"]
                           if piece.box.intersect(Box(tuple(p["offsets"]), tuple(p["lengths"]))) is not None]
            with torch.no_grad():
                written = copy_overlaps(piece.tensor, piece.box, [self._saved_piece(piece.key, meta, p)
                                                                  for p in overlapping])
            if written != piece.box.volume:
                raise CheckpointError(f"metadata mismatch: the saved pieces of {piece.key} in {self.path / METADATA} "
                                      f"cover {written} of the {piece.box.volume} elements of box {piece.box}")

    def object(self, key: str):
        name = self.meta["objects"].get(key)
        if name is None:
            raise CheckpointError(f"object {key!r} is not in the checkpoint {self.path / METADATA}")
        objects = self._load(name)["objects"]
        if key not in objects:
            raise CheckpointError(f"metadata mismatch: {self.path / name} has no object {key!r}")
        return objects[key]

    def has_object(self, key: str) -> bool:
        return key in self.meta["objects"]
