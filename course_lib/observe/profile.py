"""Profiling any course strategy: a Chrome/Perfetto trace per rank, the timeline read back from
it, and MFU (notebook 10).

    profile_on_ranks(train_fn, *args, world_size, out_dir)   run train_fn on the ranks under
                                   torch.profiler; rank r writes out_dir/rank{r}.json
    trace_timeline(path)           the trace's top-level CPU ops and its collectives as
                                   Timeline events [(name, start, end, category)], for plot_gantt
    mfu(flops, seconds, n_devices, peak_flops)
    step_mfu(result, flops_per_step, n_devices, peak_flops)   per step of a TrainResult

The traces open in https://ui.perfetto.dev or chrome://tracing. trace_timeline keeps, on each
thread, the ops not nested inside another op (what the thread was doing at each moment) and
the outermost collectives, labelled "communication" (collectives, send/recv: names holding gloo/c10d/all_reduce/...),
"backward" (autograd's engine and its ops) or "compute".

MFU (model FLOPs utilisation, Chowdhery et al. 2022) = model FLOPs per second / peak FLOP/s,
the model FLOPs counted once (recomputation excluded), so a layout cannot raise its MFU by
doing extra work.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

COMM_MARKERS = ("gloo", "c10d", "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "broadcast", "all_to_all", "alltoall", "send", "recv", "barrier")


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


def _profiled(train_fn, out_dir, args, kwargs):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
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
    activity: on GPUs the CUDA kernels appear inside the same trace when the profiler is given
    ProfilerActivity.CUDA). Returns (results in rank order, trace paths in rank order).
    run_on_ranks' own options (backend, check_collectives) pass through kwargs."""
    from course_lib._validate import check_int
    from course_lib.runtime import run_on_ranks

    check_int("world_size", world_size)
    if not callable(train_fn):
        raise ValueError(f"train_fn={train_fn!r} must be a callable rank function (e.g. train_data_parallel)")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_kw = {k: kwargs.pop(k) for k in ("backend", "check_collectives") if k in kwargs}
    out = run_on_ranks(_profiled, train_fn, str(out_dir), args, kwargs, world_size=world_size,
                       timeout_s=timeout_s, **run_kw)
    return [r for r, _ in out], [p for _, p in out]


def classify(name: str) -> str:
    low = name.lower()
    if any(m in low for m in COMM_MARKERS):
        return "communication"
    if "backward" in low or low.startswith("autograd::engine"):
        return "backward"
    return "compute"


def trace_timeline(path, min_seconds: float = 0.0) -> list[tuple[str, float, float, str]]:
    """Complete events ("ph": "X") of a Chrome trace as (name, start_s, end_s, category), sorted
    by start: on each thread the top-level ops, plus every collective even when nested inside
    one (DDP's all-reduce runs inside a backward op), so it is drawn over it. Events shorter
    than min_seconds are dropped."""
    data = json.loads(pathlib.Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_thread: dict = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in ("cpu_op", "user_annotation", None):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        top_end = comm_end = float("-inf")
        for e in evs:
            end, category = e["ts"] + e["dur"], classify(e["name"])
            keep = False
            if e["ts"] >= top_end:  # not nested in the previous top-level op
                top_end, keep = end, True
            if category == "communication" and e["ts"] >= comm_end:  # the outermost collective
                comm_end, keep = end, True
            if keep and e["dur"] * 1e-6 >= min_seconds:
                out.append((e["name"], e["ts"] * 1e-6, end * 1e-6, category))
    if not out:
        raise ValueError(f"{path}: no complete CPU events in this trace")
    return sorted(out, key=lambda e: e[1])


def mfu(flops: float, seconds: float, n_devices: int, peak_flops: float) -> float:
    """flops / seconds / (n_devices * peak_flops)."""
    for name, value in (("flops", flops), ("seconds", seconds), ("peak_flops", peak_flops)):
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices={n_devices!r} must be a positive int")
    return flops / seconds / (n_devices * peak_flops)


def step_mfu(result, flops_per_step: float, n_devices: int, peak_flops: float) -> list[float]:
    """MFU of every step of a TrainResult (its step_seconds), e.g. flops_per_step =
    course_lib.estimate.flops_per_token(config, seq) * batch * seq."""
    if not result.step_seconds:
        raise ValueError("the result has no step_seconds")
    return [mfu(flops_per_step, s, n_devices, peak_flops) for s in result.step_seconds]
