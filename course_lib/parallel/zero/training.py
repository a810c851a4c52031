"""ZeRO training on ranks, the single-process run it must equal, and what one step holds and sends.

    train_zero(config, train_cfg, stage, ...)   rank code: course_lib.loop.train_loop on a ZeRO model
    run_zero(dims, config, train_cfg, ...)              parent side: validate, then run it on dims.dp ranks
    train_zero_reference(config, train_cfg, ...)        one process, the same optimizer (fp32 masters for bf16)
    measure_zero_step(config, train_cfg, stage, ...)   rank code: bytes held after backward / after
                                                the step, stage 3's gathered-bytes trace, offload bytes
    ring_bytes(summary, N)                      the tracer's logical payloads as bytes on a ring

Every rank draws the reference's global batch with the same seeded generator and keeps its
contiguous 1/N share, as data parallel does (notebook 03). The optimizer is one param group
(optimizer_class(params, **optimizer_kwargs)) in both the ZeRO run and the reference.
loss_dtype=torch.float32 (both) computes the cross-entropy from fp32 logits, as mixed-precision
recipes do (Micikevicius et al. 2018 keep the loss in fp32): with bf16 compute the loss is then an
fp32 number, not a bf16 one rounded to 2^-7 of its size (1/32 near 4).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.dims import ParallelDims, check_runner
from course_lib.model import GPT
from course_lib.model.gpt import token_cross_entropy
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.zero.apply import apply_zero, check_zero_args, unit_sizes
from course_lib.parallel.zero.memory import measure_state_bytes
from course_lib.parallel.zero.per_param_optim import check_per_param_args
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainResult, flat_grads, flat_params, share_rows, train_loop


def default_optimizer_kwargs(train_cfg, optimizer_class=torch.optim.AdamW) -> dict:
    if optimizer_class is torch.optim.SGD:
        return {"lr": train_cfg.lr, "momentum": 0.9, "foreach": False}
    return {"lr": train_cfg.lr, "betas": train_cfg.betas, "weight_decay": train_cfg.weight_decay, "foreach": False}


def fp32_cross_entropy(logits, targets):
    """GPT's loss (token_cross_entropy) of the logits cast to fp32: an fp32 loss whatever the compute dtype."""
    return token_cross_entropy(logits.float(), targets)


def _model(model_config, train_cfg, loss_dtype):
    if loss_dtype not in (None, torch.float32):
        raise ValueError(f"loss_dtype={loss_dtype!r} must be None (the logits' dtype) or torch.float32")
    model = GPT(model_config, seed=train_cfg.seed)
    if loss_dtype is torch.float32:
        model.loss_fn = fp32_cross_entropy
    return model


def _check_batch(train_cfg, world_size):
    if train_cfg.batch_size % world_size:
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by world_size={world_size}: "
                         f"every rank takes an equal share")


