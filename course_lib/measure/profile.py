"""Profiling any course strategy on real ranks (notebook 11): a Chrome/Perfetto trace per rank.

    profile_on_ranks(train_fn, *args, world_size, out_dir)   run train_fn on the ranks under
                                   torch.profiler; rank r writes out_dir/rank{r}.json
    profiler_activities(device)    what the profiler records on ranks computing on `device`:
                                   the CPU always, CUDA's kernels too on a GPU

Reading a trace back (its timeline, MFU) is course_lib.observe.profile: pure functions of the
files written here.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from course_lib._validate import check_int
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device


@contextlib.contextmanager
def _quiet_native_stderr():
    """Send the process's file descriptor 2 to /dev/null for the block: the profiler's native
    library prints a log line there when a trace starts and when it stops, below Python."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profiler_activities(device) -> list:
    """[CPU] on CPU ranks; [CPU, CUDA] on a GPU rank, so the trace holds the kernels and their
    device times, not only the CPU ops that launched them (which return before the work runs)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])


def _profiled(train_fn, out_dir, args, kwargs):
    rank = dist.get_rank()
    prof = profile(activities=profiler_activities(rank_device()), record_shapes=False)
    with _quiet_native_stderr():
        prof.start()
    try:
        result = train_fn(*args, **kwargs)
    finally:
        with _quiet_native_stderr():
            prof.stop()
    path = pathlib.Path(out_dir) / f"rank{rank}.json"
    prof.export_chrome_trace(str(path))
    return result, str(path)


def profile_on_ranks(train_fn, *args, world_size: int, out_dir, timeout_s: float = 120, **kwargs):
    """Run train_fn(*args, **kwargs) on `world_size` ranks, each under torch.profiler (CPU
    activity, and on GPU ranks CUDA's too: the kernels appear in the same trace, on the
    device's rows). Returns (results in rank order, trace paths in rank order).
    run_on_ranks' own options (backend, check_collectives) pass through kwargs."""
    check_int("world_size", world_size)
    if not callable(train_fn):
        raise ValueError(f"train_fn={train_fn!r} must be a callable rank function (e.g. train_data_parallel)")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_kw = {k: kwargs.pop(k) for k in ("backend", "check_collectives") if k in kwargs}
    out = run_on_ranks(_profiled, train_fn, str(out_dir), args, kwargs, world_size=world_size,
                       timeout_s=timeout_s, **run_kw)
    return [r for r, _ in out], [p for _, p in out]
