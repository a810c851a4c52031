"""The one training step, and the single-process reference trainer.

Every parallel implementation in the course (data parallel, ZeRO, tensor and pipeline
parallel, ...) is tested against `train_reference`: same config and seed must give the same
losses. They all run the same step, `train_step`, and differ only in the pieces they plug in:

    train_step(model, optimizer, x, y, grad_clip,
               accum_steps=1,          split the batch into micro-batches (gradient accumulation)
               loss_fn=model_loss,     how a micro-batch loss is computed (autocast, checkpointing, ...)
               backward=None,          how a loss is back-propagated (a loss scaler's scale-then-backward)
               no_sync=None,           context that defers gradient communication (DDP.no_sync)
               forward_backward=None,  replaces the whole micro-batch loop (a pipeline schedule)
               sync_gradients=None,    communication after backward (all-reduce, reduce-scatter, ...)
               clip_grad_norm=None)    the global gradient norm of a sharded model
      = zero_grad -> for each micro-batch: forward -> backward -> sync -> clip -> optimizer.step

Gradient clipping rescales all gradients g by min(1, grad_clip / ||g||_2), where ||g||_2 is the
norm over *all* parameters together (for a sharded model: over all shards of all ranks).

Every training function, single-process or rank-side, returns one `TrainResult`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from course_lib.data import CharDataset, get_batch
from course_lib.estimate.compute import flops_per_token  # estimate: pure formulas
from course_lib.model import GPT, GPTConfig
from course_lib.techniques.accumulation import accumulate_gradients, model_loss  # the micro-batch loop


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0 or None disables clipping
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0  # seeds both the model init and the batch generator
    progress: bool = True


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
    model: nn.Module | None = None  # the trained model (in-process runs; ranks send back tensors)
    final_params: torch.Tensor | None = None  # flat copy of the parameters after the last step
    final_grads: torch.Tensor | None = None  # flat copy of the last step's gradients
    timeline_events: list | None = None  # Timeline events, when the run recorded a timeline
    comm_summary: dict | None = None  # CommTracer.summary() of the training steps, when traced
    tokens_per_step: int = 0  # tokens of one optimizer step over all ranks: global batch * seq
    flops_per_step: float = 0.0  # model FLOPs of one optimizer step over all ranks (set_step_work)

    def set_step_work(self, model_config, global_batch: int, seq: int) -> "TrainResult":
        """Record the work of one optimizer step: tokens_per_step = global_batch * seq and
        flops_per_step = course_lib.estimate.flops_per_token(model_config, seq) * tokens, the
        model FLOPs (3 x forward matmuls, full s x s attention; recomputation excluded)."""
        self.tokens_per_step = int(global_batch) * int(seq)
        self.flops_per_step = flops_per_token(model_config, seq) * self.tokens_per_step
        return self

    def _step_time(self, skip: int) -> float:
        if isinstance(skip, bool) or not isinstance(skip, int) or not 0 <= skip < len(self.step_seconds):
            raise ValueError(f"skip={skip!r} must be an int in [0, {len(self.step_seconds)}): the run has "
                             f"{len(self.step_seconds)} timed steps")
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
        if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
            raise ValueError(f"n_devices={n_devices!r} must be a positive int")
        return self.flops_per_step / self._step_time(skip) / (n_devices * peak_flops)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay only on parameters with >= 2 dims (weight matrices
    and embeddings). Biases and LayerNorm gains are 1-D: decaying them toward 0
    does not regularise anything useful (a LayerNorm gain of 0 kills its
    output), so they get weight_decay = 0 — the usual GPT-2 / nanoGPT choice.

    foreach/fused are off: the plain per-tensor loop is the easiest to
    re-implement by hand later (e.g. for a sharded optimizer).
    """
    params = list(model.parameters())  # a tied weight appears only once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=False, fused=False)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_clip: float | None = None,
    *,
    accum_steps: int = 1,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = model_loss,
    backward: Callable[[torch.Tensor], None] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    forward_backward: Callable[[nn.Module, torch.Tensor, torch.Tensor], float] | None = None,
    sync_gradients: Callable[[], None] | None = None,
    clip_grad_norm: Callable[[float], object] | None = None,
    timeline=None,
) -> float:
    """One optimisation step on the batch (x, y); returns the batch loss before the update.

    zero_grad -> forward/backward (accum_steps micro-batches, each loss divided by
    accum_steps, all but the last under no_sync()) -> sync_gradients() -> clip -> step.
    forward_backward(model, x, y) -> loss replaces the micro-batch loop (pipeline schedules
    run their own). clip_grad_norm(max_norm) defaults to torch's over model.parameters().
    With a Timeline, the phases are recorded as spans.
    """
    span = timeline.span if timeline is not None else (lambda *a: contextlib.nullcontext())
    model.train()
    optimizer.zero_grad(set_to_none=True)
    if forward_backward is not None:
        loss = forward_backward(model, x, y)
    else:
        loss = accumulate_gradients(model, x, y, accum_steps, loss_fn=loss_fn, backward=backward,
                                    no_sync=no_sync, span=span).loss
    if sync_gradients is not None:
        sync_gradients()  # strategies record their own communication spans
    with span("optimizer", "optimizer"):
        if grad_clip:
            if clip_grad_norm is not None:
                clip_grad_norm(grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return float(loss)


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters as one flat CPU tensor (a tied weight once), for comparing runs."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients as one flat CPU tensor, zeros where a parameter has none."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                      for p in model.parameters()]).cpu()


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batches: int, batch_size: int, generator) -> float:
    """Mean loss over `batches` random batches drawn with `generator`."""
    was_training = model.training
    model.eval()  # disables dropout
    losses = []
    for _ in range(batches):
        x, y = get_batch(dataset, batch_size, generator)
        losses.append(model(x, y)[1].item())
    model.train(was_training)
    return sum(losses) / len(losses)


