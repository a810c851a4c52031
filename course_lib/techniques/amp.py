"""Mixed precision by hand: a dynamic loss scaler and fp32 master weights.

Number formats (sign / exponent / mantissa bits; `torch.finfo` gives the rest)::

    fp32   1/8/23   max 3.4e38   smallest normal 1.2e-38   eps 1.2e-7
    bf16   1/8/7    max 3.4e38   smallest normal 1.2e-38   eps 7.8e-3   (fp32's range, 8 significant bits)
    fp16   1/5/10   max 65504    smallest normal 6.1e-5    eps 9.8e-4   (subnormals down to 6.0e-8)

fp16's narrow range is the problem: gradients below 2^-24 ~ 6e-8 round to zero
(underflow), and a loss or activation gradient above 65504 becomes inf (overflow).

Loss scaling. Multiply the loss by S before backward; by the chain rule every gradient is
multiplied by S too, which lifts small gradients above the underflow threshold. Divide the
(fp32) gradients by S before the optimizer step, so the update is unchanged.

Dynamic loss scaling (`DynamicLossScaler`, the rule `torch.amp.GradScaler` uses)::

    if the unscaled gradients contain inf or nan:   S <- S * backoff_factor, skip the step,
                                                    good_steps <- 0
    else:                                           take the step, good_steps += 1, and
                                                    if good_steps == growth_interval:
                                                        S <- S * growth_factor, good_steps <- 0

so S hovers just below the largest value that does not overflow.

Master weights (`MixedPrecisionOptimizer`). The model's parameters live in fp16/bf16 for
forward and backward; an fp32 copy ("master weights") is what the optimizer updates. Why: an
update lr * g much smaller than w vanishes when w + lr*g is rounded to 16 bits: bf16 keeps 8
significant bits, so next to w = 1 the representable numbers are 2^-7 apart and, rounding to
nearest, any update below 2^-8 relative to w is lost (fp16: 11 bits, below 2^-11). Memory per parameter, with the
ZeRO paper's convention that the master copy counts as optimizer state (K = 12)::

    2 (16-bit params) + 2 (16-bit grads) + 4 (fp32 master) + 4 + 4 (Adam m, v)  = 16 bytes

and with fp32 gradient accumulation buffers (`fp32_grad_accum=True`) 4 more: 20 bytes
(course_lib.estimate's "bf16_fp32_accum": grads 2 + 4; Megatron's fused kernel, which writes
the fp32 buffer directly, saves the 2 bytes of 16-bit gradients: 18).
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable

import torch
import torch.nn as nn

from course_lib._validate import check_int

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_scaler_args(init_scale, growth_factor, backoff_factor, growth_interval) -> None:
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale={init_scale!r} must be a finite number > 0")
    if not (isinstance(growth_factor, (int, float)) and math.isfinite(growth_factor) and growth_factor > 1):
        raise ValueError(f"growth_factor={growth_factor!r} must be a finite number > 1 (the scale must grow)")
    if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
        raise ValueError(f"backoff_factor={backoff_factor!r} must satisfy 0 < backoff_factor < 1 (the scale must shrink)")
    check_int("growth_interval", growth_interval)


def update_scale(
    scale: float,
    good_steps: int,
    found_inf: bool,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> tuple[float, int]:
    """One application of the dynamic rule (module docstring); returns (scale, good_steps).

    Growth is refused when it would make the scale itself overflow to inf (as GradScaler does).
    """
    if found_inf:
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps == growth_interval:
        grown = scale * growth_factor
        # GradScaler keeps its scale in an fp32 tensor: refuse a growth that overflows fp32.
        if math.isfinite(grown) and grown <= torch.finfo(torch.float32).max:
            scale = grown
        good_steps = 0
    return scale, good_steps


def found_inf(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when any tensor holds an inf or a nan (the signal that the scale was too large)."""
    return any(t is not None and not bool(torch.isfinite(t).all()) for t in tensors)


