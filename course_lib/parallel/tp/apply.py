"""apply_tensor_parallel: the course GPT made tensor (and sequence) parallel by swapping modules.

What each rank holds after `apply_tensor_parallel(model, group, sequence_parallel)` (tp ranks,
a = heads, d = d_model, f = d_ff, V' = vocabulary padded to a multiple of tp):

    tok_emb      VocabParallelEmbedding     V'/tp rows           leaves with g (or reduce-scatter)
    pos_emb      whole (SP: its sequence rows through f)
    per block:
      ln1, ln2   whole (SP: SequenceParallelLayerNorm on T/tp tokens)
      attn.qkv   ColumnParallelLinear       whole heads: a/tp of Q and their K, V heads (qkv_rows)
      attn.proj  RowParallelLinear          d/tp input columns, whole bias
      mlp.fc     ColumnParallelLinear       f/tp rows
      mlp.proj   RowParallelLinear          f/tp input columns, whole bias
    ln_f         whole (SP: sequence-parallel)
    head         ColumnParallelLinear over V' (tied: the very same Parameter as tok_emb's shard)
    loss_fn      VocabParallelCrossEntropy: the logits stay split by vocabulary

The attention and MLP modules themselves are the plain ones: only their linear layers change,
and CausalSelfAttention reads its head count off the qkv output (a/tp heads here).

Grouped-query attention (n_kv_head = k < a): a rank keeps the key/value heads its a/tp query
heads read: k/tp of them when tp | k, else (k | tp) the one KV head of its group, copied on the
tp/k ranks of that group: its first holder owns it, the others hold zero padding in its place and
read the owner's rows with one all-reduce per forward, whose backward sums every rank's gradient
of it back to the owner (ColumnParallelLinear.weights). Every element lives on one rank, as with
the plain split, so the gather, the clip and the checkpoint need nothing new.

`tp_placements(model)` says so per parameter (course_lib.parallel.placement): split along a dim
by the layer's table, or replicated over tp. The full state dict, the clip's weights and the
checkpoint's boxes read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm.autograd import gather_along_dim
from course_lib.dims import check_sequence_parallel, check_tp
from course_lib.model import GPT
from course_lib.parallel.clip import clip_grad_norm_ as weighted_clip_grad_norm_
from course_lib.parallel.placement import Placement, gather_full, parameter_names, weight
from course_lib.parallel.tp.async_tp import check_async_tp, use_async_tp
from course_lib.parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceParallelPositions,
    VocabParallelEmbedding,
    contiguous_table,
    padded_size,
)
from course_lib.parallel.tp.loss import VocabParallelCrossEntropy

SPLIT_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)  # the layers with placements()


@dataclass(frozen=True)
class TensorParallelInfo:
    group: object
    tp: int
    sequence_parallel: bool
    padded_vocab: int
    # tp_placements' answer and the (name, Parameter) pairs it was computed for: the clip reads it
    # every step, and building the split records (every index of every table, checked) took 3 ms
    # a step at d_model 256 on 2 quiet cores, 20-30 ms on busy ones (0.1 ms cached)
    placed: dict = field(default_factory=dict, compare=False, repr=False)


def check_tensor_parallel(config, tp: int, sequence_parallel: bool = False, seq_len: int | None = None) -> None:
    """Raise ValueError unless tp can split this config (call it in the parent, before any rank
    starts): the rule book's (course_lib.dims) whole heads and MLP columns per rank and, under
    sequence parallelism, a whole sequence (seq_len, default block_size) split over the tp ranks."""
    # first: tp a positive int, whole heads and columns; KV heads split (tp | n_kv_head) or copied (n_kv_head | tp)
    check_tp(tp, config.n_head, config.ff_dim, getattr(config, "kv_heads", None), replicate_kv=True)
    if getattr(config, "n_experts", 0):
        raise ValueError(f"n_experts={config.n_experts}: tensor parallelism here splits the dense GPT only")
    check_sequence_parallel(sequence_parallel, tp, config.block_size if seq_len is None else seq_len)


def qkv_rows(d_model: int, tp: int, n_head: int = 1, n_kv_head: int | None = None) -> torch.Tensor:
    """(tp, rows per rank): rank r's rows of the fused qkv weight, [Q rows | K rows | V rows] of its heads.

    Fused rows are [Q (d) | K (g) | V (g)], g = n_kv_head * d_head (d without grouped-query
    attention), head h at rows h*d_head:(h+1)*d_head of each part. Rank r takes query heads
    r*a/tp ... (r+1)*a/tp - 1 and the key/value heads they read: its share of them when
    tp <= n_kv_head (tp | n_kv_head: whole groups), else the one KV head of its query heads' group,
    r // (tp / n_kv_head), which tp / n_kv_head ranks then hold alike.
    A contiguous third of the fused rows would hand rank 0 all of Q and part of K: wrong."""
    d_head = d_model // n_head
    g = d_model if n_kv_head is None else n_kv_head * d_head
    if n_kv_head is None or tp <= n_kv_head:
        kv_rows = contiguous_table(g, tp)
    else:  # tp / n_kv_head ranks share each KV head
        kv_rows = torch.stack([torch.arange(d_head) + (r // (tp // n_kv_head)) * d_head for r in range(tp)])
    return torch.cat([contiguous_table(d_model, tp), kv_rows + d_model, kv_rows + d_model + g], dim=1)


def apply_tensor_parallel(model: GPT, group=None, sequence_parallel: bool = False, async_tp: bool = False) -> GPT:
    """Turn a single-process GPT (same weights on every rank) into its tensor-parallel form on
    `group` (a ProcessGroup, None for the world, or a 1-D DeviceMesh), in place; returns it.

    model(idx, targets) -> (local logits (B, T, V'/tp): this rank's vocabulary slice, loss: the
    single-process loss). After backward each shard's gradient is the matching slice of the
    single-process gradient. Under sequence parallelism T must be divisible by tp. async_tp (needs
    sequence parallelism): every block's all-gathers and reduce-scatters overlapped with their
    matmuls (course_lib.parallel.tp.async_tp).
    """
    if hasattr(group, "get_group") and hasattr(group, "mesh"):  # a DeviceMesh
        group = group.get_group()
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("the model is already tensor parallel: apply_tensor_parallel takes a plain GPT")
    if not isinstance(model, GPT):
        raise ValueError(f"model={type(model).__name__} must be a course_lib.model.GPT")
    tp = dist.get_world_size(group)
    cfg, sp = model.config, bool(sequence_parallel)
    check_tensor_parallel(cfg, tp, sp)
    check_async_tp(async_tp, sp)

    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        if cfg.n_kv_head is None:  # multi-head: the two-argument call notebook 05's wrong-split cell patches
            rows = qkv_rows(cfg.d_model, tp)
        else:
            rows = qkv_rows(cfg.d_model, tp, cfg.n_head, cfg.n_kv_head)
        attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, sp, rows=rows)
        attn.proj = RowParallelLinear.from_linear(attn.proj, group, sp)
        mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, group, sp)
        mlp.proj = RowParallelLinear.from_linear(mlp.proj, group, sp)
        if sp:
            block.ln1 = SequenceParallelLayerNorm.from_layer_norm(block.ln1, group)
            block.ln2 = SequenceParallelLayerNorm.from_layer_norm(block.ln2, group)

    head = model.head
    model.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, group, sp)
    if cfg.tie_weights:
        model.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, group, bias=False, sequence_parallel=sp)
        model.head.weight = model.tok_emb.weight  # kept tied: one Parameter, both gradients
    else:
        model.head = ColumnParallelLinear.from_linear(head, group, sp)
    if sp:
        model.pos_emb = SequenceParallelPositions.from_embedding(model.pos_emb, group)
        model.ln_f = SequenceParallelLayerNorm.from_layer_norm(model.ln_f, group)
    model.loss_fn = VocabParallelCrossEntropy(model.tok_emb.vocab_start, cfg.vocab_size, group)
    if async_tp:
        use_async_tp(model)
    model.tensor_parallel = TensorParallelInfo(group, tp, sp, padded_size(cfg.vocab_size, tp))
    return model


def _info(model) -> TensorParallelInfo:
    info = getattr(model, "tensor_parallel", None)
    if info is None:
        raise ValueError("the model is not tensor parallel (call apply_tensor_parallel first)")
    return info


def tp_placements(model: nn.Module) -> dict[str, Placement]:
    """{single-process parameter name: its Placement over tp} for every parameter of a tensor-parallel
    model (a tied matrix once, under its first name): the layers' splits, the rest replicated.
    Built once per set of parameters (the layers' tables never change after apply_tensor_parallel)."""
    info = _info(model)
    params = list(model.named_parameters())
    seen = info.placed.get("params")
    if seen is None or len(seen) != len(params) or any(a != n or b is not p for (a, b), (n, p) in zip(seen, params)):
        rank, tp = dist.get_rank(info.group), dist.get_world_size(info.group)
        split = {id(getattr(m, name)): pl for m in model.modules() if isinstance(m, SPLIT_LAYERS)
                 for name, pl in m.placements().items()}
        info.placed.update(params=params, placements={name: split.get(id(p), Placement.replicated("tp", rank, tp))
                                                      for name, p in params})
    return dict(info.placed["placements"])  # a copy: the records are frozen, the dict is the caller's


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters split across the tensor-parallel ranks (each listed once)."""
    kinds = tp_placements(model)
    return [p for name, p in model.named_parameters() if kinds[name].kind == "split"]


def _gather_all(model, pick) -> dict[str, torch.Tensor]:
    """pick(p) of every parameter, whole, under every name it has (a tied matrix under both)."""
    info, placements = _info(model), tp_placements(model)
    pieces = [(n, pick(p), (placements[n],)) for n, p in model.named_parameters() if pick(p) is not None]
    full = gather_full(pieces, info.group)
    return {n: full[first] for n, first in parameter_names(model).items() if first in full}


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The single-process GPT's state dict, rebuilt from the shards on every rank (collective:
    all ranks call it) by course_lib.parallel.placement.gather_full. `GPT(config).load_state_dict(...)` accepts it."""
    return _gather_all(model, lambda p: p)


def gather_full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Like gather_full_state_dict, for the gradients (parameters without one are left out)."""
    return _gather_all(model, lambda p: p.grad)


def full_logits(model: nn.Module, local_logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V): the vocabulary slices of every rank, gathered, padding dropped (a collective)."""
    info = _info(model)
    return gather_along_dim(local_logits, -1, info.group)[..., : model.config.vocab_size]


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global norm of the single-process gradient and return it: the one weighted
    clip (course_lib.parallel.clip) over the tp group, each parameter weighted 1 / its placement's
    copies: a split one 1 (its rows live on this rank only), a replicated one 1/tp (the same
    gradient on every rank). A KV head read by several ranks is a split row of its first holder
    (zero padding on the others), so it too counts once with weight 1."""
    info, placements = _info(model), tp_placements(model)
    pairs = [(p.grad, weight((placements[n],))) for n, p in model.named_parameters()]
    return weighted_clip_grad_norm_(pairs, max_norm, info.group)
