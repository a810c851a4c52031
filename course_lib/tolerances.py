"""How far two correct runs may differ, with the reason, for the checks the demos print (fp32 and bf16).

Two runs that compute the same thing in another order (ranks, shards, micro-batches) differ by
the rounding of their fp32 sums. AdamW magnifies that rounding: its first update is
lr·g/(|g| + eps), whose slope near g = 0 is lr/eps, so an element whose gradient is within
rounding of 0 may move by up to ±lr in one run and not in the other (Kingma & Ba, 2015, for
the update). The losses after such steps see those elements through their next gradients.
"""

from __future__ import annotations


def adamw_loss_atol(lr: float) -> float:
    """|loss difference| two correct runs may show after AdamW steps at learning rate lr:
    1e-5 for the fp32 loss (~4.6, spacing 4.8e-7) summed in another order, plus 2·lr·1e-2 for
    an element AdamW moved by up to 2·lr on rounding, whose gradient at the next step is at
    most ~1e-2 on the course's models. 7e-5 at lr = 3e-3, 2.1e-4 at lr = 1e-2; a wrong batch,
    shard or reduction moves a loss by > 1e-2."""
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0")
    return 1e-5 + 2 * lr * 1e-2


# bf16 compute (autocast, or bf16 weights with fp32 masters), the loss computed from fp32 logits
# (an fp32 number, not a bf16 one 2^-7 of its size apart): two correct runs that split the batch
# differently differ by the bf16 rounding (2^-8 relative) of each part of the gradient they add,
# which AdamW turns into updates of up to ±lr where a gradient is within that rounding of 0.
# Measured on the demos' tiny GPTs (3-5 steps, 2-8 gloo ranks, ZeRO 0-3, per-parameter HSDP 2 x 3,
# the capstone's dp2 x tp2 x pp2): at most 1.4e-3. A wrong reduction moves a bf16 loss by as
# little as 3e-3 within a few steps (one block's gradient left unreduced): the loss alone cannot
# tell, the first step's gradient norm below does.
BF16_LOSS_ATOL = 1e-2

# The first step's gradient norm, relative, before any optimizer step has amplified anything:
#   fp32  the same sums in another order, ~n·2^-24 for n <= ~1000 terms an element: 1e-4;
#   bf16  each side adds bf16-rounded parts (each within 2^-8 of itself: the ranks' or micro-
#         batches' gradients, the whole batch's once), so ||g_a - g_b|| <= 2^-8 (||g_a|| + sum_k
#         ||part_k||); a share of the batch has a gradient norm of about the whole's, so the
#         bound is ~2 x 2^-8 = 7.8e-3, taken 4 times over for shares noisier than the whole and
#         bf16 sums of up to 8 ranks: 2^-5 = 3.1e-2. Measured: <= 4.3e-4 (ZeRO demo), 1.7e-4
#         (capstone); one unit's gradient left unreduced moved it by >= 0.11, a sum where a mean
#         belongs by N times.
FIRST_GRAD_NORM_RTOL = {"fp32": 1e-4, "bf16": 2.0**-5}


def first_grad_norm_check(norm: float, reference: float, precision: str) -> tuple[bool, float, float]:
    """(within, |norm / reference - 1|, tolerance) for the first step's gradient norm (the rule above)."""
    if precision not in FIRST_GRAD_NORM_RTOL:
        raise ValueError(f"precision={precision!r} must be one of {tuple(FIRST_GRAD_NORM_RTOL)}")
    if not reference > 0:
        raise ValueError(f"reference={reference!r}: the single process's gradient norm must be > 0")
    rel = abs(norm / reference - 1.0)
    tol = FIRST_GRAD_NORM_RTOL[precision]
    return rel <= tol, rel, tol
