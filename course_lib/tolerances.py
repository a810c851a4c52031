"""How far two correct runs may differ, with the reason, for the checks the demos print.

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