def train_zero(model_config, train_cfg, stage: int, optimizer_class=torch.optim.AdamW, optimizer_kwargs=None,
               offload: bool = False, compute_dtype=None, group=None, trace: bool = False,
               record_timeline: bool = False, accum_steps: int = 1, loss_dtype=None, record_grad_norms: bool = False,
               **zero_kwargs) -> TrainResult:
    """Rank code. Returns a TrainResult: this rank's losses, the gathered fp32 parameters
    (final_params, the single-process order of model.parameters()) and mean gradients
    (final_grads), comm_summary of the training steps with trace, timeline_events.
    accum_steps > 1 cuts each rank's share into micro-batches (every backward communicates:
    stage 2 and 3 add each micro-batch's reduced shard to the last). loss_dtype: module docstring.
    record_grad_norms: each step's global gradient norm before clipping in grad_norms."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    _check_batch(train_cfg, n)
    dev = rank_device()
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = _model(model_config, train_cfg, loss_dtype).to(dev)
    order = [name for name, _ in model.named_parameters()]
    timeline = Timeline() if record_timeline else None
    kwargs = optimizer_kwargs or default_optimizer_kwargs(train_cfg, optimizer_class)
    model, optimizer = apply_zero(model, stage, optimizer_class, group, offload, compute_dtype=compute_dtype,
                                  timeline=timeline, **zero_kwargs, **kwargs)
    result = TrainResult().set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    hooks = StepHooks(accum_steps=accum_steps, clip_grad_norm=optimizer.clip_grad_norm_, timeline=timeline)
    train_loop(model, optimizer, dataset, train_cfg, hooks, rows=share_rows(rank, n, train_cfg.batch_size),
               device=dev, result=result, tracer=CommTracer() if trace else None, record_grad_norms=record_grad_norms)
    full = optimizer.full_state_dict()
    by_name = dict(zip(full["names"], full["params"]))
    grads = dict(zip(full["names"], optimizer.full_gradients()))
    result.final_params = torch.cat([by_name[k].reshape(-1) for k in order]).cpu()
    result.final_grads = torch.cat([grads[k].reshape(-1).float() for k in order]).cpu()
    return result


def run_zero(dims: ParallelDims, model_config, train_cfg, optimizer_class=torch.optim.AdamW,
             offload: bool = False, compute_dtype=None, timeout_s: float = 120, backend: str = "gloo",
             **kwargs) -> list[TrainResult]:
    """Parent side: dims runs dp and zero (the stage) only; reject bad input here (the stage's
    arguments, then the rule book's check_model), then train_zero on dims.dp ranks.
    reshard_after_forward stays a keyword (sharding="per_param" takes FSDP2's int k too)."""
    check_runner(dims, "run_zero", ("dp", "zero"))
    world_size, stage = dims.dp, dims.zero
    if kwargs.get("sharding") == "per_param":
        if stage != 3:
            raise ValueError(f"zero={stage!r}: sharding='per_param' is stage 3 (give zero=3)")
        keys = ("policy", "reshard_after_forward", "hsdp", "param_dtype", "reduce_dtype", "offload_dir", "prefetch")
        check_per_param_args(world_size, offload=offload, **{k: kwargs[k] for k in keys if k in kwargs})
    else:
        check_zero_args(stage, optimizer_class, offload, compute_dtype, kwargs.get("bucket_cap_mb", 25))
    _check_batch(train_cfg, world_size)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_zero, model_config, train_cfg, stage, optimizer_class, world_size=world_size,
                        timeout_s=timeout_s, backend=backend, offload=offload, compute_dtype=compute_dtype, **kwargs)


class MasterWeights:
    """A single-process mixed-precision optimizer: the model in bf16, optimizer_class on fp32
    master copies made from the fp32 initial values (Micikevicius et al. 2018)."""

    def __init__(self, model, optimizer_class, compute_dtype, **kwargs):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        model.to(compute_dtype)
        self.params = list(model.parameters())
        self.optimizer = optimizer_class(self.masters, **kwargs)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def clip_grad_norm_(self, max_norm):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm)

    @torch.no_grad()
    def step(self):
        for m, p in zip(self.masters, self.params):
            if m.grad is None and p.grad is not None:
                m.grad = p.grad.float()
        self.optimizer.step()
        for m, p in zip(self.masters, self.params):
            p.copy_(m)
            m.grad = None


def train_zero_reference(model_config, train_cfg, optimizer_class=torch.optim.AdamW, optimizer_kwargs=None,
                         compute_dtype=None, loss_dtype=None, record_grad_norms: bool = False) -> TrainResult:
    """The run every stage must equal: one process, the whole batch, optimizer_class on all
    parameters (on fp32 masters of a compute_dtype model). final_params are fp32. loss_dtype:
    module docstring; record_grad_norms as train_zero."""
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = _model(model_config, train_cfg, loss_dtype)
    kwargs = optimizer_kwargs or default_optimizer_kwargs(train_cfg, optimizer_class)
    if compute_dtype in (None, torch.float32):
        optimizer, clip = optimizer_class(model.parameters(), **kwargs), None
    else:
        optimizer = MasterWeights(model, optimizer_class, compute_dtype, **kwargs)
        clip = optimizer.clip_grad_norm_
    result = TrainResult(model=model).set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    train_loop(model, optimizer, dataset, train_cfg, StepHooks(clip_grad_norm=clip), result=result,
               record_grad_norms=record_grad_norms)
    masters = getattr(optimizer, "masters", None)
    result.final_params = torch.cat([m.reshape(-1) for m in masters]) if masters else flat_params(model)
    result.final_grads = flat_grads(model).float()
    return result


