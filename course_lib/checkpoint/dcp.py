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

The second half runs DCP the way production code does, on FSDP2's own DTensor state dict
(notebook 12, section 7): fsdp2_dcp_save (rank code: train, dcp.save, dcp.async_save),
fsdp2_dcp_load (rank code, any world size: dcp.load into a fresh model), dcp_chunks (the
saved chunks of one tensor, from the .metadata file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch.distributed as dist

from course_lib.checkpoint.format import _all_gather_object, _world
from course_lib.checkpoint.reshard import whole
from course_lib.checkpoint.slots import Piece
from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.parallel.zero.native import fsdp2_model
from course_lib.train import StepHooks, share_rows, train_loop
from course_lib.runtime.device import rank_device


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


# ------------------------------------------------------------ DCP on FSDP2's own state dict
# The functions above feed DCP the course's boxes. Production code hands it FSDP2's state dict
# instead: every parameter a DTensor sharded on dim 0 (rank r holds rows [r*c, (r+1)*c),
# c = ceil(rows / N), the last ranks fewer or none), and Adam's moments sharded the same way.
# DCP writes each rank's rows once with their global offsets and, on load, reads the saved
# rows that overlap each new rank's rows: the box intersection of reshard.py, in PyTorch.

def _flat_values(tree, prefix: str = "") -> dict:
    """{"model.tok_emb.weight": tensor, "optim.state.tok_emb.weight.exp_avg": tensor, ...}."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat_values(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        return _flat_values(dict(enumerate(tree)), prefix)
    return {prefix[:-1]: tree}


def _fsdp2_run(model_config, train_cfg, seed: int, group=None):
    """The course GPT under FSDP2 (fully_shard per block and root) with AdamW, after
    train_cfg.steps data-parallel steps (0: a fresh model whose optimizer state is empty)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if train_cfg.steps and train_cfg.batch_size % n:
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by world_size={n}")
    model = fsdp2_model(GPT(model_config, seed=seed), group)
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=train_cfg.betas,
                            weight_decay=train_cfg.weight_decay)
    if not train_cfg.steps:  # a fresh model
        return model, opt
    dataset = CharDataset("train", model_config.block_size)
    with warnings.catch_warnings():  # FSDP2's two harmless warnings for GPT (see parallel/zero/native.py)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        train_loop(model, opt, dataset, train_cfg,
                   StepHooks(clip_grad_norm=lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)),
                   rows=share_rows(rank, n, train_cfg.batch_size), generator=torch.Generator().manual_seed(seed),
                   device=rank_device())  # the batches where FSDP2 put the parameters (the mesh's device)
    return model, opt


def _full_values(model, opt) -> dict:
    """Collective: the whole state as plain CPU tensors and numbers on rank 0 ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _flat_values({"model": m, "optim": o})


def fsdp2_dcp_save(model_config, train_cfg, path, async_path, group=None) -> dict:
    """Rank code: train FSDP2 for train_cfg.steps steps, then dcp.save its sharded state dict
    (DTensors) into `path` and dcp.async_save the same into `async_path`. Returns {"values": the
    full state on rank 0 (see _full_values), "save_s": the blocking save, "async_blocked_s": until
    async_save returns (the copy to host memory), "async_total_s": until its write has finished}."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp2_run(model_config, train_cfg, train_cfg.seed, group)
    m, o = get_state_dict(model, opt)
    state = {"model": m, "optim": o}
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(path), process_group=group)
    t1 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(async_path), process_group=group)
    t2 = time.perf_counter()
    # a training loop would run its next steps here (the staged copy is what gets written); torch
    # returns a future, or an AsyncSaveResponse holding one, depending on the stager
    getattr(future, "upload_completion", future).result()
    t3 = time.perf_counter()
    return {"values": _full_values(model, opt), "save_s": t1 - t0, "async_blocked_s": t2 - t1,
            "async_total_s": t3 - t1}


def fsdp2_dcp_load(model_config, train_cfg, paths, group=None) -> list[dict]:
    """Rank code, at any world size: for each DCP checkpoint in `paths`, a fresh FSDP2 model and
    AdamW (another seed, so nothing matches by accident) whose DTensor state dict dcp.load fills;
    returns the full state of each on rank 0 (see _full_values)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = []
    for path in paths:
        model, opt = _fsdp2_run(model_config, dataclasses.replace(train_cfg, steps=0), train_cfg.seed + 1, group)
        m, o = get_state_dict(model, opt)  # DTensors of this world's layout; creates Adam's state
        state = {"model": m, "optim": o}
        dcp.load(state, checkpoint_id=str(path), process_group=group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out.append(_full_values(model, opt))
    return out


def dcp_chunks(path, key: str) -> list[tuple[str, list[int], list[int]]]:
    """(file, offsets, lengths) of every chunk DCP saved of tensor `key` ("model.tok_emb.weight"),
    read from the checkpoint's .metadata, in file order."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    if key not in meta.state_dict_metadata:
        raise KeyError(f"{key!r} is not in the DCP checkpoint at {path}")
    out = []
    for index, info in meta.storage_data.items():
        if index.fqn == key:
            chunk = next(c for c in meta.state_dict_metadata[key].chunks if list(c.offsets) == list(index.offset))
            out.append((info.relative_path, list(chunk.offsets), list(chunk.sizes)))
    return sorted(out)
