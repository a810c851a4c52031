"""The single-process reference trainer, and what every trainer shares (re-exported from course_lib.loop).

Every parallel implementation in the course (data parallel, ZeRO, tensor and pipeline
parallel, ...) is tested against `train_reference`: same config and seed must give the same
losses. They all run the same step, `train_step`, in the same loop, `train_loop` (both in
course_lib.loop, importable from here), and differ only in the pieces they plug in, one
`StepHooks` record:

    StepHooks(accum_steps=1,          split the batch into micro-batches (gradient accumulation)
              loss_fn=model_loss,     how a micro-batch loss is computed (autocast, checkpointing, ...)
              backward=None,          how a loss is back-propagated (a loss scaler's scale-then-backward)
              no_sync=None,           context that defers gradient communication (DDP.no_sync)
              forward_backward=None,  replaces the whole micro-batch loop (a pipeline schedule)
              sync_gradients=None,    communication after backward (all-reduce, reduce-scatter, ...)
              clip_grad_norm=None,    the global gradient norm of a sharded model
              timeline=None)          the step's phases as spans
    train_step(model, optimizer, x, y, grad_clip, hooks=...)     (or the same names as keywords)
      = zero_grad -> for each micro-batch: forward -> backward -> sync -> clip -> optimizer.step

Gradient clipping rescales all gradients g by min(1, grad_clip / ||g||_2), where ||g||_2 is the
norm over *all* parameters together (for a sharded model: over all shards of all ranks).

Every training function, single-process or rank-side, returns one `TrainResult`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from course_lib.data import CharDataset, get_batch
from course_lib.loop import StepHooks, TrainResult, share_rows, train_loop, train_step  # re-exported
from course_lib.model import GPT, GPTConfig

__all__ = ["TrainConfig", "TrainResult", "StepHooks", "train_step", "train_loop", "share_rows", "make_optimizer",
           "flat_params", "flat_grads", "evaluate", "train_reference", "smooth", "plot_losses"]


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
    seq = getattr(dataset, "block_size", model_config.block_size)
    result = TrainResult(model=model).set_step_work(model_config, cfg.batch_size, seq)

    def run_eval(step: int) -> float:
        val_gen = torch.Generator().manual_seed(cfg.seed + 1)
        loss = evaluate(model, val_dataset, cfg.eval_batches, cfg.batch_size, val_gen)
        result.val_losses.append((step, loss))
        return loss

    start = time.perf_counter()
    val = run_eval(0)
    bar = tqdm(total=cfg.steps, desc="train", disable=not cfg.progress)

    def after_step(step: int, loss: float) -> None:
        nonlocal val
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val = run_eval(step)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", val=f"{val:.3f}", refresh=False)

    train_loop(model, optimizer, dataset, cfg, result=result, on_step=after_step)  # the batches of get_batch
    bar.close()
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
