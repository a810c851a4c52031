"""Run one entry of the catalogue of broken runs (course_lib.debugging) under torchrun.

    torchrun --nproc-per-node 2 -m course_lib.demos.broken_run --bug skip_collective \\
             --timeout 10 --flight-recorder /tmp/fr
    python -m course_lib.observe.flight_recorder /tmp/fr        where the ranks diverged, culprit first
    torchrun --nproc-per-node 2 -m course_lib.demos.broken_run --bug skip_collective --fixed

Every rank runs the entry inside a flight recorder writing to DIR: a rank stuck in a call for
--timeout / 2 seconds writes DIR/rank_<r>.json, a rank that finishes writes its file on leaving.
After --timeout seconds without a result, each rank says so and exits with status 1 (torchrun
then reports the failure): nothing hangs longer than that. A finished run is compared with the
single process on rank 0; the exit status is 0 when it matches, 1 when the bug shows.
--rank R picks the rank that carries the bug (entries that have one). Bad arguments are refused
on every rank before any rank joins the group.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading

import torch.distributed as dist

from course_lib.comm.process_groups import new_groups
from course_lib.debugging.catalogue import BUG_NAMES, check_bug
from course_lib.observe.flight_recorder import FlightRecorder
from course_lib.runtime.launch import init_from_env, leave_process_group


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", required=True, help=f"one of {', '.join(BUG_NAMES)}")
    parser.add_argument("--rank", type=int, default=None, help="the rank that carries the bug")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a stuck run gives up")
    parser.add_argument("--flight-recorder", default=None, metavar="DIR", help="where the ranks write their dumps")
    parser.add_argument("--fixed", action="store_true", help="run the mended twin")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:  # before joining the group: every rank refuses at once, nobody waits
        bug, world, bad_rank = check_bug(args.bug, args.rank, world)
    except ValueError as e:
        parser.error(str(e))
    if not args.timeout > 0:
        parser.error(f"--timeout={args.timeout:g} must be > 0 seconds")
    return args, bug, world, bad_rank


def _give_up(rank: int, timeout: float, recorder) -> None:
    """The rank's watchdog: no result within --timeout. The recorder may have dumped already (a
    call stuck for timeout / 2); it dumps again now, so the file shows where the rank is when it
    gives up, then the rank leaves."""
    where = ""
    if recorder is not None:
        path = recorder.dump()
        where = f"; its flight recorder is in {path}"
    print(f"rank {rank}: no result within --timeout {timeout:g} s{where}", file=sys.stderr, flush=True)
    os._exit(1)  # the process group cannot be left cleanly while a peer is stuck


def main(argv=None) -> int:
    args, bug, world, bad_rank = _parse(argv)
    # The process group's own timeout is far above --timeout: this demo's watchdog decides.
    init_from_env(timeout_s=max(300.0, 10 * args.timeout))
    rank = dist.get_rank()
    (results_group,) = new_groups([range(world)])  # its own channel: never crosses a stuck call
    recorder = FlightRecorder(args.flight_recorder, stuck_after_s=args.timeout / 2) if args.flight_recorder else None
    watchdog = threading.Timer(args.timeout, _give_up, (rank, args.timeout, recorder))
    watchdog.daemon = True
    watchdog.start()
    try:
        with recorder if recorder is not None else contextlib.nullcontext():
            mine = bug.rank_fn(args.fixed, bad_rank)
        results = [None] * world
        dist.all_gather_object(results, mine, group=results_group)
        matches = True
        if rank == 0:
            evidence = bug.evidence(results, bug.expected(world, bad_rank), world, bad_rank)
            which = "mended twin" if args.fixed else "bug"
            verdict = "matches" if evidence.matches else "differs from"
            print(f"{bug.name} ({which}) on {world} ranks finished and {verdict} the single process: "
                  f"{evidence.text}", flush=True)
            matches = evidence.matches
        watchdog.cancel()
    finally:
        leave_process_group()
    return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main())
