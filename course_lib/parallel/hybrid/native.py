"""FSDP x TP with PyTorch's own pieces: the dp x tp, zero=3 layout of the course's composed run
(run_hybrid), built from torch's API to hold the course's against, in numbers and in speed.

    mesh   DeviceMesh (dp, tp), rank = dp_index * tp + tp_index: tp innermost, as the course's mesh
    TP     course_lib.parallel.tp.dtensor.apply_dtensor_tensor_parallel(model, mesh["tp"]):
           parallelize_module, qkv and fc Colwise, both proj Rowwise (qkv's rows first permuted
           to whole heads per rank); embeddings, LayerNorms and head stay plain tensors
    FSDP2  torch.distributed.fsdp.fully_shard(block, mesh=mesh["dp"]) for every block, then the
           root: a TP weight (a DTensor on mesh["tp"]) becomes a 2-D DTensor on the whole mesh,
           its tp shard cut again over dp, as the course's ZeRO-3 x TP shards it; a plain
           parameter becomes a 1-D DTensor on mesh["dp"]. FSDP2 all-gathers a block's shards
           before its forward (and, resharded, again before its backward) and reduce-scatters
           the gradients (the mean over dp) once per step
    AdamW  course_lib.train.make_optimizer on the DTensor shards: each rank steps its piece

Why this composition: FSDP2 over DTensor TP runs on CPU/gloo, and it is the course's hybrid run
at pp = 1 with zero = 3 (the pipeline composition, fully_shard on a torch.distributed.pipelining
stage, is not built here): same rows per dp rank (share_rows(dp_index, dp, B)), the
same micro-batches (FSDP2's gradient sync held back until the last one), the same global-norm
clip, so every loss and every final weight must equal train_single's to fp32 rounding.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

import torch
import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims, check_runner
from course_lib.model import GPT
from course_lib.parallel.clip import clip_grad_norm_ as weighted_clip_grad_norm_
from course_lib.parallel.hybrid.training import HybridResult
from course_lib.parallel.tp.apply import check_tensor_parallel, qkv_rows
from course_lib.parallel.tp.dtensor import apply_dtensor_tensor_parallel
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, make_optimizer, share_rows, train_loop

__all__ = ["train_native_fsdp_tp", "run_native_fsdp_tp", "clip_grad_norm_fsdp_tp", "full_named_params"]


def _check(model_config, train_cfg, dp, tp, microbatches, world=None) -> None:
    """ValueError naming the value and the rule, before any collective (world None: in the parent)."""
    for name, value in (("dp", dp), ("tp", tp), ("microbatches", microbatches)):
        check_int(name, value)
    if world is not None and dp * tp != world:
        raise ValueError(f"dp={dp} x tp={tp} = {dp * tp} must equal the world size {world}")
    if train_cfg.batch_size % (dp * microbatches):
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by dp * microbatches = "
                         f"{dp * microbatches}: every dp rank takes equal micro-batches")
    check_tensor_parallel(model_config, tp, False)


@torch.no_grad()
def clip_grad_norm_fsdp_tp(model, max_norm: float) -> torch.Tensor:
    """The single process's global-norm clip over gradients on two meshes, returning ||g||.

    torch.nn.utils.clip_grad_norm_ stacks the per-tensor norms into one DTensor, which it cannot
    do here: a TP weight's gradient lives on the 2-D (dp, tp) mesh, a plain parameter's on the
    1-D dp mesh (torch 2.13 raises "All operands in aten.stack.default must have the same
    mesh"). So each rank sums the squares of its local pieces, each weighted by 1 / (the number
    of world ranks holding an identical copy of it), and one all-reduce over the world adds them
    up (course_lib.parallel.clip): every element of the single-process gradient is then counted
    exactly once. A piece on mesh M with placements P has copies on
    (world / |M|) x prod(|M_i| for the dims i where P_i is Replicate) ranks: a 1-D dp shard
    of a LayerNorm is the same on every tp rank (world / |dp mesh| = tp copies: the TP plan
    all-reduces the gradient of each Colwise input, so every tp rank's is whole); a 2-D shard
    of a Colwise weight is one rank's alone; a Rowwise bias, Replicate over tp, has tp copies.
    """
    world, pairs = dist.get_world_size(), []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if any(pl.is_partial() for pl in g.placements):  # FSDP2 hands back reduced shards, never partial sums
            raise ValueError(f"a gradient with placements {g.placements}: expected Shard / Replicate only")
        replicated = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
        pairs.append((g.to_local(), 1 / (world // g.device_mesh.size() * replicated)))
    return weighted_clip_grad_norm_(pairs, max_norm, group=None)


def full_named_params(model, tp: int) -> dict[str, torch.Tensor]:
    """{single-process name: full tensor} (collective: every rank calls it; the tied matrix once).
    full_tensor() gathers each DTensor over its mesh; qkv's rows go back from the whole-heads
    order the TP plan permuted them to (stored row i was original row perm[i])."""
    perm = qkv_rows(model.config.d_model, tp).flatten()
    out = {}
    # A weight sharded on dim 0 over tp and again over dp (_StridedShard) comes back in two
    # all-gathers, one per mesh dim, and DTensor logs a warning that it could not merge them
    # (about speed; nothing is reduced, so the gathered values are exact): silenced while we gather.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        fulls = [(name, p.detach().full_tensor().cpu().clone()) for name, p in model.named_parameters()]
    finally:
        log.setLevel(level)
    for name, full in fulls:
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            original = torch.empty_like(full)
            original[perm] = full
            full = original
        out[name] = full
    return out


def train_native_fsdp_tp(model_config, train_cfg, dp: int, tp: int, microbatches: int = 1,
                         reshard_after_forward: bool = True, gather: bool = True) -> HybridResult:
    """Rank code (dp * tp ranks): train_cfg.steps steps of GPT(model_config, seed) with torch's
    FSDP2 x DTensor TP (module docstring). Returns a HybridResult like train_hybrid's:
    train_losses (the global loss, the mean over dp, the same on every rank), grad_norms (the
    clip's global norm), step_seconds, coords {"dp", "tp"}, named_params (full_named_params;
    left empty with gather=False, e.g. in a benchmark that only times the steps)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    _check(model_config, train_cfg, dp, tp, microbatches, dist.get_world_size())
    dev = rank_device()
    mesh = DeviceMesh(dev.type, torch.arange(dp * tp).view(dp, tp), mesh_dim_names=("dp", "tp"))
    coords = {"dp": mesh.get_local_rank("dp"), "tp": mesh.get_local_rank("tp")}
    model = GPT(model_config, seed=train_cfg.seed).to(dev)  # the same initial weights on every rank
    apply_dtensor_tensor_parallel(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    optimizer = make_optimizer(model, train_cfg)  # AdamW, decay on >= 2-D weights (DTensor.dim() is global)

    @contextlib.contextmanager
    def hold_gradient_sync():  # accumulate_gradients' no_sync: every micro-batch but the last keeps its
        model.set_requires_gradient_sync(False)  # unsharded gradient, the last reduce-scatters the sum
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    dp_group = mesh.get_group("dp")

    def mean_over_dp(loss: float) -> float:  # each dp rank's loss is the mean of its equal share of rows
        t = torch.tensor(loss / dp, dtype=torch.float64, device=dev)
        if dp > 1:
            dist.all_reduce(t, group=dp_group)
        return float(t)

    hooks = StepHooks(accum_steps=microbatches, no_sync=hold_gradient_sync if microbatches > 1 else None,
                      clip_grad_norm=lambda c: clip_grad_norm_fsdp_tp(model, c))
    result = HybridResult(coords=coords)
    result.set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    dataset = CharDataset("train", block_size=model_config.block_size)
    with warnings.catch_warnings():
        # Two warnings FSDP2 raises for this model, both harmless here: GPT returns its logits as a
        # view (nothing modifies it in place), and the root's inputs are token ids (no gradient).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        train_loop(model, optimizer, dataset, train_cfg, hooks, rows=share_rows(coords["dp"], dp, train_cfg.batch_size),
                   device=dev, result=result, record_grad_norms=True, report_loss=mean_over_dp)
    if gather:
        result.named_params = full_named_params(model, tp)
    return result


def run_native_fsdp_tp(dims: ParallelDims, model_config, train_cfg, timeout_s: float = 300,
                       **kwargs) -> list[HybridResult]:
    """Parent side: dims runs dp, tp, microbatches and reshard_after_forward with zero=3 (FSDP2
    shards parameters, gradients and optimizer state) only; check the layout and the rule book's
    check_model, then train_native_fsdp_tp on dims.dp * dims.tp ranks (results in rank order)."""
    check_runner(dims, "run_native_fsdp_tp", ("dp", "tp", "microbatches", "zero", "reshard_after_forward"))
    if dims.zero != 3:
        raise ValueError(f"zero={dims.zero!r}: run_native_fsdp_tp runs FSDP2, which is ZeRO stage 3 (give zero=3)")
    _check(model_config, train_cfg, dims.dp, dims.tp, dims.microbatches)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_native_fsdp_tp, model_config, train_cfg, dims.dp, dims.tp, dims.microbatches,
                        dims.reshard_after_forward, world_size=dims.world_size, timeout_s=timeout_s, **kwargs)
