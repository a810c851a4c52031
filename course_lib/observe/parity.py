"""Loss parity: hold a run's step-by-step losses and gradient norms against a reference's (the
single process, usually), with a tolerance derived from the precision, and name the first step
that departs. Every parallel strategy in the course is proven this way; here it is a tool to
point at your own.

    report = loss_parity(my_run, reference, precision="fp32", terms=batch_tokens)
    print(report)              "parity holds over 3 steps ..." or "departs at step 2: loss ..."
    report.first_step          None, or the first step (1-based) whose loss or norm departs

Where the tolerance comes from. Two correct runs compute the same sums in another order (ranks,
shards, micro-batches). Summing n terms in floating point with unit roundoff u gives a result
within (n - 1) u sum|x_i| of the exact sum, whatever the order (Higham 2002, Accuracy and
Stability of Numerical Algorithms, §4.2), so two orders differ by at most 2 (n - 1) u sum|x_i|.
A loss is a mean of non-negative per-token losses, so sum|x_i| / n is the loss itself and

    |loss_a - loss_b| <= 2 (n - 1) u |loss|          at the first step,

with u = 2^-24 (fp32), 2^-8 (bf16), 2^-11 (fp16), 2^-53 (fp64): half the spacing of numbers
near 1. A gradient norm is the root of a sum of squares of sums: the same relative bound is
used for it. After step k the weights themselves carry k such roundings, so the tolerance at
step k is k times the first step's (linear growth: an assumption that holds while a step does
not amplify a perturbation of the weights, as with the small learning rates of the course's
checks). An optimizer that magnifies rounding (AdamW near g = 0, course_lib.tolerances) adds
its own `atol`. A bug (a wrong shard, a missing average) moves a loss by orders of magnitude more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib._validate import check_int

UNIT_ROUNDOFF = {"fp64": 2.0 ** -53, "fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def parity_rtol(precision: str, terms: int) -> float:
    """2 (terms - 1) u: how far, relative to its size, one step's loss (or gradient norm) may
    move when `terms` terms are summed in another order at `precision` (module docstring)."""
    if precision not in UNIT_ROUNDOFF:
        raise ValueError(f"precision={precision!r} must be one of {tuple(UNIT_ROUNDOFF)}")
    check_int("terms", terms, rule="an int >= 1 (the number of terms summed, e.g. tokens in the batch)")
    return 2 * max(terms - 1, 1) * UNIT_ROUNDOFF[precision]


def _series(run, name: str) -> list[float]:
    """The per-step values of a TrainResult-like object (train_losses / grad_norms), a dict
    ({"losses": ..., "grad_norms": ...}) or a plain list (losses only)."""
    if isinstance(run, dict):
        return [float(v) for v in run.get(name, [])]
    if isinstance(run, (list, tuple)):
        return [float(v) for v in run] if name == "losses" else []
    attr = {"losses": "train_losses", "grad_norms": "grad_norms"}[name]
    return [float(v) for v in getattr(run, attr, [])]


@dataclass(frozen=True)
class ParityReport:
    """The comparison, step by step; `first_step` is None when every step is within tolerance."""

    steps: int
    precision: str
    rtol: float  # first step's relative tolerance, 2 (terms - 1) u
    atol: float
    first_step: int | None = None  # 1-based
    quantity: str | None = None  # "loss" or "grad_norm"
    got: float = math.nan
    expected: float = math.nan
    tolerance: float = math.nan
    max_loss_diff: float = 0.0
    max_norm_diff: float = 0.0

    @property
    def ok(self) -> bool:
        return self.first_step is None

    @property
    def difference(self) -> float:
        return abs(self.got - self.expected) if not self.ok else 0.0

    def __str__(self) -> str:
        if self.ok:
            return (f"parity holds over {self.steps} steps ({self.precision}: step k within k x {self.rtol:.1e} "
                    f"relative + {self.atol:.1e}); largest |loss difference| {self.max_loss_diff:.1e}, "
                    f"|grad-norm difference| {self.max_norm_diff:.1e}")
        return (f"departs at step {self.first_step}: {self.quantity} {self.got:.6g} against {self.expected:.6g} "
                f"(|difference| {self.difference:.2e} > tolerance {self.tolerance:.1e})")


def loss_parity(run, reference, precision: str = "fp32", terms: int = 1, atol: float = 0.0) -> ParityReport:
    """Compare `run` with `reference` step by step: losses, then gradient norms where both
    recorded them. Step k passes when |a - b| <= k * parity_rtol(precision, terms) * |b| + atol
    (a non-finite value never passes). Returns a ParityReport naming the first step that departs."""
    rtol = parity_rtol(precision, terms)
    if not (isinstance(atol, (int, float)) and atol >= 0):
        raise ValueError(f"atol={atol!r} must be a number >= 0")
    losses, ref_losses = _series(run, "losses"), _series(reference, "losses")
    if not losses or len(losses) != len(ref_losses):
        raise ValueError(f"the run has {len(losses)} losses and the reference {len(ref_losses)}: compare runs of "
                         f"the same number (>= 1) of steps")
    norms, ref_norms = _series(run, "grad_norms"), _series(reference, "grad_norms")
    compare_norms = len(norms) == len(ref_norms) == len(losses)
    first = None
    diffs = {"loss": 0.0, "grad_norm": 0.0}
    for k in range(1, len(losses) + 1):
        pairs = [("loss", losses[k - 1], ref_losses[k - 1])]
        if compare_norms:
            pairs.append(("grad_norm", norms[k - 1], ref_norms[k - 1]))
        for quantity, a, b in pairs:
            tol = k * rtol * abs(b) + atol
            diff = abs(a - b)
            if math.isfinite(diff):
                diffs[quantity] = max(diffs[quantity], diff)
            if first is None and not (math.isfinite(a) and math.isfinite(b) and diff <= tol):
                first = (k, quantity, a, b, tol)
    common = dict(steps=len(losses), precision=precision, rtol=rtol, atol=float(atol),
                  max_loss_diff=diffs["loss"], max_norm_diff=diffs["grad_norm"])
    if first is None:
        return ParityReport(**common)
    k, quantity, a, b, tol = first
    return ParityReport(**common, first_step=k, quantity=quantity, got=a, expected=b, tolerance=tol)
