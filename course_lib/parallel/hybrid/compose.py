"""The ordered composition on one mesh, and the one global-norm clip.

    mesh  = make_mesh(dims)                                 a RankMesh: axes pp, dp, ep, cp, tp
    model = GPT(config, seed)                               the same plain model on every rank
    apply_tensor_parallel(model, mesh["tp"], sp)            1. TP (+SP): inside every block
    apply_expert_parallel(model, mesh["ep"])                2. EP: each MoE layer keeps E/ep experts
    apply_context_parallel(model, mesh["cp"], method, lb)   3. CP: each block's attention (tp's local
                                                               heads) over the cp group
    recompute_in_place(model.blocks)                        (recompute='full') in place
    stage = build_stage(model, mesh["pp"], v)               4. PP: this rank's blocks (+ embedding/head)
    optimizer = ShardedOptimizer (stage 0 or 1, dp·cp)      5. ZeRO-1 (or plain DP) across replicas
                                                               and cp ranks; stages 2 and 3 (dp) the
                                                               engine of zero_pp.py: the gradients
                                                               reduced once per step, not per micro-batch

Sequence parallelism with pp > 1: between blocks a tp rank holds its T/tp tokens of the
residual stream, so a stage boundary sends that shard (stage.sequence_shards = tp sizes the
receive): the pipeline's messages are tp times smaller, as in Megatron.

Context parallelism. Every rank of a replica reads the replica's rows; rank c of the
cp group keeps its shard of their sequence, T/cp tokens (idx, targets and their absolute
positions, SequenceLayout: contiguous or zig-zag), and runs the model, or its pipeline stage,
on that shard alone: the first stage embeds the shard's positions (held by the stage, below),
and the pipeline's messages carry T/cp tokens, cp times smaller. Attention is the one op that
mixes positions: ContextParallelAttention sees the other ranks' keys (ring, all-gather or
Ulysses). The loss of a rank is the mean over its local tokens; the shards are equal, so the
mean over cp of the local means is the single process's loss, and the gradient of the whole
batch is the MEAN over the cp ranks of their local gradients, as over dp replicas. The cp
ranks hold whole weights, so dp and cp are one reduction group: ZeRO's engine runs over the
dp·cp ranks (mesh.group("dp_cp"), course_lib.dims.DERIVED_GROUPS; at cp = 1 it IS the dp
group; torchtitan's FSDP over dp_shard x cp does the same), averaging
the gradients over dp * cp and, at ZeRO-1, sharding the optimizer state over dp * cp ranks
instead of keeping cp identical copies of it. The alternative, an all-reduce over cp and
then ZeRO over dp, moves more bytes and keeps cp copies of the state for no gain.

After backward: the pipeline sums the tied embedding's two parts (stage 0 and the last stage
hold one copy each), EP averages dense gradients over ep and divides expert gradients by ep,
and ZeRO's engine averages over dp (stage 0: one all-reduce per flat group; stage 1: a
reduce-scatter, then an all-gather of the updated shards).

Global norm. ||g||^2 is a sum over the distinct elements of the single-process model. Every
element lives on several ranks, as identical copies; every rank counts parameter p with weight
1 / (its number of copies), course_lib.parallel.clip's rule, a product over the dimensions:

    w(p) = 1/[tp if p is replicated over tp, 1 if tp-sharded] * 1/[ep if dense, 1 if an expert]
           * 1/[2 for the tied matrix on the first and last stage, else 1]
           * 1/[dp * cp at zero=0, 1 at zero>=1 (the state's flat range is on one rank of dp·cp)]

and one all-reduce (sum) over the whole world of sum_p w(p) * ||g_p||^2 gives ||g||^2, each
element counted exactly once. Every rank then scales by min(1, max_norm / (||g|| + 1e-6)).

Each factor is read from the axis's own record (course_lib.parallel.placement): `placements(parts)`
lists every parameter's Placement on tp, ep, pp, cp (whole on every cp rank) and dp, as
the layers, the experts, the stage, the context-parallel model and the ZeRO units report them,
and w(p) = 1 / the product of their copies. The same records rebuild the single-process state
dict from any layout (`full_state_dict`) and give the checkpoint its boxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.model import GPT
from course_lib.parallel.clip import clip_grad_norm_
from course_lib.parallel.cp.apply import apply_context_parallel, cp_placements
from course_lib.parallel.hybrid.zero_pp import build_stage_optimizer
from course_lib.parallel.ep import apply_expert_parallel, reduce_gradients
from course_lib.parallel.ep.apply import ep_placements
from course_lib.parallel.mesh import make_mesh
from course_lib.parallel.placement import Placement, gather_full, parameter_names, weight
from course_lib.parallel.pp import build_stage
from course_lib.parallel.pp.runner import plan_pipeline
from course_lib.parallel.pp.stage import TokenAndPositionEmbedding
from course_lib.parallel.tp import apply_tensor_parallel
from course_lib.parallel.tp.apply import tp_placements
from course_lib.parallel.zero import ShardedOptimizer
from course_lib.techniques.activation_checkpointing import recompute_in_place


@dataclass
class HybridParts:
    """What one rank holds: the mesh, its coordinates, the (parallel) model, its stage and the
    pipeline's plan (runner.PipelinePlan: the checked schedule and its messages, built once here
    and run every step; None without stages)."""

    dims: object
    mesh: object
    coords: dict
    groups: dict
    model: GPT
    stage: object
    optimizer: object = None
    plan: object = None


class ShardPositionEmbedding(TokenAndPositionEmbedding):
    """The first pipeline stage's input under context parallelism: the same token and position
    embedding modules, fed this cp rank's positions (a buffer, not saved) instead of 0..T/cp-1."""

    def __init__(self, embed: TokenAndPositionEmbedding, positions: torch.Tensor):
        super().__init__(embed.tok_emb, embed.pos_emb, embed.drop)
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx, self.positions if pos is None else pos)


