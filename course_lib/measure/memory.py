"""The per-rank memory model against the bytes the course's own layouts really hold (notebook 11).

    check_runnable(config, dims, batch_size, seq)             ValueError unless the course can build it here
    layout_memory_bytes(config, dims, batch_size, seq, seed)  rank code: build the layout, one step, measure
    estimated_per_rank(config, dims, batch_size, seq)         the estimator's bytes for every rank
    memory_table(config, layouts, batch_size, seq, timeout_s) parent: every layout in ONE run_on_ranks
                                                              call, rows of (estimated, measured) per rank
    format_memory_table(rows)                                 those rows as text, one line per layout

A layout is a course_lib.dims.ParallelDims, on a global batch of batch_size sequences; how it
runs here (the strategies of course_lib.parallel):

    zero 0/1           course_lib.parallel.hybrid: build_hybrid (TP -> EP -> PP stage) and its
                       ZeRO engine over dp (stage 0: plain data parallelism on flat buffers)
    zero 2/3           course_lib.parallel.zero.apply_zero on the plain GPT (pure dp only; with
                       tp or pp, run_hybrid measures them and estimate.composed_zero_memory
                       gives its bytes exactly, tests/test_hybrid_zero_pp.py)

Measured on each rank (course_lib.parallel.zero.measure_state_bytes: numel * element size, so a
flat buffer's padding is not a parameter; the engine's gradient shards and master copies count):

    params, grads      after the backward of the step (gradients are whole there, except where
                       ZeRO-2/3 already reduced them to a shard)
    optimizer          after the optimizer step (AdamW creates m and v on its first step)
    activations        pp > 1: the pipeline runner's peak of saved tensors over the schedule
                       (stage.last_peak_activation_bytes); else course_lib.observe.memory's
                       SavedActivations around one micro-batch's forward

The estimate of rank r is gpu_memory(dims, shape, ..., stage=s) for its pipeline stage
s = coordinates(r, dims.sizes())["pp"] (the mesh geometry), in fp32. The GPipe schedule keeps all m
micro-batches of a stage in flight, 1F1B pp - s; the estimate scales gpu_memory's 1F1B
activations by m / (pp - s) for GPipe.

What matches (tests/test_memory_layouts.py): params, grads and optimizer bytes equal on every
rank for DDP, ZeRO 1-3, tp, dp x tp, tp x pp, dp x pp, 1F1B and GPipe, and MoE with ep (ZeRO 0).
Activations: equal up to the 4-byte loss without tp; tp's vocabulary-parallel loss saves one
more (n, V/tp) fp32 tensor and a few per-token masks. Not compared: ZeRO-3's activations (its
freed gathered buffers leave storages whose addresses later activations reuse), MoE's
(dispatch copies and routing tensors the formula leaves out, ~13% here), and ZeRO-1 with ep > 1
(the course's hybrid shards the dense state over dp only; the formula over dp * ep, as Megatron).

This module starts processes (memory_table) and builds the strategies of course_lib.parallel;
the formulas it checks (course_lib.estimate) stay process-free.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.data import CharDataset, get_batch
from course_lib.dims import ParallelDims, coordinates
from course_lib.estimate.params import model_shape
from course_lib.estimate.per_gpu import gpu_memory
from course_lib.estimate.step_time import check_layout
from course_lib.model import GPT
from course_lib.observe.memory import SavedActivations
from course_lib.parallel.hybrid.compose import build_hybrid, make_hybrid_optimizer, trained_module
from course_lib.parallel.hybrid.training import make_forward_backward
from course_lib.parallel.zero import apply_zero, measure_state_bytes
from course_lib.parallel.zero.training import default_optimizer_kwargs
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainConfig, train_step
from course_lib.units import fmt_bytes

STATE = ("params", "grads", "optimizer")


def check_runnable(config, dims: ParallelDims, batch_size: int, seq: int | None = None) -> int:
    """ValueError unless the course can build the layout `dims` here; returns seq."""
    seq, _ = check_layout(config, dims, batch_size, seq)
    if dims.recompute != "none":
        raise ValueError(f"recompute={dims.recompute!r}: the measured runs here keep every activation "
                         f"(recompute='none')")
    if dims.zero >= 2 and dims.world_size != dims.dp:
        raise ValueError(f"zero={dims.zero} runs on pure data parallelism in this table (course_lib.parallel"
                         f".zero); the layout {dims.describe()!r} also has tp, pp or ep: run it with "
                         f"parallel.hybrid.run_hybrid, whose measured bytes estimate.composed_zero_memory gives")
    if dims.zero <= 1:
        dims.check(dims.world_size, config, batch_size, seq)
    return seq


def _batch(config, rows: int, seq: int, seed: int, dev):
    dataset = CharDataset("train", block_size=seq)
    x, y = get_batch(dataset, rows, torch.Generator().manual_seed(seed))
    return x.to(dev), y.to(dev)


def layout_memory_bytes(config, dims: ParallelDims, batch_size: int, seq: int | None = None, seed: int = 0) -> dict:
    """Rank code: build the layout `dims` with the course's strategy, run one fp32 AdamW step on
    batch_size sequences, and return this rank's measured {"params", "grads", "optimizer",
    "activations", "total", "rank", "stage"} (module docstring). Every rank of the world takes
    part (world size = dims.world_size)."""
    seq = config.block_size if seq is None else seq
    L, dev, train_cfg = dims, rank_device(), TrainConfig()
    micro_batch = dims.micro_batch(batch_size)
    rank = dist.get_rank()
    out = {}
    if L.zero >= 2:
        model = GPT(config, seed=seed).to(dev)
        model, optimizer = apply_zero(model, L.zero, torch.optim.AdamW,
                                      **default_optimizer_kwargs(train_cfg))
        module, stage, replica, forward_backward = model, None, rank, None
    else:
        parts = build_hybrid(dims, config, seed=seed, device=dev)
        model, module, stage = parts.model, trained_module(parts), parts.stage
        optimizer = make_hybrid_optimizer(parts, train_cfg)
        replica = parts.coords["dp"] * L.ep + parts.coords["ep"]
        forward_backward = make_forward_backward(parts, dims)
    rows = L.microbatches * micro_batch
    x, y = _batch(config, batch_size, seq, seed, dev)
    x, y = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
    if stage is None:  # one micro-batch's saved tensors (each backward frees them before the next)
        with SavedActivations(module) as saved:
            # own storages, as a loader hands them out: a view would count the whole batch
            model(x[:micro_batch].clone(), y[:micro_batch].clone())  # the graph is dropped unused
        out["activations"] = saved.bytes
        del saved  # it holds the saved tensors

    def after_backward():
        out.update({k: v for k, v in measure_state_bytes(module, optimizer).items() if k in ("params", "grads")})

    hooks = (StepHooks(forward_backward=forward_backward, sync_gradients=after_backward) if forward_backward is not None
             else StepHooks(accum_steps=L.microbatches, sync_gradients=after_backward))
    train_step(module, optimizer, x, y, None, hooks=hooks)
    out["optimizer"] = measure_state_bytes(module, optimizer)["optimizer"]
    if stage is not None:
        out["activations"] = stage.last_peak_activation_bytes
    out["total"] = sum(out[k] for k in STATE) + out["activations"]
    out["rank"], out["stage"] = rank, rank // (L.dp * L.ep * L.tp)
    return out


def estimated_per_rank(config, dims: ParallelDims, batch_size: int, seq: int | None = None) -> list[dict]:
    """The estimator's fp32 bytes of every rank, in rank order (module docstring)."""
    seq, micro_batch = check_layout(config, dims, batch_size, seq)
    shape, sizes = model_shape(config), dims.sizes()
    out = []
    for rank in range(dims.world_size):
        s = coordinates(rank, sizes)["pp"]
        mem = gpu_memory(dims, shape, micro_batch, seq, "fp32", stage=s)
        if dims.pp > 1 and dims.schedule == "gpipe":
            mem["activations"] = mem["activations"] * dims.microbatches // (dims.pp - s)
        mem["total"] = sum(mem[k] for k in STATE) + mem["activations"]
        out.append({k: mem[k] for k in (*STATE, "activations", "total")} | {"rank": rank, "stage": s})
    return out


