"""The one training step and the one loop around it: every training function in the course uses them.

A strategy (data, tensor, pipeline, expert parallel, ZeRO, their composition) differs from the
single process only in what it plugs into the step, one `StepHooks` record built once, and in
which rows of the global batch a rank keeps. Everything else is the same for every run:

    result = train_loop(model, optimizer, dataset, train_cfg, StepHooks(sync_gradients=...),
                        rows=share_rows(rank, n, train_cfg.batch_size))

    generator = torch.Generator().manual_seed(train_cfg.seed)        the reference's draws, on every rank
    for step in first..last:                                         (default 1..train_cfg.steps)
        before_step(step)
        idx = sample_indices(len(dataset), B, generator)[rows]       the global batch, this rank's rows
        loss = train_step(model, optimizer, *collate(dataset, idx), train_cfg.grad_clip, hooks=hooks)
        result.train_losses.append(report_loss(loss))                (e.g. the mean over replicas)
        on_step(step, loss)

with each step timed (result.step_seconds), optionally inside a tracer (result.comm_summary) and
with the grad norm of each step recorded (result.grad_norms). The step itself:

    train_step = zero_grad -> forward/backward (accum_steps micro-batches, each loss divided by
                 accum_steps, all but the last under no_sync(); or forward_backward, e.g. a
                 pipeline schedule) -> sync_gradients() -> clip -> optimizer.step()

Clipping rescales every gradient g by min(1, grad_clip / ||g||_2), ||g||_2 the norm over *all*
parameters together (for a sharded model over all shards of all ranks: hooks.clip_grad_norm).
Every training function returns one `TrainResult` (re-exported by course_lib.train).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from course_lib._validate import check_int
from course_lib.data import collate, sample_indices
from course_lib.estimate.compute import flops_per_token  # estimate: pure formulas
from course_lib.techniques.accumulation import accumulate_gradients, model_loss  # the micro-batch loop


@dataclass
class TrainResult:
    """What every training function returns (the reference trainer and each rank's loop).

    train_losses are this process's per-step losses: for the reference, the batch loss; for a
    rank, the loss of its own share (the global loss is the mean over the data-parallel ranks).
    Fields a run did not record stay empty or None.
    """

    train_losses: list[float] = field(default_factory=list)  # one per step
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    seconds: float = 0.0  # wall time of the whole loop
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step
    # time.perf_counter() at each step's end: CLOCK_MONOTONIC, one clock for every process of a
    # machine, so the ranks' ends can be compared (validation.step_periods)
    step_ends: list[float] = field(default_factory=list)
    model: nn.Module | None = None  # the trained model (in-process runs; ranks send back tensors)
    final_params: torch.Tensor | None = None  # flat copy of the parameters after the last step
    final_grads: torch.Tensor | None = None  # flat copy of the last step's gradients
    timeline_events: list | None = None  # Timeline events, when the run recorded a timeline
    comm_summary: dict | None = None  # CommTracer.summary() of the training steps, when traced
    tokens_per_step: int = 0  # tokens of one optimizer step over all ranks: global batch * seq
    flops_per_step: float = 0.0  # model FLOPs of one optimizer step over all ranks (set_step_work)
    grad_norms: list[float] = field(default_factory=list)  # global gradient norm per step, when recorded

    def set_step_work(self, model_config, global_batch: int, seq: int) -> "TrainResult":
        """Record the work of one optimizer step: tokens_per_step = global_batch * seq and
        flops_per_step = course_lib.estimate.flops_per_token(model_config, seq) * tokens, the
        model FLOPs (3 x forward matmuls, full s x s attention; recomputation excluded)."""
        self.tokens_per_step = int(global_batch) * int(seq)
        self.flops_per_step = flops_per_token(model_config, seq) * self.tokens_per_step
        return self

    def _step_time(self, skip: int) -> float:
        n = len(self.step_seconds)
        check_int("skip", skip, minimum=0, maximum=n - 1, rule=f"an int in [0, {n}): the run has {n} timed steps")
        return sum(self.step_seconds[skip:]) / len(self.step_seconds[skip:])

    def tokens_per_second(self, skip: int = 0) -> float:
        """tokens_per_step / the mean step time (steps after the first `skip`, e.g. warm-up)."""
        if not self.tokens_per_step:
            raise ValueError("tokens_per_step=0: the run did not record its work (set_step_work)")
        return self.tokens_per_step / self._step_time(skip)

    def mfu(self, peak_flops: float, n_devices: int, skip: int = 0) -> float:
        """Model FLOPs utilisation: flops_per_step / mean step time / (n_devices * peak_flops)."""
        if not self.flops_per_step:
            raise ValueError("flops_per_step=0: the run did not record its work (set_step_work)")
        if not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ValueError(f"peak_flops={peak_flops!r} must be > 0")
        check_int("n_devices", n_devices)
        return self.flops_per_step / self._step_time(skip) / (n_devices * peak_flops)


_CALLABLES = ("loss_fn", "backward", "no_sync", "forward_backward", "sync_gradients", "clip_grad_norm")


@dataclass(frozen=True)
class StepHooks:
    """What a strategy plugs into train_step, as one record built once (by its apply function
    or its trainer). The defaults are the single process's step; each field replaces one piece."""

    accum_steps: int = 1  # micro-batches per step (gradient accumulation)
    loss_fn: Callable = model_loss  # (model, x, y) -> a micro-batch loss (autocast, checkpointing, ...)
    backward: Callable | None = None  # back-propagates a loss (a loss scaler's scale-then-backward)
    no_sync: Callable | None = None  # () -> context deferring gradient communication (DDP.no_sync)
    forward_backward: Callable | None = None  # (model, x, y) -> loss: replaces the micro-batch loop
    sync_gradients: Callable | None = None  # communication after the last backward
    clip_grad_norm: Callable | None = None  # (max_norm) -> norm over every shard; default torch's
    timeline: object = None  # a Timeline: the step's phases recorded as spans

    def __post_init__(self):
        check_int("accum_steps", self.accum_steps, rule="an int >= 1")
        for name in _CALLABLES:
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ValueError(f"{name}={value!r} must be callable or None")
        if self.forward_backward is not None and (self.accum_steps != 1 or self.loss_fn is not model_loss
                                                  or self.backward is not None or self.no_sync is not None):
            raise ValueError("forward_backward replaces the micro-batch loop: accum_steps, loss_fn, backward "
                             "and no_sync do not apply with it")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               grad_clip: float | None = None, *, hooks: StepHooks | None = None, accum_steps: int = 1,
               loss_fn: Callable = model_loss, backward: Callable | None = None, no_sync: Callable | None = None,
               forward_backward: Callable | None = None, sync_gradients: Callable | None = None,
               clip_grad_norm: Callable | None = None, timeline=None) -> float:
    """One optimisation step on the batch (x, y); returns the batch loss before the update.

    zero_grad -> forward/backward (accum_steps micro-batches, each loss divided by
    accum_steps, all but the last under no_sync()) -> sync_gradients() -> clip -> step.
    The pieces come as one StepHooks record (hooks=) or as the same names as keywords (not
    both). forward_backward(model, x, y) -> loss replaces the micro-batch loop (pipeline
    schedules run their own); clip_grad_norm(max_norm) defaults to torch's over
    model.parameters(); with a timeline the phases are recorded as spans.
    """
    loose = StepHooks(accum_steps, loss_fn, backward, no_sync, forward_backward, sync_gradients, clip_grad_norm,
                      timeline)
    if hooks is None:
        hooks = loose
    elif loose != StepHooks():
        raise ValueError("pass the step's hooks as one StepHooks record (hooks=) or as keywords, not both")
    timeline = hooks.timeline
    span = timeline.span if timeline is not None else (lambda *a: contextlib.nullcontext())
    model.train()
    optimizer.zero_grad(set_to_none=True)
    if hooks.forward_backward is not None:
        loss = hooks.forward_backward(model, x, y)
    else:
        loss = accumulate_gradients(model, x, y, hooks.accum_steps, loss_fn=hooks.loss_fn, backward=hooks.backward,
                                    no_sync=hooks.no_sync, span=span).loss
    if hooks.sync_gradients is not None:
        hooks.sync_gradients()  # strategies record their own communication spans
    with span("optimizer", "optimizer"):
        if grad_clip:
            if hooks.clip_grad_norm is not None:
                hooks.clip_grad_norm(grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return float(loss)


def share_rows(index: int, n: int, batch_size: int) -> slice:
    """Rows [index * B/n, (index + 1) * B/n) of a global batch of B rows: replica `index`'s share."""
    check_int("n", n, rule="an int >= 1")
    check_int("index", index, minimum=0, maximum=n - 1, rule=f"an int in [0, n={n})")
    rule = f"divisible by {n}: every replica takes an equal share"
    if check_int("batch_size", batch_size, minimum=0, rule=rule) % n:
        raise ValueError(f"batch_size={batch_size!r} must be {rule}")
    share = batch_size // n
    return slice(index * share, (index + 1) * share)


def _recording(clip, model, norms: list):
    """A clip_grad_norm that appends the norm it returns to `norms` (torch's clip when clip is None)."""
    def clip_and_record(max_norm):
        norm = clip(max_norm) if clip is not None else torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norms.append(float(norm))
        return norm
    return clip_and_record


def _check_loop(train_cfg, hooks, rows, first, last, callbacks) -> None:
    for name, value in (("steps", train_cfg.steps), ("batch_size", train_cfg.batch_size), ("first", first)):
        check_int(name, value, rule="an int >= 1")
    check_int("last", last, minimum=first - 1, maximum=train_cfg.steps,
              rule=f"an int in [first - 1 = {first - 1}, steps = {train_cfg.steps}]")
    if not (isinstance(hooks, StepHooks) or callable(hooks)):
        raise ValueError(f"hooks={hooks!r} must be a StepHooks or a function step -> StepHooks")
    ok_rows = rows is None or (isinstance(rows, slice) and rows.step is None and isinstance(rows.start, int)
                               and isinstance(rows.stop, int) and 0 <= rows.start < rows.stop <= train_cfg.batch_size)
    if not ok_rows:
        raise ValueError(f"rows={rows!r} must be a slice(start, stop) with 0 <= start < stop <= "
                         f"batch_size={train_cfg.batch_size}")
    for name, value in callbacks.items():
        if value is not None and not callable(value):
            raise ValueError(f"{name}={value!r} must be callable or None")


def train_loop(model: nn.Module, optimizer, dataset, train_cfg, hooks: StepHooks | Callable | None = None, *,
               rows: slice | None = None, generator: torch.Generator | None = None, device=None,
               first: int = 1, last: int | None = None, result: TrainResult | None = None, tracer=None,
               record_grad_norms: bool = False, step_context: Callable | None = None,
               before_step: Callable | None = None, report_loss: Callable | None = None,
               on_step: Callable | None = None) -> TrainResult:
    """Steps first..last (default 1..train_cfg.steps) of train_step on `model`; returns `result`
    (a fresh TrainResult by default) with train_losses, step_seconds, step_ends and seconds appended/set.

    Each step draws the global batch of train_cfg.batch_size rows with `generator` (default a
    fresh one seeded with train_cfg.seed: the reference's draws) and keeps `rows` (a slice,
    share_rows; None: all), moved to `device`. hooks: a StepHooks, or a function step ->
    StepHooks (hooks that change with the step, e.g. a timeline on one step). tracer (a
    CommTracer) is entered around all steps; its summary() becomes result.comm_summary.
    record_grad_norms appends each step's clip norm to result.grad_norms. Callbacks:
    step_context(step) -> a context around that train_step (a fresh CommDebugMode, measuring
    saved activations); before_step(step) before the batch is drawn; report_loss(loss) -> the
    loss recorded (e.g. the mean over replicas, a collective); on_step(step, recorded loss).
    Bad arguments raise ValueError before the first step (so before any collective of the loop).
    """
    last = train_cfg.steps if last is None else last
    hooks = StepHooks() if hooks is None else hooks
    _check_loop(train_cfg, hooks, rows, first, last, {"step_context": step_context, "before_step": before_step,
                                                       "report_loss": report_loss, "on_step": on_step})
    result = TrainResult() if result is None else result
    gen = torch.Generator().manual_seed(train_cfg.seed) if generator is None else generator

    def hooks_of(step: int) -> StepHooks:
        h = hooks if isinstance(hooks, StepHooks) else hooks(step)
        if not isinstance(h, StepHooks):
            raise ValueError(f"hooks({step}) returned {h!r}, not a StepHooks")
        if record_grad_norms:
            h = dataclasses.replace(h, clip_grad_norm=_recording(h.clip_grad_norm, model, result.grad_norms))
        return h

    fixed = hooks_of(first) if isinstance(hooks, StepHooks) else None
    start_all = time.perf_counter()
    with tracer if tracer is not None else contextlib.nullcontext():
        for step in range(first, last + 1):
            if before_step is not None:
                before_step(step)
            idx = sample_indices(len(dataset), train_cfg.batch_size, gen)
            x, y = collate(dataset, idx if rows is None else idx[rows])
            if device is not None:
                x, y = x.to(device), y.to(device)
            step_hooks = fixed if fixed is not None else hooks_of(step)
            with step_context(step) if step_context is not None else contextlib.nullcontext():
                start = time.perf_counter()
                loss = train_step(model, optimizer, x, y, train_cfg.grad_clip, hooks=step_hooks)
                end = time.perf_counter()
                result.step_seconds.append(end - start)
                result.step_ends.append(end)
            loss = report_loss(loss) if report_loss is not None else loss
            result.train_losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
    result.seconds = time.perf_counter() - start_all
    if isinstance(hooks, StepHooks) and hooks.timeline is not None:
        result.timeline_events = hooks.timeline.events
    if tracer is not None:
        result.comm_summary = tracer.summary()
    return result
