"""What every torchrun demo does around its run: refuse a bad layout before any rank waits, and
with --check compare its losses with the single process's, step by step, against a tolerance.

    refuse(name, err, rank)                   one line on rank 0's stderr; the exit status 2
    compare_losses(ours, reference, tol)      the per-step table and the verdict; exit 0 or 1

The verdict line is what an instructor reads and what the tests match: "largest difference
<d> (tolerance <t>): OK" or "... MISMATCH". A NaN loss counts as the largest difference.
"""

from __future__ import annotations

import math
import sys


def refuse(name: str, err: Exception, rank: int) -> int:
    """A layout refused before the process group starts: every rank returns 2, rank 0 says why."""
    if rank == 0:
        print(f"{name}: bad layout: {err}", file=sys.stderr, flush=True)
    return 2


def compare_losses(ours, reference, tolerance: float) -> int:
    """Print each step's loss beside the single process's and the verdict; 0 when every step is
    within `tolerance`, else 1."""
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, reference), start=1):
        diff = abs(a - b)
        worst = math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)
        print(f"step {step}  loss {a:.6f}  single process {b:.6f}  |diff| {diff:.2e}")
    ok = not math.isnan(worst) and worst <= tolerance
    print(f"largest difference {worst:.2e} (tolerance {tolerance:.1e}): {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1