def measure_zero_step(model_config, train_cfg, stage: int, optimizer_class=torch.optim.AdamW, offload=False,
                      compute_dtype=None, group=None, steps: int = 2, **zero_kwargs) -> dict:
    """Rank code: train `steps` steps and measure the last one. Returns {"after_backward",
    "after_step": measure_state_bytes dicts, "unit_sizes", "peak_grad_bytes" (stage 2),
    "gathered_trace": [(seconds from step start, event, bytes)] and "peak_gathered" (stage 3),
    "offload": bytes each way in the last step}."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    dev = rank_device()
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = GPT(model_config, seed=train_cfg.seed).to(dev)
    kwargs = default_optimizer_kwargs(train_cfg, optimizer_class)
    model, opt = apply_zero(model, stage, optimizer_class, group, offload, compute_dtype=compute_dtype,
                            **zero_kwargs, **kwargs)
    out, t0 = {"unit_sizes": unit_sizes(opt)}, 0.0
    cfg = dataclasses.replace(train_cfg, steps=steps, grad_clip=None)

    def before_step(step):
        nonlocal t0
        if step == steps:  # the measured step: clear what the earlier steps left in the counters
            if opt.offload is not None:
                opt.offload.reset()
            if hasattr(opt, "buckets"):
                opt.buckets.peak_grad_bytes = 0
            fsdp = getattr(opt, "fsdp", None)
            if fsdp is not None:
                fsdp.memory_trace.clear()
            t0 = time.perf_counter()

    def hooks(step):  # the bytes held at the end of the last backward, before the optimizer step
        if step < steps:
            return StepHooks()
        return StepHooks(sync_gradients=lambda: out.update(after_backward=measure_state_bytes(model, opt)))

    def after_step(step, loss):
        if step == steps:
            out["after_step"] = measure_state_bytes(model, opt)

    train_loop(model, opt, dataset, cfg, hooks, rows=share_rows(rank, n, cfg.batch_size), device=dev,
               before_step=before_step, on_step=after_step)
    if hasattr(opt, "buckets"):
        out["peak_grad_bytes"] = opt.buckets.peak_grad_bytes
    if getattr(opt, "fsdp", None) is not None:
        out["gathered_trace"] = [(t - t0, e, b) for t, e, b in opt.fsdp.memory_trace]
        out["peak_gathered"] = max((b for _, _, b in opt.fsdp.memory_trace), default=0)
        out["unit_padded"] = [u.unit.padded_numel for u in opt.fsdp.units]
    if opt.offload is not None:
        out["offload"] = opt.offload.summary()
    return out


RING_FACTORS = {  # op -> (which logical byte count, factor(N)) for a ring algorithm
    "all_reduce": ("bytes_sent", lambda n: 2 * (n - 1) / n),
    "all_gather_single": ("bytes_recv", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("bytes_recv", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("bytes_sent", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("bytes_sent", lambda n: (n - 1) / n),
}


def ring_bytes(summary: dict, world_size: int) -> float:
    """Bytes one rank sends on a ring for the traced collectives: all-reduce of S bytes 2(N-1)/N S,
    reduce-scatter of an N*s input (N-1) s, all-gather into N*s (N-1) s. Logical, whatever the
    backend really does (gloo's reduce-scatter is an all-reduce plus a chunk: twice this)."""
    total = 0.0
    for op, stats in summary.items():
        if op not in RING_FACTORS:
            raise ValueError(f"ring_bytes does not know op {op!r}")
        field, factor = RING_FACTORS[op]
        total += stats[field] * factor(world_size)
    return total
