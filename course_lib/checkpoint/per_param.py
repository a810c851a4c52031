"""Per-parameter stage 3 (FSDP2's design) saved with DCP at N ranks and loaded at any M.

The rule. Of a parameter W with d0 rows, rank j of a shard group of S holds the real rows

    [j*c, j*c + r_j),    c = ceil(d0 / S),    r_j = min(c, max(0, d0 - j*c))

(course_lib.parallel.zero.per_param; its placement record's table says the same, and the c - r_j
padding rows are zeros that are never saved). These are torch.chunk's pieces, the ones DTensor's
Shard(0) describes, so each local shard's real rows become a DTensor(Shard(0)) of W's full shape
and DCP writes chunk j at offset (j*c, 0, ...). Loading at S' ranks, rank j' asks for its rows
[j'*c', j'*c' + r'_j') and DCP reads every saved chunk i that overlaps them,

    i*c < j'*c' + r'_j'   and   j'*c' < i*c + r_i          (the box intersection of reshard.py),

so N -> M resharding is DCP's own. AdamW's exp_avg and exp_avg_sq are shaped like the local shard
and travel the same way; its scalar step, and every tensor a unit replicates (the norms under a
Linear/Embedding policy), are plain tensors that DCP writes once. A parameter sharded when saved
may be replicated when loaded and the other way round: a plain tensor asks for all rows. With HSDP
the mesh is R x S and the placements (Replicate(), Shard(0)): the R copies of a chunk are written
once. Keys: "model.<name>", "optim.<name>.<state key>", "train.step", "train.generator" (the data
position: the generator every rank draws the global batch with).

    save_per_param(path, model, optimizer, step, generator=None)        collective
    step = load_per_param(path, model, optimizer, generator=None)       collective, any world size
    check_per_param_checkpoint(path, shapes)      pure: the directory, the names and the shapes
    full_optimizer_state(model, optimizer)        collective: {name: {key: full tensor}}, for checks

Why DTensor here and ShardedTensor in dcp.py: dim-0 chunks are exactly what DTensor states (FSDP2's
own state dict is this), while dcp.py's boxes (a flat ZeRO range, QKV's three row runs) are not.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from course_lib.parallel.placement import gather_full
from course_lib.parallel.zero.hsdp import mesh_lists
from course_lib.runtime.device import rank_device


def held_rows(placement, d0: int) -> tuple[int, int]:
    """(offset, rows) of W's real rows on this rank, from its placement record (table, full); checked
    against torch.chunk's rule (module docstring), which DTensor's Shard(0) assumes."""
    start = placement.table[placement.rank][0]
    rows = sum(1 for i in placement.table[placement.rank] if i < placement.full)
    c = -(-d0 // placement.n)
    if start != placement.rank * c or rows != min(c, max(0, d0 - start)):
        raise RuntimeError(f"rows [{start}, {start + rows}) of {d0} on rank {placement.rank} of {placement.n} are "
                           f"not torch.chunk's piece: DTensor's Shard(0) cannot describe them")
    return start, rows


def dcp_mesh(sharded):
    """(DeviceMesh, placements) the local shards are described on: the shard group (Shard(0)), or
    HSDP's R x S mesh (Replicate(), Shard(0)), shard dim innermost as hsdp.py lays it out."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    dev = rank_device().type
    mesh = sharded.mesh
    if mesh.replicas == 1:
        return DeviceMesh.from_group(sharded.shard_group or dist.group.WORLD, dev), (Shard(0),)
    layout = mesh_lists(mesh.world, mesh.replicas)["shard"]  # (R, S): row i = replica i's shard group
    return (DeviceMesh.from_group([mesh.replicate_group, sharded.shard_group], dev, mesh=layout,
                                  mesh_dim_names=("replicate", "shard")), (Replicate(), Shard(0)))


def _sharded(model):
    pp = getattr(model, "per_param", None)
    if pp is None:
        raise ValueError("save_per_param / load_per_param take a model from apply_zero(..., 3, sharding='per_param'); "
                         "this one has no .per_param (the flat design: use course_lib.checkpoint.state)")
    return pp


def _check_optimizer(optimizer) -> None:
    if getattr(optimizer, "store", None) is not None:
        raise ValueError("offload='nvme' keeps Adam's m and v in its own files under offload_dir: saving that tier "
                         "with DCP is not built (train without offload to checkpoint)")


