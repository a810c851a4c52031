"""CommTracer: see every collective and point-to-point call a rank makes, and its bytes.

Use it inside rank code:

    with CommTracer() as tracer:
        dist.all_reduce(t)
        dist.send(x, dst=1)
    tracer.summary()   # {"all_reduce": {"calls": 1, "bytes_sent": S, "bytes_recv": S},
                       #  "send": {"calls": 1, "bytes_sent": X, "bytes_recv": 0}}

How it works: while a tracer is active, it is a layer of the course's one patching engine
(`course_lib.observe.patching`): the public functions of `torch.distributed` (all_reduce,
send, ...) run through it, and it records a `CommRecord` around the real call. Code that calls `dist.<op>` is seen; collectives issued from C++
(torch's DistributedDataParallel reducer, DTensor/FSDP2 functional collectives) are not.

What the byte counts mean (S = numel * element_size of the tensor named):
  * point-to-point (send, recv, isend, irecv, and each op of batch_isend_irecv):
    the bytes this rank really sent or received. The course's own collectives in
    `course_lib.comm` are built from these, so their wire traffic is counted exactly.
  * built-in collectives: the logical payload, because the backend's algorithm (and so
    its wire traffic) is invisible from Python. bytes_sent = bytes of this rank's input
    buffer(s), bytes_recv = bytes of its output buffer(s); buffers a rank does not have
    count 0 (e.g. broadcast: the source "sends" S, every other rank "receives" S;
    all_reduce: S and S; all_gather: S and N*S; reduce_scatter: N*S_out and S_out).
  * duration: wall time of the call. A blocking call on a GPU tensor is timed on the course's
    device-aware clock (course_lib.clock.now, from the device of the call's tensor): the device
    is waited for before and after, so the time is the transfer, not its launch. For async
    calls (isend, irecv, batch_isend_irecv, async_op=True) it is only the launch, with no wait
    (a wait would finish the transfer the caller meant to overlap); wait on the returned work
    inside a `Timeline.span` to time it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.clock import device_of, now
from course_lib.observe import patching


@dataclass
class CommRecord:
    op: str
    group_ranks: tuple[int, ...]  # global ranks of the group the call ran on
    dtype: str
    numel: int
    bytes_sent: int
    bytes_recv: int
    peer: int | None
    start: float  # time.perf_counter(), comparable across processes on one machine
    end: float


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _numel(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_numel(x) for x in t)
    return 0 if t is None else t.numel()


def _first_tensor(t):
    while isinstance(t, (list, tuple)) and t:
        t = t[0]
    return t if isinstance(t, torch.Tensor) else None


def _is_me(global_rank) -> bool:
    return global_rank is not None and global_rank == dist.get_rank()


# For each traced op: (argument naming the main tensor, function(args) -> (sent, recv, peer)).
# `a` is the call's bound arguments with defaults applied.
_ACCOUNTING = {
    "all_reduce": ("tensor", lambda a: (_nbytes(a["tensor"]), _nbytes(a["tensor"]), None)),
    "reduce": ("tensor", lambda a: (_nbytes(a["tensor"]), _nbytes(a["tensor"]) if _is_me(a["dst"]) else 0, None)),
    "broadcast": ("tensor", lambda a: (_nbytes(a["tensor"]) if _is_me(a["src"]) else 0,
                                       0 if _is_me(a["src"]) else _nbytes(a["tensor"]), None)),
    "all_gather": ("tensor", lambda a: (_nbytes(a["tensor"]), _nbytes(a["tensor_list"]), None)),
    "all_gather_into_tensor": ("input_tensor", lambda a: (_nbytes(a["input_tensor"]), _nbytes(a["output_tensor"]), None)),
    "all_gather_single": ("input_tensor", lambda a: (_nbytes(a["input_tensor"]), _nbytes(a["output_tensor"]), None)),
    "reduce_scatter_single": ("output", lambda a: (_nbytes(a["input"]), _nbytes(a["output"]), None)),
    "reduce_scatter": ("output", lambda a: (_nbytes(a["input_list"]), _nbytes(a["output"]), None)),
    "reduce_scatter_tensor": ("output", lambda a: (_nbytes(a["input"]), _nbytes(a["output"]), None)),
    "all_to_all": ("input_tensor_list", lambda a: (_nbytes(a["input_tensor_list"]), _nbytes(a["output_tensor_list"]), None)),
    "all_to_all_single": ("input", lambda a: (_nbytes(a["input"]), _nbytes(a["output"]), None)),
    "gather": ("tensor", lambda a: (_nbytes(a["tensor"]), _nbytes(a["gather_list"]) if _is_me(a["dst"]) else 0, None)),
    "scatter": ("tensor", lambda a: (_nbytes(a["scatter_list"]) if _is_me(a["src"]) else 0, _nbytes(a["tensor"]), None)),
    "barrier": (None, lambda a: (0, 0, None)),
    "send": ("tensor", lambda a: (_nbytes(a["tensor"]), 0, a["dst"])),
    "isend": ("tensor", lambda a: (_nbytes(a["tensor"]), 0, a["dst"])),
    "recv": ("tensor", lambda a: (0, _nbytes(a["tensor"]), a["src"])),
    "irecv": ("tensor", lambda a: (0, _nbytes(a["tensor"]), a["src"])),
}

ASYNC = frozenset({"isend", "irecv", "batch_isend_irecv"})  # return work to wait on: timed at launch

_active: list["CommTracer"] = []  # tracers currently recording on this process


def _group_ranks(group) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _record(rec: CommRecord):
    for tracer in _active:
        tracer.records.append(rec)
        if tracer.timeline is not None:
            tracer.timeline.add(rec.op, rec.start, rec.end, category="comm")


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "") if t is not None else "-"


class _TraceLayer:
    """The patching layer (course_lib.observe.patching) that times and records each call."""

    ops = frozenset(_ACCOUNTING) | {"batch_isend_irecv"}

    def around(self, name, a, call):
        if name in ASYNC or a.get("async_op"):  # the launch only, on the host's clock
            start = time.perf_counter()
            result = call()
            end = time.perf_counter()
        else:  # blocking: the device's queued work before, the transfer itself after
            tensor_arg = _ACCOUNTING[name][0]
            device = device_of(a[tensor_arg]) if tensor_arg else None
            start = now(device)
            result = call()
            end = now(device)
        if name == "batch_isend_irecv":
            for p2p in a["p2p_op_list"]:  # one record per point-to-point op in the batch
                kind = "isend" if getattr(p2p.op, "__name__", "") in ("isend", "send") else "irecv"
                n = _nbytes(p2p.tensor)
                _record(CommRecord(kind, _group_ranks(p2p.group), _dtype_name(p2p.tensor), p2p.tensor.numel(),
                                   n if kind == "isend" else 0, n if kind == "irecv" else 0, p2p.peer, start, end))
            return result
        tensor_arg, account = _ACCOUNTING[name]
        sent, recv, peer = account(a)
        if name == "recv" and peer is None:
            peer = result  # recv from any source returns the sender's rank
        t = _first_tensor(a[tensor_arg]) if tensor_arg else None
        _record(CommRecord(name, _group_ranks(a.get("group")), _dtype_name(t),
                           _numel(a[tensor_arg]) if tensor_arg else 0, sent, recv, peer, start, end))
        return result


_TRACE_LAYER = _TraceLayer()


class CommTracer:
    """Context manager recording this rank's torch.distributed calls (see module docstring).

    timeline: an optional `course_lib.observe.timeline.Timeline`; each call is also added to it
    as a "comm" event so it shows in the Gantt chart next to compute spans.
    """

    def __init__(self, timeline=None):
        self.records: list[CommRecord] = []
        self.timeline = timeline

    def __enter__(self):
        if not _active:
            patching.add_layer(_TRACE_LAYER, outermost=True)  # its span includes waiting for peers
        _active.append(self)
        return self

    def __exit__(self, *exc):
        _active.remove(self)
        if not _active:
            patching.remove_layer(_TRACE_LAYER)
        return False

    def summary(self) -> dict[str, dict[str, int]]:
        """{op: {"calls": int, "bytes_sent": int, "bytes_recv": int}} for this rank, ops sorted by name."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            s = out.setdefault(r.op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
            s["calls"] += 1
            s["bytes_sent"] += r.bytes_sent
            s["bytes_recv"] += r.bytes_recv
        return dict(sorted(out.items()))

    def total_bytes(self) -> dict[str, int]:
        """{"bytes_sent": ..., "bytes_recv": ...} summed over every op."""
        return {k: sum(r_[k] for r_ in self.summary().values()) for k in ("bytes_sent", "bytes_recv")}


def merge_summaries(per_rank: list[dict]) -> dict[str, dict[str, list[int]]]:
    """Merge the ranks' `summary()` dicts (in rank order) into {op: {field: [rank0, rank1, ...]}}.

    A rank that never called an op gets 0 for it, so every list has one entry per rank.
    """
    ops = sorted({op for s in per_rank for op in s})
    fields = ("calls", "bytes_sent", "bytes_recv")
    return {op: {f: [s.get(op, {}).get(f, 0) for s in per_rank] for f in fields} for op in ops}


def format_summary(merged: dict[str, dict[str, list[int]]]) -> str:
    """A fixed-width table of a merged summary: one row per (op, rank)."""
    lines = [f"{'op':<24}{'rank':>5}{'calls':>8}{'bytes sent':>14}{'bytes recv':>14}"]
    for op, fields in merged.items():
        for rank, calls in enumerate(fields["calls"]):
            lines.append(f"{op:<24}{rank:>5}{calls:>8}{fields['bytes_sent'][rank]:>14,}{fields['bytes_recv'][rank]:>14,}")
    return "\n".join(lines)