def build_hybrid(dims, model_config, seed: int = 0, device=None) -> HybridParts:
    """Rank code: the composition in the module docstring, on this rank. `dims` must have been
    checked in the parent (ParallelDims.check). coords and groups are the RankMesh's: every axis
    (size 1 included) and every derived group (course_lib.dims.DERIVED_GROUPS)."""
    mesh = make_mesh(dims)
    groups, coords = mesh.groups, mesh.coords
    model = GPT(model_config, seed=seed)
    if device is not None:
        model = model.to(device)
    if dims.tp > 1:
        apply_tensor_parallel(model, groups["tp"], dims.sequence_parallel)
    if dims.ep > 1:
        apply_expert_parallel(model, groups["ep"])
    if dims.cp > 1:  # after tp: the attention it wraps holds tp's n_head / tp heads
        apply_context_parallel(model, groups["cp"], dims.cp_method, dims.cp_load_balance)
    if dims.recompute == "full":  # in place: the names stay the single-process ones
        recompute_in_place(model.blocks)
    stage = build_stage(model, groups["pp"], dims.virtual_stages) if dims.pp > 1 else None
    plan = plan_pipeline(dims.schedule, dims.pp, dims.virtual_stages, dims.microbatches) if dims.pp > 1 else None
    if stage is not None and dims.sequence_parallel:  # the blocks' output is this tp rank's T/tp tokens
        stage.sequence_shards = dims.tp
    if stage is not None and dims.cp > 1 and stage.chunks[0].first:  # the chunk holding stage 0
        first = stage.chunks[0]
        positions = model.cp_layout.positions(coords["cp"])
        first.embed = ShardPositionEmbedding(first.embed, positions if device is None else positions.to(device))
    return HybridParts(dims, mesh, coords, groups, model, stage, plan=plan)


def zero_group(parts: HybridParts):
    """The ranks that average the gradients and (ZeRO-1) shard the optimizer state: dp·cp (the dp
    group itself at cp = 1; module docstring)."""
    return parts.groups["dp_cp"]


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
    if parts.dims.zero >= 2:  # zero_pp.py: once per step; the tied matrix's other part comes after the schedule
        chunks = list(parts.stage.chunks) if parts.stage is not None else [parts.model]
        tied = parts.stage.tied_weight() if parts.stage is not None else None
        d = parts.dims  # split backward (W actions): weight gradients land after their hooks fired
        split = parts.plan is not None and parts.plan.split_backward
        parts.optimizer = build_stage_optimizer(chunks, groups, torch.optim.AdamW, zero_group(parts), kw, d.zero,
                                                d.microbatches, d.reshard_after_forward,
                                                late=[tied] if tied is not None else [], overlap=not split)
        return parts.optimizer
    # ZeRO's engine at stage 0 is plain data parallelism with one flat all-reduce per group;
    # at stage 1 it shards the optimizer state. Either way it averages the gradients over dp
    # (dp·cp: the cp ranks' local gradients are averaged like replicas').
    parts.optimizer = ShardedOptimizer.for_stage([(i, g["params"]) for i, g in enumerate(groups)], torch.optim.AdamW,
                                                 zero_group(parts), kw, parts.dims.zero, groups=groups)
    return parts.optimizer


