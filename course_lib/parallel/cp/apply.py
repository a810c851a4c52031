"""apply_context_parallel: the course GPT made context parallel by swapping one seam per block.

    apply_context_parallel(model, group, method="ring", load_balance=True)
    idx_s, targets_s, pos = shard_batch(idx, targets, model.cp_layout, rank)
    logits_s, loss_s = model(idx_s, targets_s, pos)        # this rank's T/cp tokens

What each of the cp ranks holds afterwards: every parameter, whole (a replica, as under data
parallelism), and T/cp tokens of every sequence: chunk r of cp (contiguous) or chunks r and
2cp-1-r of 2cp (zig-zag, load_balance=True; course_lib.parallel.cp.layout). Everything in a block
but attention acts on each token alone (LayerNorm, the qkv and output projections, the MLP), so it
runs unchanged on a shard; the token embedding too, and the position embedding needs only the
shard's absolute positions, GPT.forward's `pos`. Attention is the one op that mixes positions:
`block.attn.attend` becomes a ContextParallelAttention (ring, all-gather K/V or Ulysses), which
computes exactly the rows of full causal attention that belong to the shard's queries.

The loss on a shard is the mean over its B·T/cp tokens. The shards are equal, so the mean over
the cp ranks of their local means is the mean over the whole sequence: the single-process loss.
Its gradient is therefore (1/cp) sum_r grad L_r, and since every rank holds the whole weights
(only the activations are split), the gradients are averaged over cp exactly as data
parallelism averages them over dp, both together over the dp*cp ranks (in ZeRO/FSDP terms the
two axes shard the model state together, torchtitan's dp_shard_cp). The attention's backward
already returns to each rank the dK, dV that the other ranks' queries put on its keys, so the
local gradient needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dims import check_context_parallel
from course_lib.model import GPT
from course_lib.parallel.cp.attention import ContextParallelAttention
from course_lib.parallel.cp.layout import SequenceLayout
from course_lib.parallel.placement import Placement


@dataclass(frozen=True)
class ContextParallelInfo:
    group: object
    cp: int
    rank: int  # this rank's place in the cp group
    method: str
    layout: SequenceLayout


def _as_group(mesh_or_group):
    """A ProcessGroup (None: the world) from a group, a 1-D DeviceMesh or a mesh with a "cp" dim."""
    if hasattr(mesh_or_group, "get_group") and hasattr(mesh_or_group, "mesh"):  # a DeviceMesh
        names = mesh_or_group.mesh_dim_names or ()
        if mesh_or_group.ndim > 1:
            if "cp" not in names:
                raise ValueError(f"a {mesh_or_group.ndim}-D mesh with dims {names} has no 'cp' dim: pass mesh['cp']")
            return mesh_or_group["cp"].get_group()
        return mesh_or_group.get_group()
    return mesh_or_group


def check_apply(config, cp: int, seq_len: int | None = None, method: str = "ring", load_balance: bool = True) -> None:
    """Raise ValueError unless cp ranks can split this config's sequences (call it in the parent
    before any rank starts): the rule book's context-parallel rules (course_lib.dims) for a
    sequence of seq_len tokens (default block_size), and a dense GPT without attention dropout."""
    check_context_parallel(cp, config.block_size if seq_len is None else seq_len, config.n_head, method,
                           load_balance, getattr(config, "n_kv_head", None))
    if getattr(config, "n_experts", 0):
        # the routers' load-balancing loss is a product of means over the batch's tokens: over a
        # shard it is not the single process's (and not the mean of the shards' values)
        raise ValueError(f"n_experts={config.n_experts}: context parallelism here splits the dense GPT only")
    if config.dropout:
        raise ValueError(f"dropout={config.dropout}: context-parallel attention has no attention dropout "
                         f"(ContextParallelAttention); use dropout=0")


def apply_context_parallel(model: GPT, mesh_or_group=None, method: str = "ring", load_balance: bool = True,
                           seq_len: int | None = None) -> GPT:
    """Turn a single-process GPT (same weights on every rank) into its context-parallel form on
    `mesh_or_group` (a ProcessGroup, None for the world, a 1-D DeviceMesh, or a mesh with a "cp"
    dim), in place; returns it.

    Every block's `attn.attend` becomes a ContextParallelAttention(group, layout, method), layout
    = SequenceLayout(seq_len (default block_size), cp, load_balance), also kept as
    `model.cp_layout`; `model.context_parallel` records the group, cp, rank and method. Checked
    (course_lib.dims.check_context_parallel) before anything communicates. The model is then
    called on a shard: model(*shard_batch(idx, targets, model.cp_layout, rank)).
    """
    group = _as_group(mesh_or_group)
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError("the model is already context parallel: apply_context_parallel takes a plain GPT")
    if not isinstance(model, GPT):
        raise ValueError(f"model={type(model).__name__} must be a course_lib.model.GPT")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)  # local: no communication
    seq = model.config.block_size if seq_len is None else seq_len
    check_apply(model.config, cp, seq, method, load_balance)
    if seq > model.config.block_size:
        raise ValueError(f"seq_len={seq} exceeds block_size={model.config.block_size}")
    layout = SequenceLayout(seq, cp, load_balance)
    device = next(model.parameters()).device  # the positions buffer lives beside the weights
    for block in model.blocks:
        block.attn.attend = ContextParallelAttention(group, layout, method, rank=rank).to(device)
    model.cp_layout = layout
    model.context_parallel = ContextParallelInfo(group, cp, rank, method, layout)
    return model


def _info(model) -> ContextParallelInfo:
    info = getattr(model, "context_parallel", None)
    if info is None:
        raise ValueError("the model is not context parallel (call apply_context_parallel first)")
    return info


def shard_batch(idx: torch.Tensor, targets: torch.Tensor | None, layout: SequenceLayout, rank: int):
    """(idx_shard, targets_shard, pos): rank's tokens of every row of idx and targets (B, T) and
    their absolute positions (T/cp,), on idx's device. T must be layout.seq_len."""
    if idx.shape[1] != layout.seq_len:
        raise ValueError(f"the batch's sequence length {idx.shape[1]} must be the layout's seq_len="
                         f"{layout.seq_len} (set_sequence_length to change it)")
    pos = layout.positions(rank).to(idx.device)
    return (layout.shard(idx, rank, dim=1), None if targets is None else layout.shard(targets, rank, dim=1), pos)