def _measure_all(config, layouts, batch_size, seq, seed):
    return [layout_memory_bytes(config, lay, batch_size, seq, seed) for lay in layouts]


def memory_table(config, layouts, batch_size: int, seq: int | None = None, timeout_s: float = 300,
                 seed: int = 0) -> list[dict]:
    """Parent side: run every layout (all of one world size) in ONE run_on_ranks call and return,
    per layout, {"label", "layout", "estimated": [per rank], "measured": [per rank],
    "state_equal": estimated params + grads + optimizer == measured on every rank,
    "busiest": (estimated, measured) state bytes of the busiest rank,
    "activation_ratio": measured / estimated activations of the busiest-activation rank}."""
    layouts = list(layouts)
    if not layouts:
        raise ValueError("layouts=[] must name at least one ParallelDims")
    worlds = {lay.world_size for lay in layouts}
    if len(worlds) != 1:
        raise ValueError(f"every layout must use the same number of ranks (one run): got world sizes {sorted(worlds)}")
    seqs = {check_runnable(config, lay, batch_size, seq) for lay in layouts}
    seq = seqs.pop()
    per_rank = run_on_ranks(_measure_all, config, layouts, batch_size, seq, seed, world_size=worlds.pop(),
                            timeout_s=timeout_s)
    rows = []
    for i, lay in enumerate(layouts):
        measured = [r[i] for r in per_rank]
        estimated = estimated_per_rank(config, lay, batch_size, seq)
        state = [(sum(e[k] for k in STATE), sum(m[k] for k in STATE)) for e, m in zip(estimated, measured)]
        act_rank = max(range(len(measured)), key=lambda r: estimated[r]["activations"])
        label = lay.describe(batch_size) + (f"·{lay.schedule}" if lay.pp > 1 and lay.schedule == "1f1b" else "")
        rows.append({"label": label, "dims": lay, "estimated": estimated, "measured": measured,
                     "state_equal": all(e == m for e, m in state),
                     "busiest": (max(e for e, _ in state), max(m for _, m in state)),
                     "activation_ratio": measured[act_rank]["activations"] / estimated[act_rank]["activations"]})
    return rows


def format_memory_table(rows: list[dict]) -> str:
    """memory_table's rows as text: per layout the busiest rank's model state (params + grads +
    AdamW moments) estimated and measured, whether every rank matched, and the activations of
    the rank holding the most, estimated and measured (IEC units)."""
    lines = [f"{'layout':34s} {'state est.':>11s} {'measured':>11s} {'every rank':>10s} "
             f"{'activ. est.':>11s} {'measured':>11s}"]
    for r in rows:
        act = max(range(len(r["estimated"])), key=lambda i: r["estimated"][i]["activations"])
        est, meas = r["busiest"]
        lines.append(f"{r['label']:34s} {fmt_bytes(est, 2):>11s} {fmt_bytes(meas, 2):>11s} "
                     f"{'equal' if r['state_equal'] else 'DIFFERENT':>10s} "
                     f"{fmt_bytes(r['estimated'][act]['activations'], 2):>11s} "
                     f"{fmt_bytes(r['measured'][act]['activations'], 2):>11s}")
    return "\n".join(lines)
