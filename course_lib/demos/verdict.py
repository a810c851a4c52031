"""What every torchrun demo does around its run: refuse a bad layout before any rank waits, and
with --check compare its losses with the single process's, step by step, against a tolerance.

    run_demo(name, args, build, train, report)  torchrun's world and rank, build (refused before
                                              the process group starts), train in it, report on rank 0
    refuse(name, err, rank)                   one line on rank 0's stderr; the exit status 2
    losses_or_check(args, losses, reference)  each step's loss, or with --check the verdict
    compare_losses(ours, reference, tol)      the per-step table and the verdict; exit 0 or 1

The verdict line is what an instructor reads and what the tests match: "largest difference
<d> (tolerance <t>): OK" or "... MISMATCH". A NaN loss counts as the largest difference.
"""

from __future__ import annotations

import math
import os
import sys

from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.tolerances import adamw_loss_atol


def run_demo(name: str, args, build, train, report) -> int:
    """One torchrun demo from its parsed `args`: build(args, world_size) -> a tuple, whose
    ValueError is refused before the process group starts (refuse); train(*built) inside the
    process group; then report(world_size, backend, built, result) -> the exit status, on rank 0.
    Every other rank returns 0."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        built = build(args, world)
    except ValueError as err:  # before any rank waits: one clear line, no traceback
        return refuse(name, err, rank)
    backend = init_from_env()
    try:
        result = train(*built)
    finally:
        leave_process_group()
    return report(world, backend, built, result) if rank == 0 else 0


def losses_or_check(args, losses, reference) -> int:
    """Without --check, each step's loss (from step 1); with it, compare_losses against
    reference() (the single process's TrainResult) within --tolerance, by default the AdamW
    bound of --lr (course_lib.tolerances.adamw_loss_atol)."""
    if not args.check:
        for step, loss in enumerate(losses, start=1):
            print(f"step {step}  loss {loss:.6f}")
        return 0
    tolerance = adamw_loss_atol(args.lr) if args.tolerance is None else args.tolerance
    return compare_losses(losses, reference().train_losses, tolerance)


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
