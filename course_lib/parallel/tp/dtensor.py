"""The same tensor-parallel GPT through PyTorch's DTensor API, to hold the course layers against.

`torch.distributed.tensor.parallel.parallelize_module` takes a plan {submodule: style}:
ColwiseParallel shards a Linear's output features (its weight's rows), RowwiseParallel its input
features, SequenceParallel runs a LayerNorm on a sequence shard; PrepareModuleInput converts an
input's layout (Shard(1) -> Replicate() is an all-gather along the sequence). The weights become
DTensors and the collectives run inside DTensor's dispatch (functional collectives), below the
`torch.distributed` Python functions: count them with
`torch.distributed.tensor.debug.CommDebugMode`, not CommTracer.

Two things the plan cannot say by itself:
* ColwiseParallel splits the fused qkv weight into contiguous thirds; we first permute its rows
  to [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...] (course `qkv_rows`) so each rank gets whole heads.
* The embeddings, final norm and head stay replicated here (DTensor's vocabulary-parallel loss
  needs the logits as a DTensor, which the course GPT's plain forward does not produce).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.parallel.clip import clip_grad_norm_ as weighted_clip_grad_norm_
from course_lib.parallel.tp.apply import check_tensor_parallel, qkv_rows


def _as_mesh(group_or_mesh):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group_or_mesh, DeviceMesh):
        return group_or_mesh
    group = group_or_mesh or dist.group.WORLD
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device)


def apply_dtensor_tensor_parallel(model: nn.Module, group_or_mesh=None, sequence_parallel: bool = False) -> nn.Module:
    """parallelize_module over every block of the course GPT (in place; returns the model).
    Without SP: qkv and fc Colwise, both proj Rowwise (one all-reduce each, forward).
    With SP: ln1/ln2 SequenceParallel, attn/mlp inputs all-gathered, both proj reduce-scatter
    to Shard(1); the sequence is split before block 0 and gathered before ln_f."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    cfg = model.config
    if cfg.kv_heads != cfg.n_head:  # qkv_rows' whole-head permutation assumes Q, K and V of equal width
        raise ValueError(f"n_kv_head={cfg.n_kv_head} with n_head={cfg.n_head}: the DTensor comparison supports "
                         "multi-head attention only (n_kv_head = n_head); the course's apply_tensor_parallel "
                         "runs grouped-query attention")
    mesh = _as_mesh(group_or_mesh)
    tp = mesh.size()
    check_tensor_parallel(cfg, tp, sequence_parallel)
    for block in model.blocks:
        qkv = block.attn.qkv
        perm = qkv_rows(cfg.d_model, tp).flatten().to(qkv.weight.device)
        with torch.no_grad():  # whole heads per rank: rank r's contiguous chunk is [Q_r K_r V_r]
            qkv.weight.copy_(qkv.weight[perm])
            if qkv.bias is not None:
                qkv.bias.copy_(qkv.bias[perm])
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            plan = {"ln1": SequenceParallel(), "attn": gather, "attn.qkv": ColwiseParallel(),
                    "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                    "ln2": SequenceParallel(), "mlp": gather, "mlp.fc": ColwiseParallel(),
                    "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                    "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "ln_f": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)})
    return model


@torch.no_grad()
def clip_grad_norm_dtensor(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global-norm clip over a model mixing DTensor and plain parameters: the one weighted clip
    (course_lib.parallel.clip) over the mesh's ranks, on each gradient's local piece. A Shard
    piece is this rank's alone (weight 1); a Replicate piece and a plain gradient are the same on
    every rank (1/tp); a Partial gradient (partial sums) is first reduced to Replicate."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    pairs = []
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                replicated = [Replicate() if pl.is_partial() else pl for pl in g.placements]
                g = p.grad = g.redistribute(g.device_mesh, replicated)
            copies = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            pairs.append((g.to_local(), 1 / copies))
        else:
            pairs.append((g, 1 / mesh.size()))
    return weighted_clip_grad_norm_(pairs, max_norm, mesh.get_group())
