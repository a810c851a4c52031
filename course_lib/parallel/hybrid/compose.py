"""The ordered composition on one mesh, and the one global-norm clip.

    mesh  = make_mesh(dp, tp, pp, ep)                       dims ("pp", "dp", "ep", "tp")
    model = GPT(config, seed)                               the same plain model on every rank
    apply_tensor_parallel(model, mesh["tp"], sp)            1. TP (+SP): inside every block
    apply_expert_parallel(model, mesh["ep"])                2. EP: each MoE layer keeps E/ep experts
    recompute_in_place(model.blocks)                        (recompute='full') in place
    stage = build_stage(model, mesh["pp"], v)               3. PP: this rank's blocks (+ embedding/head)
    optimizer = ShardedOptimizer (stage 0 or 1, dp group)    4. ZeRO-1 (or plain DP) across replicas

After backward: the pipeline sums the tied embedding's two parts (stage 0 and the last stage
hold one copy each), EP averages dense gradients over ep and divides expert gradients by ep,
and ZeRO's engine averages over dp (stage 0: one all-reduce per flat group; stage 1: a
reduce-scatter, then an all-gather of the updated shards).

Global norm. ||g||^2 is a sum over the distinct elements of the single-process model. Every
element lives on several ranks, as identical copies; every rank counts parameter p with weight
1 / (its number of copies), course_lib.parallel.clip's rule, a product over the dimensions:

    w(p) = 1/[tp if p is replicated over tp, 1 if tp-sharded] * 1/[ep if dense, 1 if an expert]
           * 1/[2 for the tied matrix on the first and last stage, else 1] * 1/[dp at zero=0, 1 at zero=1]

and one all-reduce (sum) over the whole world of sum_p w(p) * ||g_p||^2 gives ||g||^2, each
element counted exactly once. Every rank then scales by min(1, max_norm / (||g|| + 1e-6)).

Each factor is read from the axis's own record (course_lib.parallel.placement): `placements(parts)`
lists every parameter's Placement on tp, ep, pp and dp, as the layers, the experts, the stage and
the ZeRO units report them, and w(p) = 1 / the product of their copies. The same records rebuild
the single-process state dict from any layout (`full_state_dict`) and give the checkpoint its boxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.model import GPT
from course_lib.parallel.clip import clip_grad_norm_
from course_lib.parallel.ep import apply_expert_parallel, reduce_gradients
from course_lib.parallel.ep.apply import ep_placements
from course_lib.parallel.mesh import make_mesh
from course_lib.parallel.placement import Placement, gather_full, parameter_names, weight
from course_lib.parallel.pp import build_stage
from course_lib.parallel.tp import apply_tensor_parallel
from course_lib.parallel.tp.apply import tp_placements
from course_lib.parallel.zero import ShardedOptimizer
from course_lib.techniques.activation_checkpointing import recompute_in_place


@dataclass
class HybridParts:
    """What one rank holds: the mesh, its coordinates, the (parallel) model and its stage."""

    dims: object
    mesh: object
    coords: dict
    groups: dict
    model: GPT
    stage: object
    optimizer: object = None


def build_hybrid(dims, model_config, seed: int = 0, device=None) -> HybridParts:
    """Rank code: the composition in the module docstring, on this rank. `dims` must have been
    checked in the parent (ParallelDims.check)."""
    mesh = make_mesh(dims)
    groups = {d: mesh[d].get_group() for d in ("pp", "dp", "ep", "tp")}
    coords = {d: dist.get_rank(groups[d]) for d in groups}
    model = GPT(model_config, seed=seed)
    if device is not None:
        model = model.to(device)
    if dims.tp > 1:
        apply_tensor_parallel(model, groups["tp"], dims.sequence_parallel)
    if dims.ep > 1:
        apply_expert_parallel(model, groups["ep"])
    if dims.recompute == "full":  # in place: the names stay the single-process ones
        recompute_in_place(model.blocks)
    stage = build_stage(model, groups["pp"], dims.virtual_stages) if dims.pp > 1 else None
    return HybridParts(dims, mesh, coords, groups, model, stage)


def trained_module(parts: HybridParts):
    """The module whose parameters this rank updates: its pipeline stage, or the whole model."""
    return parts.stage if parts.stage is not None else parts.model


def make_hybrid_optimizer(parts: HybridParts, train_cfg):
    """AdamW with make_optimizer's groups (decay on matrices only); ZeRO-1 shards it over dp."""
    params = list(trained_module(parts).parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": train_cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = dict(lr=train_cfg.lr, betas=train_cfg.betas, foreach=False, fused=False)
    # ZeRO's engine at stage 0 is plain data parallelism with one flat all-reduce per group;
    # at stage 1 it shards the optimizer state. Either way it averages the gradients over dp.
    parts.optimizer = ShardedOptimizer.for_stage([(i, g["params"]) for i, g in enumerate(groups)], torch.optim.AdamW,
                                                 parts.groups["dp"], kw, parts.dims.zero, groups=groups)
    return parts.optimizer


def sync_gradients(parts: HybridParts) -> None:
    """After backward: EP's reduction over ep. The dp mean is the ZeRO engine's (stage 0: an
    all-reduce, stage 1: a reduce-scatter), in the clip or the step; the pipeline already
    summed the tied matrix's two parts."""
    if parts.dims.ep > 1:
        reduce_gradients(trained_module(parts), parts.groups["ep"])


def trained_parameters(parts: HybridParts) -> list[tuple[str, torch.nn.Parameter]]:
    """(single-process name, parameter) of every parameter this rank trains (a tied matrix once)."""
    if parts.stage is not None:
        return list(zip(parts.stage.param_names, parts.stage.parameters()))
    return list(parts.model.named_parameters())


def _dp_state_placements(parts: HybridParts) -> dict[int, Placement]:
    """{id(p): Placement over dp} of the optimizer's copy of p: at ZeRO-1 its range of the flat
    unit's dp shards, at zero=0 whole on every replica (the engine's units have one shard)."""
    opt, rank, dp = parts.optimizer, parts.coords["dp"], parts.dims.dp
    if opt is None:
        raise ValueError("the optimizer's placements need parts.optimizer (make_hybrid_optimizer first)")
    out = {}
    for s in opt.shards:
        u = s.unit
        for p, off, n in zip(u.params, u.offsets, u.numels):
            out[id(p)] = (Placement.replicated("dp", rank, dp) if u.world_size == 1 else
                          Placement.of_flat_unit("dp", off, n, u.shard_numel, u.rank, u.world_size))
    return out


def placements(parts: HybridParts, state: bool = False) -> dict[str, tuple[Placement, ...]]:
    """{single-process name: its Placements on (tp, ep, pp, dp)} for the parameters this rank trains,
    each read from its axis: the TP layers, the expert layers, the pipeline stage; on dp the
    parameters are whole on every replica or, with state=True, what the optimizer holds of them
    (masters, their state, the dp-mean gradient the clip reads): at ZeRO-1 a flat range of the
    TP-local tensor."""
    dims, coords = parts.dims, parts.coords
    tp = tp_placements(parts.model) if dims.tp > 1 else {}
    ep = ep_placements(parts.model, parts.groups["ep"]) if dims.ep > 1 else {}
    pp = parts.stage.placements() if parts.stage is not None else {}
    dp = _dp_state_placements(parts) if state else {}
    whole = {a: Placement.replicated(a, coords[a], getattr(dims, a)) for a in ("tp", "ep", "pp", "dp")}
    return {name: (tp.get(name, whole["tp"]), ep.get(name, whole["ep"]), pp.get(name, whole["pp"]),
                   dp.get(id(p), whole["dp"])) for name, p in trained_parameters(parts)}


def count_weights(parts: HybridParts) -> dict[int, float]:
    """{id(p): w(p)} of the module docstring for this rank's parameters: 1 / the number of ranks
    of the world holding an identical copy of p's gradient, the product of its placements' copies."""
    placed = placements(parts, state=True)
    return {id(p): weight(placed[name]) for name, p in trained_parameters(parts)}


def full_state_dict(parts: HybridParts, grads: bool = False) -> dict[str, torch.Tensor]:
    """The single-process model's state dict (or gradients) rebuilt from every rank's parameters
    by their placements on every axis (a collective over the world: every rank calls it); a tied
    matrix under each of its names, as GPT.state_dict() lists it."""
    pick = (lambda p: p.grad) if grads else (lambda p: p)
    placed = placements(parts)
    pieces = [(n, pick(p), placed[n]) for n, p in trained_parameters(parts) if pick(p) is not None]
    full = gather_full(pieces, group=None)  # every rank's names: experts held elsewhere too
    return full | {n: full[first] for n, first in parameter_names(parts.model).items() if first in full}


@torch.no_grad()
def clip_grad_norm_hybrid(parts: HybridParts, max_norm: float) -> torch.Tensor:
    """Clip by the global norm of the single-process gradient (module docstring); returns it.
    The one weighted clip over the whole world, on the dp-mean gradient shards: each piece of a
    flat shard (one parameter's elements) weighted by count_weights."""
    weights = count_weights(parts)
    opt = parts.optimizer
    opt.reduce_gradients()  # the dp mean: stage 1 this rank's shard of it, stage 0 all of it
    # stage 0: the parameters' .grad are views of grad_shard, so scaling its pieces scales them
    pairs = [(piece, weights[id(s.params[i])]) for s in opt.shards for i, piece in s.unit.shard_pieces(s.grad_shard)]
    return clip_grad_norm_(pairs, max_norm, group=None, device=next(trained_module(parts).parameters()).device)
