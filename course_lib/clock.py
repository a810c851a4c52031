"""The one device-aware clock every course timer reads (timelines, the tracer, the pipeline's
spans and bubble, DDP's buckets, the alpha-beta measurements).

    synchronize(device)   wait for the work queued on a GPU; nothing on the CPU
    now(device)           synchronize(device), then time.perf_counter()
    device_of(tensors)    the device of the first tensor in a (nested) argument, or None

CUDA calls return when the kernel is queued, not when it has run: a clock read right after one
times the launch. So on a GPU the clock waits for the device before it reads perf_counter, at
both ends of a span. On the CPU there is nothing to wait for and `now` is perf_counter itself,
so CPU timings are exactly what they were.

Why a wait at each span boundary and not CUDA events resolved at the end of the step: a span's
times stay perf_counter values, the one system-wide monotonic clock the Gantt chart merges
across rank processes, and every reader (Timeline.events, a CommRecord, measured_bubble) can
use them the moment the span closes. Events measure intervals on one device only: each rank
would need an anchor event tied to perf_counter and a resolve step before any reader, and an
event on the compute stream does not see a collective still running on NCCL's stream. The
wait's cost (a host stall per boundary, and no running ahead of the GPU inside a timed step)
is paid only where something is timed: a step without a Timeline or tracer is untouched, and
callers leave the waits out where they would hide an overlap they mean to show (an async
collective's launch, a DDP bucket's launch).

device: a torch.device or its name; None means "this process's current GPU if it has started
CUDA, else nothing", so a timer whose caller did not say where the ranks run still waits on a
GPU rank and never on a CPU one (a process that never touched CUDA has nothing queued there).
Torch is imported when first needed: the estimator imports course_lib.comm.costmodel, which
imports this module, where torch is not installed.
"""

from __future__ import annotations

import sys
import time


def _cuda_device(device):
    """The CUDA device a clock must wait for, or None (CPU, meta, or no CUDA started)."""
    if device is None:
        torch = sys.modules.get("torch")  # not imported: nothing can be queued on a GPU
        if torch is None or not torch.cuda.is_initialized():
            return None
        return torch.device("cuda", torch.cuda.current_device())
    import torch

    device = torch.device(device)
    return device if device.type == "cuda" else None


def synchronize(device=None) -> None:
    """Wait for the work queued on a GPU: CUDA calls return at launch, so a clock read without
    this times the launch, not the work. Nothing to wait for on the CPU."""
    cuda = _cuda_device(device)
    if cuda is not None:
        import torch

        torch.cuda.synchronize(cuda)


def now(device=None) -> float:
    """time.perf_counter() once the device's queued work is done (see the module docstring)."""
    synchronize(device)
    return time.perf_counter()


def device_of(value):
    """The device of the first tensor in value (a tensor, or lists/tuples of them), else None."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return getattr(value, "device", None) if hasattr(value, "data_ptr") else None
