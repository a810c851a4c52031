"""Run a command beside CPU-bound processes: the suite as a learner's busy laptop runs it.

    python tools/under_load.py [--procs 2] [--limit-s 5400] -- COMMAND ...

Starts --procs processes that each keep one core busy (a tight arithmetic loop, no I/O, no
memory), runs COMMAND, stops them, and exits with COMMAND's exit status. `make test-under-load`
runs the library's tests this way: a test that passes alone and fails here waits on a time or
races another process, and is fixed at that cause (CONTRIBUTING.md, "Flakes are bugs").

The load never outlives the command: each load process ends by itself after --limit-s seconds
even if this script is killed without running its clean-up, and it ends when its parent dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def burn(limit_s: float, parent: int) -> None:
    """Keep one core busy until limit_s has passed or the parent process is gone."""
    end = time.monotonic() + limit_s
    x = 0
    while time.monotonic() < end and os.getppid() == parent:
        for _ in range(200_000):  # ~10 ms of work between the checks
            x = (x * 1_103_515_245 + 12_345) & 0xFFFFFFFF


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="CPU-bound processes beside the command")
    parser.add_argument("--limit-s", type=float, default=5400, help="each load process ends after this long")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python tools/under_load.py -- COMMAND ...")
    if args.procs < 0:
        parser.error(f"--procs={args.procs} must be >= 0")
    if args.limit_s <= 0:
        parser.error(f"--limit-s={args.limit_s} must be > 0")
    me = os.getpid()
    loads = []
    for _ in range(args.procs):
        pid = os.fork()
        if pid == 0:  # the load process: no Python-level clean-up of the parent's state
            try:
                burn(args.limit_s, me)
            finally:
                os._exit(0)
        loads.append(pid)
    print(f"under_load: {args.procs} CPU-bound process(es) beside `{' '.join(command)}` "
          f"on {os.cpu_count()} cores", flush=True)
    try:
        return subprocess.call(command)
    finally:
        for pid in loads:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


if __name__ == "__main__":
    sys.exit(main())
