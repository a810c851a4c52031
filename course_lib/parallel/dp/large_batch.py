"""Large-batch training: what data parallelism does to the batch, and how to train with it.

N data-parallel ranks with b sequences each (and A accumulation micro-batches) train on a
global batch of B = N * A * b. Adding ranks at a fixed per-rank batch therefore grows B, and
at a fixed budget of tokens it cuts the number of optimizer steps by the same factor. Whether
that costs accuracy depends on how noisy the gradient is.

Learning-rate scaling, from a base (lr0 at batch B0) to batch B:

    "none"     lr = lr0
    "linear"   lr = lr0 * B / B0          (Goyal et al. 2017, SGD: k times the batch, k times the step)
    "sqrt"     lr = lr0 * sqrt(B / B0)    (Krizhevsky 2014; Hoffer et al. 2017; the rule that fits
                                           Adam-type optimizers, Malladi et al. 2022)

Warm-up multiplies lr by min(1, (t + 1) / warmup_steps) at step t = 0, 1, ...: a large lr
applied to the random initial weights diverges; ramping it up lets the first steps find a
region where it is safe (Goyal et al. 2017).

Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").
With G the true gradient and Sigma the per-example gradient covariance, a batch of B examples
gives a gradient with E|G_B|^2 = |G|^2 + tr(Sigma) / B. The "simple" noise scale

    B_simple = tr(Sigma) / |G|^2

is the batch at which noise and signal are equal; it predicts the critical batch size: well
below it, doubling B halves the steps needed (perfect scaling), well above it, more examples
per step buy almost nothing. Estimates from k gradients g_1..g_k of independent micro-batches
of b examples each, all at the same parameters (`gradient_noise_scale`):

    tr(Sigma) ~ b * sum_i |g_i - g_mean|^2 / (k - 1)        (sample variance, per example)
    |G|^2     ~ |g_mean|^2 - tr(Sigma) / (k b)               (removes the noise in the mean)

or from just two batch sizes b_small < b_big (`noise_scale_from_two_batches`, McCandlish et
al.'s Appendix A): in data-parallel training each rank's local gradient (b_small = B / N) and
the all-reduced one (b_big = B) are both at hand, so the estimate comes for free:

    |G|^2     ~ (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big)

Both are ratios of noisy estimates: average several before dividing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course_lib._validate import check_int
from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT
from course_lib.train import TrainConfig, TrainResult, evaluate, flat_params, make_optimizer, train_loop

LR_RULES = ("none", "linear", "sqrt")


def scale_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
    """The learning rate for `batch`, scaled from `base_lr` at `base_batch` (module docstring)."""
    if rule not in LR_RULES:
        raise ValueError(f"rule={rule!r} must be one of {LR_RULES}")
    check_int("base_batch", base_batch)
    check_int("batch", batch)
    ratio = batch / base_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up: min(1, (step + 1) / warmup_steps); warmup_steps = 0 means none."""
    check_int("warmup_steps", warmup_steps, minimum=0)
    return 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)


@dataclass
class NoiseScale:
    """One estimate: |G|^2, tr(Sigma) per example, and their ratio B_simple (in examples)."""

    grad_sq: float
    trace_cov: float

    @property
    def b_simple(self) -> float:
        return self.trace_cov / self.grad_sq if self.grad_sq > 0 else math.inf


def gradient_noise_scale(micro_grads: torch.Tensor, micro_batch: int) -> NoiseScale:
    """From k >= 2 flat gradients (rows of `micro_grads`) of independent micro-batches of
    `micro_batch` examples, all at the same parameters (module docstring)."""
    if micro_grads.dim() != 2 or micro_grads.shape[0] < 2:
        raise ValueError(f"micro_grads of shape {tuple(micro_grads.shape)} must be (k, n_params) with k >= 2")
    check_int("micro_batch", micro_batch)
    g = micro_grads.double()
    k = g.shape[0]
    mean = g.mean(dim=0)
    trace_cov = micro_batch * ((g - mean) ** 2).sum().item() / (k - 1)
    grad_sq = (mean @ mean).item() - trace_cov / (k * micro_batch)
    return NoiseScale(grad_sq, trace_cov)


def noise_scale_from_two_batches(small_sq: float, big_sq: float, b_small: int, b_big: int) -> NoiseScale:
    """McCandlish et al.'s two-batch estimate from |G_small|^2 and |G_big|^2 (module docstring)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace_cov = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return NoiseScale(grad_sq, trace_cov)


def micro_batch_gradients(model, dataset, micro_batch: int, n_micro: int, generator: torch.Generator) -> torch.Tensor:
    """(n_micro, n_params): the flat loss gradient of n_micro random micro-batches, at the
    model's current parameters (nothing is updated)."""
    check_int("micro_batch", micro_batch)
    check_int("n_micro", n_micro)
    params = list(model.parameters())
    rows = []
    for _ in range(n_micro):
        x, y = get_batch(dataset, micro_batch, generator)
        grads = torch.autograd.grad(model(x, y)[1], params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def train_at_token_budget(model_config, batch_size: int, tokens: int, base_lr: float, base_batch: int,
                          rule: str = "none", warmup_steps: int = 0, seed: int = 0, grad_clip: float = 1.0,
                          eval_batches: int = 8) -> TrainResult:
    """Train GPT(model_config) on `tokens` training tokens in batches of `batch_size` sequences
    (steps = tokens // (batch_size * block_size)), with the lr of `rule` and a linear warm-up,
    then measure the validation loss on fixed batches (the same for every run).

    Returns a TrainResult: train_losses per step, val_losses [(steps, val loss)], final_params.
    Single process: with equal shards, N-rank data parallel computes the same steps (section 6
    of notebook 03), so the batch size is all that matters here.
    """
    check_int("batch_size", batch_size)
    steps = tokens // (batch_size * model_config.block_size)
    if steps < 1:
        raise ValueError(f"tokens={tokens} is less than one batch of {batch_size} x {model_config.block_size}")
    lr = scale_lr(base_lr, base_batch, batch_size, rule)
    cfg = TrainConfig(steps=steps, batch_size=batch_size, lr=lr, grad_clip=grad_clip, seed=seed, progress=False)
    dataset = CharDataset("train", block_size=model_config.block_size)
    model = GPT(model_config, seed=seed)
    optimizer = make_optimizer(model, cfg)
    result = TrainResult().set_step_work(model_config, batch_size, model_config.block_size)

    def warm_up(step):  # step 1 is the first: warmup_factor counts from 0
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup_factor(step - 1, warmup_steps)

    train_loop(model, optimizer, dataset, cfg, result=result, before_step=warm_up)
    val = CharDataset("val", block_size=model_config.block_size)
    result.val_losses.append((steps, evaluate(model, val, eval_batches, 16, torch.Generator().manual_seed(seed + 1))))
    result.final_params = flat_params(model)
    return result