def sync_gradients(parts: HybridParts) -> None:
    """After backward: EP's reduction over ep. The dp (dp·cp) mean is the ZeRO engine's (stage 0:
    an all-reduce, stage 1: a reduce-scatter), in the clip or the step; the pipeline already
    summed the tied matrix's two parts."""
    if parts.dims.ep > 1:
        reduce_gradients(trained_module(parts), parts.groups["ep"])


def trained_parameters(parts: HybridParts) -> list[tuple[str, torch.nn.Parameter]]:
    """(single-process name, parameter) of every parameter this rank trains (a tied matrix once)."""
    if parts.stage is not None:
        return list(zip(parts.stage.param_names, parts.stage.parameters()))
    return list(parts.model.named_parameters())


def _dp_state_placements(parts: HybridParts) -> dict[int, tuple[Placement, Placement]]:
    """{id(p): (Placement over cp, Placement over dp)} of the optimizer's copy of p: at ZeRO-1
    its range of the flat unit's shards, at zero=0 whole on every replica (the engine's units
    have one shard). The engine runs over dp·cp: when that group is more than dp's, its
    flat range is one rank's of all dp * cp: the flat placement (axis "dp_cp") says which, and
    on cp the range is then held by this rank alone; at zero=0 the copy is whole on every dp and
    cp rank."""
    opt, c, mesh_groups = parts.optimizer, parts.coords, parts.groups
    if opt is None:
        raise ValueError("the optimizer's placements need parts.optimizer (make_hybrid_optimizer first)")
    cp = parts.dims.cp
    over_cp = opt.group is mesh_groups["dp_cp"] and mesh_groups["dp_cp"] is not mesh_groups["dp"]
    whole_cp = Placement.replicated("cp", c["cp"], cp)
    out = {}
    for s in opt.shards:
        u = s.unit
        for p, off, n in zip(u.params, u.offsets, u.numels):
            if u.world_size == 1:
                out[id(p)] = (whole_cp, Placement.replicated("dp", c["dp"], parts.dims.dp))
            else:
                out[id(p)] = (Placement.whole("cp", (c["cp"],), c["cp"], cp) if over_cp else whole_cp,
                              Placement.of_flat_unit("dp_cp" if over_cp else "dp", off, n, u.shard_numel, u.rank,
                                                     u.world_size))
    return out


def placements(parts: HybridParts, state: bool = False) -> dict[str, tuple[Placement, ...]]:
    """{single-process name: its Placements on (tp, ep, pp, cp, dp)} for the parameters this rank
    trains, each read from its axis: the TP layers, the expert layers, the pipeline stage, the
    context-parallel model (every parameter whole on every cp rank); on dp the parameters are
    whole on every replica or, with state=True, what the optimizer holds of them (masters, their
    state, the dp-mean gradient the clip reads): at ZeRO-1 a flat range of the TP-local tensor
    (over dp·cp, and then on cp this rank's alone)."""
    dims, coords = parts.dims, parts.coords
    tp = tp_placements(parts.model) if dims.tp > 1 else {}
    ep = ep_placements(parts.model, parts.groups["ep"]) if dims.ep > 1 else {}
    pp = parts.stage.placements() if parts.stage is not None else {}
    cp = cp_placements(parts.model) if dims.cp > 1 else {}  # applied only when it splits, as tp and ep
    state_of = _dp_state_placements(parts) if state else {}
    whole = {a: Placement.replicated(a, coords[a], getattr(dims, a)) for a in ("tp", "ep", "pp", "cp", "dp")}
    out = {}
    for name, p in trained_parameters(parts):
        on_cp, on_dp = state_of.get(id(p), (cp.get(name, whole["cp"]), whole["dp"]))
        out[name] = (tp.get(name, whole["tp"]), ep.get(name, whole["ep"]), pp.get(name, whole["pp"]), on_cp, on_dp)
    return out


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
