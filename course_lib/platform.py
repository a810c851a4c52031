"""Where the course's code depends on the operating system: every such choice, made once, here.

Torch-free and tiny. The course is tested on Linux x86_64 (README, "Where it runs"); each choice
below says what it does on Linux, what it does elsewhere, and why.

* how rank processes start: `start_method()` (forkserver where the platform has it, else spawn);
* how many cores this process may use: `usable_cores()` (its CPU affinity where the platform
  reports one, else every core);
* the unit of `ru_maxrss`: `RU_MAXRSS_BYTES` (KiB on Linux, bytes on macOS) and `peak_rss_bytes()`
  (None where there is no `resource` module: Windows);
* how a rank dies without clean-up in the killed-rank lessons: `HARD_KILL` and `kill_self_hard()`;
* the address ranks rendezvous on in one machine: `LOOPBACK`.

Which backend and device a rank uses is a choice about the hardware, not the operating system:
`course_lib.runtime.device` makes it. Which torch build is installed: `tools/install_torch.py`.
"""

from __future__ import annotations

import os
import signal
import sys

# The ranks of `run_on_ranks` are processes on this machine that meet over TCP on the loopback
# interface (gloo), which every platform has under this name.
LOOPBACK = "127.0.0.1"

# forkserver first: one server process imports torch once and every rank is a fork of it, so 8
# ranks on a 2-core laptop cost one torch import, not eight (the server runs no torch ops and no
# threads, so forking it is safe). Linux and macOS have it (macOS's default is spawn, Python
# 3.8+); Windows has only spawn, where each rank imports torch itself.
PREFERRED_START_METHODS = ("forkserver", "spawn")


def start_method(available=None) -> str:
    """The multiprocessing start method for rank processes: the first of PREFERRED_START_METHODS
    this platform has (`available`: the platform's list, multiprocessing's by default)."""
    if available is None:
        import multiprocessing  # here, not at the top: estimate/ imports nothing that starts processes

        available = multiprocessing.get_all_start_methods()
    have = available
    for method in PREFERRED_START_METHODS:
        if method in have:
            return method
    raise RuntimeError(f"no start method of {PREFERRED_START_METHODS} on this platform (it has {list(have)})")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (Linux: a container or `taskset` can
    give it fewer than the machine has), else every core (macOS and Windows report no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# getrusage's ru_maxrss counts KiB on Linux (getrusage(2): "in kilobytes", i.e. units of 1024
# bytes) and bytes on macOS (XNU stores the resident size times the page size): bytes per unit.
RU_MAXRSS_BYTES = 1 if sys.platform == "darwin" else 1024


def peak_rss_bytes() -> int | None:
    """Peak resident memory of this process so far, in bytes; None where Python has no
    `resource` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_BYTES


# A rank that dies with no clean-up at all (no atexit, no finally, no flushed buffers), as a
# machine that loses power would: SIGKILL on POSIX. Windows has no SIGKILL, but there os.kill with
# any signal other than the two console events ends the process through TerminateProcess, which
# is as abrupt (Python's documentation of os.kill).
HARD_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)


def kill_self_hard() -> None:
    """End this process at once, with no clean-up (HARD_KILL)."""
    os.kill(os.getpid(), HARD_KILL)
