"""apply_zero: turn a plain model into its ZeRO stage 0-3 form, and return it with its optimizer.

    model, optimizer = apply_zero(model, stage, torch.optim.AdamW, lr=1e-3)
    loss = model(x, y)[1]              # each rank its own batch
    loss.backward(); optimizer.step(); optimizer.zero_grad()

trains the model as one process would with the same optimizer on the mean of the ranks'
losses. What each rank keeps of Psi parameters (N ranks, S = ceil(Psi / N); bytes for fp32 /
bf16-mixed with Adam; notebook 01's `course_lib.estimate.model_state_bytes`):

    stage  params      grads       optimizer (m, v [, fp32 master])   communication per step
    0      Psi         Psi         Psi                                all-reduce(grads)
    1      Psi         Psi         S                                  reduce-scatter(grads) + all-gather(params)
    2      Psi         S           S                                  same, reduce-scatter during backward
    3      S           S           S                                  all-gather x2 + reduce-scatter per unit

Keyword options taken out of **optimizer_kwargs before the rest goes to optimizer_class:
    compute_dtype   torch.bfloat16: parameters (stages 0-2) or gathered weights (stage 3) in
                    bf16 for compute and communication, fp32 masters in the optimizer
    bucket_cap_mb   stage 2's bucket size (default 25)
    prefetch        stage 3: gather the next block while computing this one (default True)
    timeline        a course_lib.observe.timeline.Timeline for communication spans
    gather_dtype    "fp8" (stage 3, flat): all-gather the parameters as e4m3 with a scale per
                    rank's shard, half of bf16's bytes (fp8_gather.py); default None
offload=True (stages 1-3) keeps master weights, optimizer state and the step on the host
(offload.py). Stage 3 also needs the model's blocks in `model.blocks` (each one unit).
sharding="per_param" (stage 3): each parameter sharded on dim 0 under its own name, FSDP2's design
(per_param_optim.py: policy, reshard_after_forward, hsdp, param_dtype, reduce_dtype, prefetch,
decay_groups, offload="nvme" with offload_dir).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.dp.ddp import assign_buckets, broadcast_parameters
from course_lib.parallel.zero.fp8_gather import check_gather_dtype
from course_lib.parallel.zero.offload import OffloadCounter
from course_lib.parallel.zero.per_param_optim import apply_per_param
from course_lib.parallel.zero.sharded_optimizer import ShardedOptimizer, check_optimizer_class
from course_lib.parallel.zero.stage2 import GradientBuckets
from course_lib.parallel.zero.stage3 import FullyShardedModel

STAGES = (0, 1, 2, 3)
SHARDINGS = ("flat", "per_param")  # flat.py's one buffer per unit, or each parameter on dim 0 (FSDP2)
COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
MB = 2**20


def check_zero_args(stage, optimizer_class, offload=False, compute_dtype=None, bucket_cap_mb=25) -> None:
    """ValueError naming the value and the rule; called in the parent before any rank starts."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage={stage!r} must be one of {STAGES}: 0 replicates everything (DDP), 1 shards the "
                         f"optimizer state, 2 also the gradients, 3 also the parameters (FSDP)")
    check_optimizer_class(optimizer_class)
    if not isinstance(offload, bool):
        raise ValueError(f"offload={offload!r} must be True or False")
    if offload and stage == 0:
        raise ValueError("offload=True needs stage >= 1: ZeRO-Offload moves the sharded optimizer state to the host")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r} must be one of {COMPUTE_DTYPES}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a positive number")


def stage2_buckets(params, bucket_cap_bytes: float) -> list[list]:
    """Parameters cut into buckets in backward order (bucket 0 holds the last parameters),
    each bucket's parameters in forward order (its flat layout)."""
    sizes = [p.numel() * p.element_size() for p in params]
    return [[params[i] for i in sorted(idx)] for idx in assign_buckets(sizes, bucket_cap_bytes)]


def apply_zero(model, stage, optimizer_class, group=None, offload=False, **optimizer_kwargs):
    """Returns (model, optimizer): the model changed in place, and a ShardedOptimizer engine
    for `stage` (see the module docstring). Rank 0's parameters are broadcast first, so every
    rank starts from the same replica. Collective: every rank of `group` calls it.
    sharding="per_param" (stage 3 only) shards each parameter on dim 0 instead (FSDP2's design,
    per_param_optim.py, which lists its options: policy, reshard_after_forward, hsdp, ...)."""
    sharding = optimizer_kwargs.pop("sharding", "flat")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} must be one of {SHARDINGS}")
    gather_dtype = optimizer_kwargs.pop("gather_dtype", None)
    check_gather_dtype(gather_dtype, stage, sharding)
    if sharding == "per_param":
        if isinstance(stage, bool) or stage != 3:
            raise ValueError(f"sharding='per_param' is stage 3 (parameters sharded too): got stage={stage!r}")
        check_optimizer_class(optimizer_class)
        if not dist.is_initialized():
            raise RuntimeError("apply_zero needs an initialised process group: run inside run_on_ranks or torchrun")
        optimizer_kwargs.pop("bucket_cap_mb", None)
        return apply_per_param(model, optimizer_class, group, offload, **optimizer_kwargs)
    if offload == "nvme":
        raise ValueError("offload='nvme' (optimizer state in files) is built for sharding='per_param'; "
                         "the flat design offers offload=True (the host)")
    compute_dtype = optimizer_kwargs.pop("compute_dtype", None)
    bucket_cap_mb = optimizer_kwargs.pop("bucket_cap_mb", 25)
    prefetch = optimizer_kwargs.pop("prefetch", True)
    timeline = optimizer_kwargs.pop("timeline", None)
    check_zero_args(stage, optimizer_class, offload, compute_dtype, bucket_cap_mb)
    if not dist.is_initialized():
        raise RuntimeError("apply_zero needs an initialised process group: run inside run_on_ranks or torchrun")
    broadcast_parameters(model, group)
    counter = OffloadCounter() if offload else None
    if stage == 3:
        fsdp = FullyShardedModel(model, group, compute_dtype, counter, prefetch, timeline, gather_dtype)
        optimizer = ShardedOptimizer.for_stage(fsdp.units, optimizer_class, group, optimizer_kwargs, 3,
                                               offload=counter or False)
        optimizer.fsdp = fsdp
        return model, optimizer
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    names = {id(p): n for n, p in named}
    buckets = stage2_buckets(params, bucket_cap_mb * MB) if stage == 2 else [params]
    optimizer = ShardedOptimizer.for_stage([(0, b) for b in buckets], optimizer_class, group, optimizer_kwargs,
                                           stage, offload=counter or False, compute_dtype=compute_dtype)
    for shard in optimizer.shards:
        shard.names = [names[id(p)] for p in shard.params]
    if stage == 2:
        optimizer.buckets = GradientBuckets(optimizer, timeline)
    return model, optimizer


def unit_sizes(optimizer) -> list[int]:
    """P_u of every flat unit the optimizer shards (one per bucket / block)."""
    return [s.unit.numel for s in optimizer.shards]