class DynamicLossScaler:
    """Loss scaling with the GradScaler rule, written out.

        scaler = DynamicLossScaler(init_scale=2**16, growth_interval=2000)
        scaler.scale_loss(loss).backward()
        stepped = scaler.step(optimizer)   # unscale, check for inf/nan, maybe step, update S

    `history` records (scale used for this step, step skipped?) for each `update`.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000):
        _check_scaler_args(init_scale, growth_factor, backoff_factor, growth_interval)
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.good_steps = 0  # consecutive finite steps since the scale last changed
        self.history: list[tuple[float, bool]] = []

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """Divide the gradients by the scale in place; return True if any is inf/nan.

        Multiplying by 1/S (a power of two by default) is exact in floating point."""
        grads = [g for g in grads if g is not None]
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
        return found_inf(grads)

    def update(self, found_inf: bool) -> None:
        self.history.append((self.scale, bool(found_inf)))
        self.scale, self.good_steps = update_scale(
            self.scale, self.good_steps, bool(found_inf), self.growth_factor, self.backoff_factor, self.growth_interval
        )

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients of `optimizer`'s params, step unless they overflowed, update
        the scale. Returns whether the optimizer stepped."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        overflow = self.unscale_(grads)
        if not overflow:
            optimizer.step()
        self.update(overflow)
        return not overflow

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


class MixedPrecisionOptimizer:
    """fp16/bf16 model parameters for forward/backward, fp32 master weights for the update.

        mp = MixedPrecisionOptimizer(model, lambda m: make_optimizer(m, cfg), dtype=torch.float16,
                                     loss_scaler=DynamicLossScaler())
        loss = model(x, y)[1]                 # runs in fp16
        mp.backward(loss)                     # scales the loss when there is a scaler
        mp.step()                             # grads -> fp32, unscale, check, AdamW on master, copy back

    `make_optimizer` receives an fp32 copy of the model (so param groups such as "no weight
    decay on 1-D params" carry over) and returns the optimizer that updates that copy.
    The model is converted to `dtype` in place.

    `state` maps each model parameter to its fp32 master copy plus the inner optimizer's state,
    so `course_lib.observe.memory.measured_state_bytes(model, mp)` counts the master weights as optimizer
    state, as the ZeRO paper does (K = 12 bytes/param for Adam). With `fp32_grad_accum=True`
    fp32 gradient buffers (`fp32_grads`) persist between steps: after each backward the 16-bit
    gradient of every micro-batch is added into them in fp32 and zeroed. They are gradient
    memory (4 more bytes/param), so they are not part of `state`.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        dtype: torch.dtype = torch.bfloat16,
        loss_scaler: DynamicLossScaler | None = None,
        fp32_grad_accum: bool = False,
    ):
        if dtype not in LOW_PRECISION:
            raise ValueError(f"dtype={dtype} must be one of {LOW_PRECISION}")
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("the model must start in fp32: its values become the fp32 master weights")
        self.model, self.dtype, self.loss_scaler = model, dtype, loss_scaler
        self.fp32_grad_accum = fp32_grad_accum
        self.master_model = copy.deepcopy(model)  # fp32; keeps weight tying and parameter order
        self.optimizer = make_optimizer(self.master_model)
        model.to(dtype)
        self.params = list(model.parameters())
        self.masters = list(self.master_model.parameters())
        self._hooks = []
        if fp32_grad_accum:
            for p, m in zip(self.params, self.masters):
                m.grad = torch.zeros_like(m)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_accum_hook(m)))

    @staticmethod
    def _make_accum_hook(master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            # Add this micro-batch's 16-bit gradient into the fp32 buffer and zero it for the
            # next one: summing many small numbers in 16 bits would lose their low bits.
            master.grad.add_(p.grad.to(torch.float32))
            p.grad.zero_()

        return hook

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return {p: {"master": m, **self.optimizer.state.get(m, {})} for p, m in zip(self.params, self.masters)}

    @property
    def fp32_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient accumulation buffers (empty unless fp32_grad_accum=True)."""
        return [m.grad for m in self.masters] if self.fp32_grad_accum else []

    def backward(self, loss: torch.Tensor) -> None:
        (self.loss_scaler.scale_loss(loss) if self.loss_scaler else loss).backward()

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            if self.fp32_grad_accum:
                m.grad.zero_()  # buffers are kept: allocated once, reused every step
                if p.grad is not None:
                    p.grad.zero_()
            else:
                p.grad = m.grad = None

    def step(self, grad_clip: float | None = None) -> bool:
        """Move grads to fp32, unscale, skip on inf/nan, clip, update the master weights, copy
        them back into the model. Returns whether the update happened."""
        if not self.fp32_grad_accum:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.to(torch.float32)
        grads = [m.grad for m in self.masters]
        if self.loss_scaler is not None:
            overflow = self.loss_scaler.unscale_(grads)
            self.loss_scaler.update(overflow)
        else:
            overflow = found_inf(grads)  # without a scaler an inf is still a step to skip
        if not overflow:
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(self.masters, grad_clip)
            self.optimizer.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)  # round the fp32 master to 16 bits for the next forward
        self.zero_grad()
        return not overflow