def train_reference(
    model_config: GPTConfig,
    train_cfg: TrainConfig | None = None,
    dataset=None,
    val_dataset=None,
) -> TrainResult:
    """Train GPT(model_config, seed=train_cfg.seed) for train_cfg.steps steps.

    Validation loss is measured at step 0 (before any update), every
    `eval_every` steps and after the last step, always on the same val batches
    (a fresh Generator seeded with seed + 1) so the points are comparable.
    """
    cfg = train_cfg or TrainConfig()
    if dataset is None:
        dataset = CharDataset("train", block_size=model_config.block_size)
    if val_dataset is None:
        val_dataset = CharDataset("val", block_size=model_config.block_size)
    data_vocab = getattr(dataset, "vocab_size", model_config.vocab_size)
    if data_vocab > model_config.vocab_size:
        raise ValueError(
            f"model vocab_size={model_config.vocab_size} is smaller than the "
            f"dataset's vocab_size={data_vocab}"
        )

    model = GPT(model_config, seed=cfg.seed)
    optimizer = make_optimizer(model, cfg)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    seq = getattr(dataset, "block_size", model_config.block_size)
    result = TrainResult(model=model).set_step_work(model_config, cfg.batch_size, seq)

    def run_eval(step: int) -> float:
        val_gen = torch.Generator().manual_seed(cfg.seed + 1)
        loss = evaluate(model, val_dataset, cfg.eval_batches, cfg.batch_size, val_gen)
        result.val_losses.append((step, loss))
        return loss

    start = time.perf_counter()
    val = run_eval(0)
    bar = tqdm(range(1, cfg.steps + 1), desc="train", disable=not cfg.progress)
    for step in bar:
        x, y = get_batch(dataset, cfg.batch_size, data_gen)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, x, y, cfg.grad_clip)
        result.step_seconds.append(time.perf_counter() - t0)
        result.train_losses.append(loss)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val = run_eval(step)
        bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}", refresh=False)
    result.seconds = time.perf_counter() - start
    return result


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average: s_t = beta*s_{t-1} + (1-beta)*v_t,
    reported as s_t / (1 - beta^t) so the start is not pulled toward 0."""
    out, s = [], 0.0
    for t, v in enumerate(values, start=1):
        s = beta * s + (1 - beta) * v
        out.append(s / (1 - beta**t))
    return out


def plot_losses(result: TrainResult, ax=None, label: str = "", beta: float = 0.9):
    """Plot raw (faint) and smoothed train loss per step, plus val points."""
    import matplotlib.pyplot as plt  # lazy: importing matplotlib is slow and optional

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    steps = range(1, len(result.train_losses) + 1)
    prefix = f"{label} " if label else ""
    (line,) = ax.plot(steps, smooth(result.train_losses, beta), label=f"{prefix}train (smoothed)")
    ax.plot(steps, result.train_losses, color=line.get_color(), alpha=0.2, linewidth=0.8)
    if result.val_losses:
        vs, vl = zip(*result.val_losses)
        ax.plot(vs, vl, "o--", color=line.get_color(), label=f"{prefix}val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.legend()
    return ax
