"""The same training with PyTorch's own implementations, for side-by-side comparisons.

    train_native(config, train_cfg, "zero_redundancy", ...)   torch DistributedDataParallel (averages
                 the gradients) + torch.distributed.optim.ZeroRedundancyOptimizer (stage 1: each rank
                 steps its share of the parameters, then broadcasts them)
    train_native(config, train_cfg, "fsdp2", ...)             torch.distributed.fsdp.fully_shard on
                 every block and on the root (stage 3), optimizer_class on the DTensor shards

ZeroRedundancyOptimizer partitions whole parameters among ranks (greedily, by size), not a flat
buffer: its shards are uneven, and its communication is a broadcast of each rank's parameters
on top of DDP's all-reduce, (2 (N-1)/N + 1) Psi per rank instead of ZeRO's 2 (N-1)/N Psi.
FSDP2 issues its collectives below the Python API (DTensor, C++), so CommTracer does not see
them: comm_summary counts them with torch.distributed.tensor.debug.CommDebugMode (calls only).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.zero.training import _check_batch, default_optimizer_kwargs
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainResult, flat_grads, flat_params, share_rows, train_loop

KINDS = ("zero_redundancy", "fsdp2")


def _full(t):
    """A DTensor's full value (a plain tensor is returned as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fsdp2_model(model: nn.Module, group=None, compute_dtype=None, reshard_after_forward: bool = True):
    """fully_shard every block of model.blocks, then the root, on a 1-D CPU/GPU mesh of `group`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = rank_device()
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    mesh = DeviceMesh(dev.type, ranks)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype) if compute_dtype not in (None, torch.float32) \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def train_native(model_config, train_cfg, kind: str, optimizer_class=torch.optim.AdamW, optimizer_kwargs=None,
                 compute_dtype=None, group=None, trace: bool = False) -> TrainResult:
    """Rank code: the train_zero loop with torch's implementation `kind` (see the module docstring).
    final_params / final_grads are full (gathered) fp32 tensors in model.parameters() order;
    comm_summary: {op: {"calls": n}} from CommDebugMode (fsdp2) or CommTracer (zero_redundancy)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.debug import CommDebugMode

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    _check_batch(train_cfg, n)
    dev = rank_device()
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = GPT(model_config, seed=train_cfg.seed).to(dev)
    kwargs = optimizer_kwargs or default_optimizer_kwargs(train_cfg, optimizer_class)
    if kind == "zero_redundancy":
        ids = [dev.index] if dev.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class, process_group=group, **kwargs)
        tracer = CommTracer() if trace else None
    else:
        wrapped = fsdp2_model(model, group, compute_dtype)
        optimizer = optimizer_class(model.parameters(), **kwargs)
        tracer = None
    result = TrainResult().set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    modes = []  # fsdp2 with trace: one CommDebugMode per step (one kept open over several forwards
    # stacks up its module hooks, torch 2.13, and fails on the second step)

    def count_step(step):
        modes.append(CommDebugMode())
        return modes[-1]

    hooks = StepHooks(clip_grad_norm=lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))
    with warnings.catch_warnings():
        # Two warnings FSDP2 raises for this model, both harmless here: GPT returns its logits as a
        # view (nothing modifies it in place), and the root's inputs are token ids (no gradient).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        train_loop(wrapped, optimizer, dataset, train_cfg, hooks, rows=share_rows(rank, n, train_cfg.batch_size),
                   device=dev, result=result, tracer=tracer,
                   step_context=count_step if trace and kind == "fsdp2" else None)
    if kind == "zero_redundancy":
        result.final_params, result.final_grads = flat_params(model), flat_grads(model)
    else:
        params = list(model.parameters())
        result.final_params = torch.cat([_full(p.detach()).float().reshape(-1) for p in params]).cpu()
        result.final_grads = torch.cat([_full(p.grad).float().reshape(-1) for p in params]).cpu()
    if trace and kind == "fsdp2":
        counts = {}
        for mode in modes:
            for op, calls in mode.get_comm_counts().items():
                name = str(op).split(".")[-1]
                counts[name] = counts.get(name, 0) + calls
        result.comm_summary = {op: {"calls": c} for op, c in sorted(counts.items())}
    return result
