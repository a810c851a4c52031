"""Reading a profile of any course strategy: the timeline from a Chrome/Perfetto trace, and MFU
(notebook 11). The traces come from course_lib.measure.profile.profile_on_ranks (each rank
under torch.profiler writes out_dir/rank{r}.json).

    trace_timeline(path)           the trace's top-level CPU ops, its collectives and (GPU ranks)
                                   its kernels as Timeline events [(name, start, end, category)]
    mfu(flops, seconds, n_devices, peak_flops)
    step_mfu(result, flops_per_step, n_devices, peak_flops)   per step of a TrainResult

The traces open in https://ui.perfetto.dev or chrome://tracing. trace_timeline keeps, on each
thread, the ops not nested inside another op (what the thread was doing at each moment) and
the outermost collectives, labelled "communication" (collectives, send/recv: names holding gloo/c10d/all_reduce/...),
"backward" (autograd's engine and its ops) or "compute". A GPU rank's trace (profiled with
ProfilerActivity.CUDA) also holds the kernels on each CUDA stream, with their device times:
they are kept the same way, on rows of their own (NCCL's kernels are "communication").

MFU (model FLOPs utilisation, Chowdhery et al. 2022) = model FLOPs per second / peak FLOP/s,
the model FLOPs counted once (recomputation excluded), so a layout cannot raise its MFU by
doing extra work.
"""

from __future__ import annotations

import json
import pathlib

from course_lib._validate import check_int

COMM_MARKERS = ("gloo", "c10d", "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "broadcast", "all_to_all", "alltoall", "send", "recv", "barrier")


# Chrome-trace categories kept: CPU ops and annotations, and on GPU ranks the device's kernels and copies
KEPT_CATEGORIES = ("cpu_op", "user_annotation", None, "kernel", "gpu_memcpy", "gpu_memset")


def classify(name: str) -> str:
    low = name.lower()
    if any(m in low for m in COMM_MARKERS):
        return "communication"
    if "backward" in low or low.startswith("autograd::engine"):
        return "backward"
    return "compute"


def trace_timeline(path, min_seconds: float = 0.0) -> list[tuple[str, float, float, str]]:
    """Complete events ("ph": "X") of a Chrome trace as (name, start_s, end_s, category), sorted
    by start: on each thread (each CUDA stream) the top-level ops, plus every collective even
    when nested inside one (DDP's all-reduce runs inside a backward op), so it is drawn over it. Events shorter
    than min_seconds are dropped."""
    data = json.loads(pathlib.Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_thread: dict = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in KEPT_CATEGORIES:
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
    check_int("n_devices", n_devices)
    return flops / seconds / (n_devices * peak_flops)


def step_mfu(result, flops_per_step: float, n_devices: int, peak_flops: float) -> list[float]:
    """MFU of every step of a TrainResult (its step_seconds), e.g. flops_per_step =
    course_lib.estimate.flops_per_token(config, seq) * batch * seq."""
    if not result.step_seconds:
        raise ValueError("the result has no step_seconds")
    return [mfu(flops_per_step, s, n_devices, peak_flops) for s in result.step_seconds]
