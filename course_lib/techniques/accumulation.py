"""Gradient accumulation: k micro-batches, one optimizer step, the gradient of one big batch.

The loss is a mean over the B examples of a batch. Split the batch into k micro-batches of
m = B / k examples each. Because a mean of equal-sized means is the overall mean,

    grad( (1/B) sum_i l_i ) = sum_j grad( (1/k) * (1/m) sum_{i in micro-batch j} l_i ),

so back-propagating each micro-batch loss divided by k, letting `.backward()` add the
gradients into `p.grad`, and stepping once gives the big-batch update (up to the order of
floating-point additions). Only one micro-batch's activations are alive at a time: activation
memory is that of m examples, while the effective batch is B = k * m. The price is k smaller
(less efficient) forward/backward passes one after another instead of one big one.

In data parallel training the same idea lets ranks skip the gradient all-reduce on the first
k - 1 micro-batches (DDP's `no_sync()`), communicating once per step.

The optimizer step around it is `course_lib.train.train_step(..., accum_steps=k)` (defined in
course_lib.loop, which builds on this module: loop imports it, not the other way).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from course_lib._validate import check_int
from course_lib.observe.memory import SavedActivations


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default micro-batch loss: the model's own (logits, loss) convention."""
    return model(x, y)[1]


def split_micro_batches(x: torch.Tensor, y: torch.Tensor, accum_steps: int):
    """[(x_j, y_j)] for j < accum_steps, equal slices along the batch dimension."""
    check_int("accum_steps", accum_steps, rule="an int >= 1")
    B = x.shape[0]
    if B % accum_steps != 0:
        # Unequal micro-batches would need weights m_j / B instead of 1/k to give the big-batch mean.
        raise ValueError(f"batch size {B} must be divisible by accum_steps={accum_steps}")
    # clone: a view would keep the whole batch's storage alive in autograd (the embedding and
    # the loss save their index tensors), as if the micro-batch held the full batch.
    return [(xm.clone(), ym.clone()) for xm, ym in zip(x.chunk(accum_steps), y.chunk(accum_steps))]


@dataclass
class AccumulationResult:
    loss: float  # mean loss over the whole batch (the big-batch loss)
    micro_batch_saved_bytes: list[int] = field(default_factory=list)  # filled when measured


def accumulate_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    accum_steps: int,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = model_loss,
    backward: Callable[[torch.Tensor], None] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    measure: bool = False,
    span=None,
) -> AccumulationResult:
    """Add the gradient of the batch-mean loss into p.grad, one micro-batch at a time.

    `loss_fn(model, x, y)` computes a micro-batch loss (swap in checkpointed_forward or an
    autocast region); `backward(loss)` defaults to loss.backward() (pass a loss scaler's);
    `no_sync()` wraps every micro-batch but the last (DDP: communicate once per step).
    With measure=True each micro-batch's saved-activation bytes are recorded; `span(name,
    category)` (a Timeline's) times the forward and backward passes.
    """
    result = AccumulationResult(loss=0.0)
    span = span or (lambda *a: contextlib.nullcontext())
    micro = split_micro_batches(x, y, accum_steps)
    for j, (xm, ym) in enumerate(micro):
        defer = no_sync is not None and j < len(micro) - 1
        with no_sync() if defer else contextlib.nullcontext():
            with span("forward", "forward"):
                if measure:
                    with SavedActivations(model) as saved:
                        loss = loss_fn(model, xm, ym)
                    result.micro_batch_saved_bytes.append(saved.bytes)
                else:
                    loss = loss_fn(model, xm, ym)
            scaled = loss / accum_steps  # the 1/k that turns a sum of micro-means into the big mean
            with span("backward", "backward"):
                (backward or torch.Tensor.backward)(scaled)
        result.loss += scaled.item()
        # the graph of this micro-batch is freed by backward: memory does not grow with k
    return result
