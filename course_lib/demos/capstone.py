"""The capstone under torchrun: train a 3D layout, save, lose ranks, resume at another world size.

    # steps 1..checkpoint_step at [layout] (dp*tp*pp*ep = 8 ranks), saved under --checkpoint-dir;
    # then rank 3 dies (SIGKILL, no clean-up) at the start of the next step: torchrun stops the job
    torchrun --standalone --nproc-per-node 8 -m course_lib.demos.capstone \\
        --config configs/capstone_tiny.toml --checkpoint-dir /tmp/capstone --kill-rank 3
    # the rest at [resume] (4 ranks): loads the checkpoint resharded; --check compares the whole
    # loss curve with the single process on the same batches, same precision and recomputation
    # (exit 1 beyond the precision's tolerance: course_lib.capstone.TOLERANCE), and the first
    # step's gradient norm (saved in the checkpoint) within course_lib.tolerances'
    # FIRST_GRAD_NORM_RTOL: in bf16 a wrong reduction can stay inside the loss tolerance
    torchrun --standalone --nproc-per-node 4 -m course_lib.demos.capstone \\
        --config configs/capstone_tiny.toml --checkpoint-dir /tmp/capstone --resume --check

The config file (TOML, one key per degree, documented in configs/capstone_tiny.toml; an MoE
run in configs/capstone_moe.toml) is read and checked by every process before the process
group starts: a bad key, value or layout (also one whose dp*tp*pp*ep differs from
--nproc-per-node) exits with code 2 and one line naming the key,
printed by rank 0. gloo on CPU, NCCL on GPUs (course_lib.runtime.launch.init_from_env).
"""

from __future__ import annotations

import argparse
import os
import sys

from course_lib.capstone import load_config, train_segment
from course_lib.dims import product_text
from course_lib.parallel.hybrid import train_single
from course_lib.platform import kill_self_hard
from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.tolerances import first_grad_norm_check


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="TOML file (see configs/capstone_tiny.toml)")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--resume", action="store_true", help="run the steps after checkpoint_step at [resume]")
    p.add_argument("--check", action="store_true", help="with --resume: compare with the single process")
    p.add_argument("--kill-rank", type=int, help="without --resume: this rank SIGKILLs itself after the save")
    args = p.parse_args(argv)
    if args.kill_rank is not None and args.resume:
        p.error("--kill-rank belongs to the first run (without --resume)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    section = "resume" if args.resume else "layout"
    try:
        config = load_config(args.config)
        dims = config.resume if args.resume else config.layout
        if dims.world_size != world:
            degrees = {d: getattr(dims, d) for d in ("dp", "tp", "pp", "ep", "cp")}
            raise ValueError(f"[{section}] {product_text(degrees)} must equal the number of processes "
                             f"(WORLD_SIZE={world})")
        if args.kill_rank is not None and not 0 <= args.kill_rank < world:
            raise ValueError(f"--kill-rank={args.kill_rank} must be in [0, WORLD_SIZE={world})")
    except ValueError as err:  # before any rank waits: one clear line, no traceback
        if rank == 0:
            print(f"capstone: bad config: {err}", file=sys.stderr, flush=True)
        return 2

    first, last = (config.checkpoint_step + 1, config.train.steps) if args.resume else (1, config.checkpoint_step)
    backend = init_from_env()
    try:
        result = train_segment(dims, config.model, config.train, args.checkpoint_dir, first, last,
                               trace=not args.resume, progress=True)
        if rank == args.kill_rank:  # like a GPU falling off the bus: no clean-up, peers left waiting
            print(f"rank {rank}: killed at the start of step {last + 1}", flush=True)
            kill_self_hard()
    finally:
        leave_process_group()
    if rank != 0:
        return 0
    print(f"capstone on {world} ranks ({backend}): {dims.describe()} ({dims.world_size} ranks), "
          f"steps {first}..{last}, "
          f"{'resumed from step ' + str(first - 1) if args.resume else 'saved at step ' + str(last)}", flush=True)
    for dim, t in result.traffic.items():
        print(f"traffic {dim}: {t['calls']} calls, {t['bytes_sent']} bytes sent by rank 0")
    if not args.check:
        for step, loss in enumerate(result.train_losses, start=1):
            print(f"step {step}  loss {loss:.6f}")
        return 0

    reference = train_single(config.model, config.train, config.precision, config.recompute)
    ok, lines = check_run(result, reference, config.precision, config.tolerance)
    print("\n".join(lines), flush=True)
    return 0 if ok else 1


def check_run(result, reference, precision: str, tolerance: float) -> tuple[bool, list[str]]:
    """(passed, the lines to print): every step's loss within `tolerance` of the single process's
    (config.tolerance), and the first step's gradient norm within FIRST_GRAD_NORM_RTOL[precision]
    (course_lib.tolerances; skipped, and said so, when the run has no step 1 norm, e.g. no clipping)."""
    losses, ref = result.train_losses, reference.train_losses
    lines = [f"step {step}  loss {a:.6f}  single process {b:.6f}  |diff| {abs(a - b):.2e}"
             for step, (a, b) in enumerate(zip(losses, ref), start=1)]
    diffs = [abs(a - b) for a, b in zip(losses, ref)]
    worst = max(diffs) if all(d == d for d in diffs) else float("nan")  # a NaN loss is the largest difference
    loss_ok = len(losses) == len(ref) and worst <= tolerance
    lines.append(f"largest difference {worst:.2e} (tolerance {tolerance:.0e}): {'OK' if loss_ok else 'MISMATCH'}")
    if not (len(result.grad_norms) == len(losses) and reference.grad_norms):  # step 1's norm is the first
        lines.append("first gradient norm: not recorded (no clipping, or a checkpoint saved without it)")
        return loss_ok, lines
    norm_ok, rel, rtol = first_grad_norm_check(result.grad_norms[0], reference.grad_norms[0], precision)
    lines.append(f"first gradient norm {result.grad_norms[0]:.6g}, single process {reference.grad_norms[0]:.6g}: "
                 f"relative difference {rel:.2e} (tolerance {rtol:.1e}): {'OK' if norm_ok else 'MISMATCH'}")
    return loss_ok and norm_ok, lines


if __name__ == "__main__":
    sys.exit(main())
