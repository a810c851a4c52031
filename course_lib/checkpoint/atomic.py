"""Atomic checkpoints: write into a temporary directory, rename it into place when complete.

    root/
      step_00000020/            complete: metadata.json is written last, then the rename
      step_00000030/
      .step_00000040.partial/   a save in progress, or one killed half-way: never loaded

A directory rename is atomic on POSIX file systems (rename(2)): a reader sees either no
step_00000040 or the whole of it, never a half-written one. The metadata file goes in last,
after every rank has written its shard, so even a directory copied by hand without its
metadata is recognised as incomplete. What can still go wrong after the rename (a disk that
truncates a file, a shard deleted by a cleanup script, a metadata file from another run) is
caught when loading (format.py: sizes and SHA-256 of every file are in the metadata).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil

METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_path(root, step: int) -> pathlib.Path:
    """root/step_XXXXXXXX: where the checkpoint taken after `step` optimizer steps lives."""
    return pathlib.Path(root) / f"step_{int(step):08d}"


def staging_path(final) -> pathlib.Path:
    final = pathlib.Path(final)
    return final.parent / f".{final.name}.partial"


def prepare_staging(final) -> pathlib.Path:
    """(one process) An empty staging directory for `final`, removing a stale one a killed save left."""
    staging = staging_path(final)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: pathlib.Path, data: bytes) -> None:
    """Write and fsync: after the rename, the bytes are on disk, not only in the page cache."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit(staging, final) -> pathlib.Path:
    """(one process, after every shard and the metadata are in `staging`) Rename it to `final`.
    An existing `final` (the same step saved again after a restart) is replaced."""
    staging, final = pathlib.Path(staging), pathlib.Path(final)
    if not (staging / METADATA).exists():
        raise RuntimeError(f"refusing to commit {staging}: it has no {METADATA} (the save is not complete)")
    _fsync_dir(staging)
    if final.exists():
        old = final.parent / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)
    return final


def complete_checkpoints(root) -> list[tuple[int, pathlib.Path]]:
    """[(step, path)] of the complete checkpoints under root (renamed into place, metadata
    present), oldest first. Partial directories are ignored."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / METADATA).exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root) -> pathlib.Path | None:
    """The newest complete checkpoint under root, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def prune(root, keep: int) -> list[pathlib.Path]:
    """(one process) Delete all but the newest `keep` complete checkpoints; returns what was removed."""
    found = complete_checkpoints(root)
    removed = [p for _, p in found[:-keep]] if keep > 0 else []
    for p in removed:
        shutil.rmtree(p)
    return removed
