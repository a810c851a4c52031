"""The reference training loop on a dp x tp x pp x ep x cp mesh, its single-process twin, and
the bytes each mesh dimension moved.

Every rank draws the reference's global batch (a generator seeded with train_cfg.seed) and
keeps the share of its replica, r = dp_index * ep + ep_index: rows [r*B/R, (r+1)*B/R), R = dp*ep
(RankMesh.rows). tp, pp and cp ranks of one replica read the same rows; a cp rank then keeps its
shard of their sequence (T/cp tokens, with their positions). The loss of a step is the mean over
the R replicas and the cp shards, the loss group (RankMesh.mean_loss: an all-reduce over each of
dp, ep and cp that has more than one rank), so every rank reports the global loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib._validate import check_one_of
from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.cp.apply import shard_batch
from course_lib.parallel.hybrid.compose import (build_hybrid, clip_grad_norm_hybrid, make_hybrid_optimizer,
                                                sync_gradients, trained_module, zero_group)
from course_lib.dims import ParallelDims
from course_lib.parallel.hybrid.zero_pp import measure_stage_bytes
from course_lib.parallel.mesh import mesh_layout
from course_lib.parallel.pp import run_schedule
from course_lib.parallel.tp import gather_full_state_dict
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.techniques.activation_checkpointing import recompute_in_place
from course_lib.train import StepHooks, TrainResult, make_optimizer, share_rows, train_loop


@dataclass
class HybridResult(TrainResult):
    """TrainResult (train_losses: the global loss, the same on every rank; grad_norms: the global
    gradient norm of each step) plus this rank's coordinates, the single-process parameters it owns
    (full tensors, TP shards gathered, by their single-process names), and the bytes each mesh
    dimension moved on this rank ({"tp": {"calls", "bytes_sent", "bytes_recv"}, ...})."""

    coords: dict = field(default_factory=dict)
    named_params: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)  # bytes measured on this rank, when the run measured them
    zero_ops: dict = field(default_factory=dict)  # trace: {op: {"calls", "bytes_sent"}} of ZeRO's group, all steps
    zero_units: dict = field(default_factory=dict)  # {name: P_u}: the elements of each of this rank's ZeRO units
    resumed_from: str = ""  # a run resumed from a checkpoint: "saved at dp2·tp2·pp2, loading at dp1·tp2·pp2"


def dimension_of(group_ranks, groups_by_dim: dict[str, list[list[int]]], world_size: int) -> str:
    """The mesh dimension a communicator belongs to: the first dimension of size > 1 with that
    group (a dimension spanning the world, e.g. pure dp, claims the world group), else "world"."""
    ranks = sorted(group_ranks)
    for dim, lists in groups_by_dim.items():
        if len(lists[0]) > 1 and any(sorted(g) == ranks for g in lists):
            return dim
    return "world" if len(ranks) == world_size else "other"


def traffic_by_dimension(records, dims: ParallelDims, world_size: int) -> dict[str, dict[str, int]]:
    """{dimension: calls and bytes} of the tracer's records: the first group of the mesh (an axis,
    else a derived group: ZeRO's on the dp·cp groups, "dp_cp") with the call's ranks; a group equal
    to an axis counts under that axis (at dp = 1 the dp·cp groups are the cp groups: "cp")."""
    groups = {name: g for name, g in mesh_layout(dims).items() if name in (*dims.sizes(), "dp_cp")}
    out: dict[str, dict[str, int]] = {}
    for r in records:
        s = out.setdefault(dimension_of(r.group_ranks, groups, world_size),
                           {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
        s["calls"] += 1
        s["bytes_sent"] += r.bytes_sent
        s["bytes_recv"] += r.bytes_recv
    return dict(sorted(out.items()))


def ops_on_group(records, group) -> dict[str, dict[str, int]]:
    """{op: {"calls", "bytes_sent"}} of the tracer's records on `group`'s ranks (reduce-scatters
    and all-gathers under one name each, whatever torch calls them)."""
    ranks, out = sorted(dist.get_process_group_ranks(group)), {}
    for r in records:
        if sorted(r.group_ranks) == ranks:
            op = "all_gather" if "all_gather" in r.op else "reduce_scatter" if "reduce_scatter" in r.op else r.op
            s = out.setdefault(op, {"calls": 0, "bytes_sent": 0})
            s["calls"] += 1
            s["bytes_sent"] += r.bytes_sent
    return out


def owned_params(parts) -> dict[str, torch.Tensor]:
    """{single-process name: full tensor} of the parameters this rank trains (collective over tp)."""
    if parts.dims.tp > 1:
        full = gather_full_state_dict(parts.model)
    else:
        full = {n: p.detach() for n, p in parts.model.named_parameters()}
    # Single-process names, a tied matrix once (as named_parameters() lists it)
    keep = set(parts.stage.param_names) if parts.stage is not None else {n for n, _ in parts.model.named_parameters()}
    return {n: t.detach().cpu().clone() for n, t in full.items() if n in keep}


def precision_context(precision: str):
    """"bf16": torch.autocast (matmuls in bf16, the parameters, their gradients and so AdamW's
    master weights in fp32; no loss scaler: bf16 has fp32's range). "fp32": nothing."""
    if precision == "bf16":
        return torch.autocast(rank_device().type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_forward_backward(parts, dims, timeline=None):
    """train_step's forward_backward for a hybrid layout: with context parallelism the rank's
    sequence shard of its rows first; the pipeline schedule when there are stages, else `microbatches` accumulated
    micro-batches, under dims.precision; then the gradient synchronisation of every mesh
    dimension. Returns the mean loss of the rank's share (its local tokens). A Timeline
    (optional) gets the forward/backward (or the pipeline's F/B, sends and receives) and the
    synchronisation. The pipeline runs backward inside its schedule, so
    autocast covers forward and backward in both branches (backward runs each op in the dtype
    its forward chose either way)."""
    m = dims.microbatches
    span = timeline.span if timeline is not None else (lambda *a: contextlib.nullcontext())

    def forward_backward(_module, x, y):
        pos = None
        if dims.cp > 1:  # context parallelism applied: this cp rank's tokens of every row and their positions
            x, y, pos = shard_batch(x, y, parts.model.cp_layout, parts.coords["cp"])
        with precision_context(dims.precision):
            if parts.stage is not None:
                loss = run_schedule(parts.stage, x, y, parts.plan, m, timeline=timeline)  # planned once (build_hybrid)
            else:
                loss = 0.0
                for i, (xc, yc) in enumerate(zip(x.chunk(m), y.chunk(m))):
                    with span(f"F{i}", "forward"):
                        part = parts.model(xc, yc, pos)[1] / m
                    with span(f"B{i}", "backward"):
                        part.backward()
                    loss += part.item()
        with span("ep reduce", "comm") if dims.ep > 1 else contextlib.nullcontext():
            sync_gradients(parts)
        return loss

    return forward_backward


def replica_rows(parts, dims: ParallelDims, batch_size: int) -> slice:
    """The rows of the global batch this rank's replica r = dp_index * ep + ep_index reads
    (tp, pp and cp ranks of one replica read the same rows): RankMesh.rows."""
    return parts.mesh.rows(batch_size)


def mean_over_replicas(parts, dims: ParallelDims):
    """train_loop's report_loss: this replica's loss -> the global loss, the mean over the loss
    group (R = dp * ep replicas x cp equal sequence shards; RankMesh.mean_loss, float64), the
    same on every rank."""
    return parts.mesh.mean_loss


def train_hybrid(dims: ParallelDims, model_config, train_cfg, trace: bool = False) -> HybridResult:
    """Rank code: train_cfg.steps steps of the composed model (compose.py) on this rank."""
    world = dist.get_world_size()
    dims.check(world, model_config, train_cfg.batch_size)
    dev = rank_device()
    parts = build_hybrid(dims, model_config, seed=train_cfg.seed, device=dev)
    module = trained_module(parts)
    optimizer = make_hybrid_optimizer(parts, train_cfg)
    dataset = CharDataset("train", block_size=model_config.block_size)
    result = HybridResult(coords=dict(parts.coords))
    result.set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    hooks = StepHooks(forward_backward=make_forward_backward(parts, dims),
                      clip_grad_norm=lambda c: clip_grad_norm_hybrid(parts, c))
    tracer = CommTracer() if trace else None
    train_loop(module, optimizer, dataset, train_cfg, hooks, rows=replica_rows(parts, dims, train_cfg.batch_size),
               device=dev, result=result, tracer=tracer, record_grad_norms=True,
               report_loss=mean_over_replicas(parts, dims))
    if trace:
        result.traffic = traffic_by_dimension(tracer.records, dims, world)
        result.zero_ops = ops_on_group(tracer.records, zero_group(parts))
    result.zero_units = {getattr(s, "name", f"unit{i}"): s.unit.numel for i, s in enumerate(optimizer.shards)}
    if dims.zero >= 2:  # what the rank holds between steps, its most whole-gradient bytes at once,
        # and (stage 3) its most gathered bytes at once
        result.memory = measure_stage_bytes(module, optimizer) | {"grads_peak": optimizer.peak_grad_bytes}
        if dims.zero == 3:
            result.memory["gathered_peak"] = optimizer.fsdp.peak_gathered_bytes
    if hasattr(optimizer, "unshard"):  # ZeRO-3: the parameters whole again, to be read
        optimizer.unshard()
    result.named_params = owned_params(parts)
    return result


def train_single(model_config, train_cfg, precision: str = "fp32", recompute: str = "none",
                 on_step=None) -> HybridResult:
    """The single-process run the hybrid one must equal: same seed, same global batches, torch's
    clip (its norm recorded), AdamW from make_optimizer, the same precision and recomputation.
    on_step(step, loss) (optional) is called after every step."""
    model = GPT(model_config, seed=train_cfg.seed)
    check_one_of("recompute", recompute, ("none", "full"))
    if recompute == "full":
        recompute_in_place(model.blocks)
    optimizer = make_optimizer(model, train_cfg)
    dataset = CharDataset("train", block_size=model_config.block_size)
    result = HybridResult()
    result.set_step_work(model_config, train_cfg.batch_size, model_config.block_size)

    def forward_backward(module, x, y):
        with precision_context(precision):
            loss = module(x, y)[1]
            loss.backward()
        return loss.item()

    # torch's clip over model.parameters() (hooks.clip_grad_norm=None), its norm recorded
    train_loop(model, optimizer, dataset, train_cfg, StepHooks(forward_backward=forward_backward), result=result,
               record_grad_norms=True, on_step=on_step)
    result.named_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def run_hybrid(dims: ParallelDims, model_config, train_cfg, timeout_s: float = 300, trace: bool = False,
               **kwargs) -> list[HybridResult]:
    """Parent side: validate every rule (ParallelDims.check), then train on dims.world_size ranks."""
    dims.check(None, model_config, train_cfg.batch_size)
    return run_on_ranks(train_hybrid, dims, model_config, train_cfg, trace=trace, world_size=dims.world_size,
                        timeout_s=timeout_s, **kwargs)


def merged_params(results: list[HybridResult]) -> dict[str, torch.Tensor]:
    """{name: tensor} over all ranks (the first rank that owns a name gives it)."""
    out = {}
    for r in results:
        for n, t in r.named_params.items():
            out.setdefault(n, t)
    return out