def _dtensor(t, entry, mesh, placements):
    """t (this rank's local shard, padded) as the DTensor of W's full shape: its real rows only."""
    from torch.distributed.tensor import DTensor

    _, rows = held_rows(entry.placement, entry.shape[0])
    shape = torch.Size(entry.shape)
    return DTensor.from_local(t.narrow(0, 0, rows), mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _value(t, unit, entry, mesh, placements):
    sharded = not unit.replicate and torch.is_tensor(t) and tuple(t.shape) == tuple(entry.local.shape)
    return _dtensor(t, entry, mesh, placements) if sharded else t


def save_per_param(path, model, optimizer, step: int, generator: torch.Generator | None = None) -> None:
    """Collective over the model's data-parallel group: dcp.save of the local shards, the optimizer
    state and the step (and the generator's state) into directory `path` (module docstring)."""
    import torch.distributed.checkpoint as dcp

    pp = _sharded(model)
    _check_optimizer(optimizer)
    mesh, placements = dcp_mesh(pp)
    state = {"train.step": torch.tensor(int(step))}
    if generator is not None:
        state["train.generator"] = generator.get_state()
    for unit, e in pp.entries():
        state[f"model.{e.name}"] = _value(e.local.detach(), unit, e, mesh, placements)
        for key, v in optimizer.state.get(e.local, {}).items():
            if not torch.is_tensor(v):
                raise ValueError(f"optimizer state {e.name}.{key}={v!r} is not a tensor: only tensors are saved")
            state[f"optim.{e.name}.{key}"] = _value(v, unit, e, mesh, placements)
    os.makedirs(path, exist_ok=True)
    dcp.save(state, checkpoint_id=str(path), process_group=pp.world_group)


def check_per_param_checkpoint(path, shapes: dict) -> dict:
    """Pure (no collective: every rank reads the metadata file itself, so bad input fails on every rank
    before any waits). ValueError naming the value unless `path` is a DCP checkpoint directory whose
    "model.<name>" tensors are exactly `shapes` ({name: full shape}, e.g. from named_parameters() of
    the single-process model). Returns DCP's {key: storage metadata}."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"{str(path)!r} is not a DCP checkpoint: it has no .metadata file (an unfinished save?)")
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: tuple(m.size) for k, m in meta.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    want = {n: tuple(s) for n, s in shapes.items()}
    missing, extra = [n for n in want if n not in saved], [n for n in saved if n not in want]
    if missing or extra:
        raise ValueError(f"the model's parameter names differ from the checkpoint {str(path)!r}'s: not in the "
                         f"checkpoint {missing[:4]}{'...' if len(missing) > 4 else ''}; only in the checkpoint "
                         f"{extra[:4]}{'...' if len(extra) > 4 else ''}")
    for n, s in want.items():
        if saved[n] != s:
            raise ValueError(f"{n}: shape {s} in the model, {saved[n]} in the checkpoint {str(path)!r}")
    return meta


def load_per_param(path, model, optimizer, generator: torch.Generator | None = None) -> int:
    """Collective over the model's data-parallel group, at any world size and unit policy: fill the local
    shards, the optimizer state (created here, like the optimizer's first step would) and the generator
    from the DCP checkpoint at `path`; returns the step it was saved at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    pp = _sharded(model)
    _check_optimizer(optimizer)
    meta = check_per_param_checkpoint(path, {e.name: e.shape for _, e in pp.entries()})
    if generator is not None and "train.generator" not in meta:
        raise ValueError(f"the checkpoint {str(path)!r} holds no generator state (saved with generator=None)")
    mesh, placements = dcp_mesh(pp)
    state = {"train.step": torch.tensor(0)}
    if generator is not None:
        state["train.generator"] = torch.empty_like(generator.get_state())
    for unit, e in pp.entries():
        state[f"model.{e.name}"] = _value(e.local.detach(), unit, e, mesh, placements)  # DCP copies in place
        prefix, st = f"optim.{e.name}.", {}
        for key, m in meta.items():
            sub = key[len(prefix):]
            if not key.startswith(prefix) or "." in sub or not isinstance(m, TensorStorageMetadata):
                continue
            like_w = tuple(m.size) == tuple(e.shape)  # shaped like W: this rank's (padded) shard of it
            st[sub] = torch.zeros(e.local.shape if like_w else tuple(m.size), dtype=m.properties.dtype,
                                  device=e.local.device)
            state[key] = _value(st[sub], unit, e, mesh, placements)
        if st:
            optimizer.state[e.local] = st
    dcp.load(state, checkpoint_id=str(path), process_group=pp.world_group)
    if generator is not None:
        generator.set_state(state["train.generator"])
    pp.generation += 1  # anything still gathered holds the values from before the load
    return int(state["train.step"])


def full_optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Collective over the shard group: {name: {key: the single-process tensor}} of the optimizer
    state (a shard-shaped tensor gathered by its placement, a scalar copied as it is)."""
    pp = _sharded(model)
    pieces, scalars = [], {}
    for unit, e in pp.entries():
        for key, v in optimizer.state.get(e.local, {}).items():
            if torch.is_tensor(v) and tuple(v.shape) == tuple(e.local.shape):
                pieces.append((f"{e.name}\n{key}", v, [e.placement]))
            else:
                scalars.setdefault(e.name, {})[key] = v.clone() if torch.is_tensor(v) else v  # AdamW steps it in place
    out = {}
    for k, v in gather_full(pieces, group=pp.shard_group).items():
        name, key = k.split("\n")
        out.setdefault(name, {})[key] = v
    for name, d in scalars.items():
        out.setdefault(name, {}).update(d)
    return out