def set_sequence_length(model: nn.Module, seq_len: int) -> SequenceLayout:
    """Shard sequences of seq_len tokens from now on (a batch shorter than block_size): a new
    layout for every block's attention and for shard_batch. Checked before anything changes."""
    info = _info(model)
    if seq_len > model.config.block_size:
        raise ValueError(f"seq_len={seq_len} exceeds block_size={model.config.block_size}")
    check_apply(model.config, info.cp, seq_len, info.method, info.layout.load_balance)
    layout = SequenceLayout(seq_len, info.cp, info.layout.load_balance)
    for block in model.blocks:
        block.attn.attend.set_layout(layout)
    model.cp_layout = layout
    model.context_parallel = ContextParallelInfo(info.group, info.cp, info.rank, info.method, layout)
    return layout


def context_parallel_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A StepHooks.loss_fn: the loss of this rank's shard of the batch (x, y), the mean over its
    B·T/cp tokens (the module docstring says why the mean of these over cp is the global loss)."""
    info = _info(model)
    return model(*shard_batch(x, y, model.cp_layout, info.rank))[1]


def cp_placements(model: nn.Module) -> dict[str, Placement]:
    """{parameter name: Placement over cp}: every parameter whole on every cp rank (replicated)."""
    info = _info(model)
    return {name: Placement.replicated("cp", info.rank, info.cp) for name, _ in model.named_parameters()}
