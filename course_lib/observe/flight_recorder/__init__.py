"""A flight recorder: each rank's last calls of torch.distributed, written to a file when one
hangs, and the analysis that lines the ranks up and names where they diverge. Llama 3's team
found stuck ranks this way, with NCCL's own recorder (Dubey et al. 2024, §3.3.4). The recorder
is here; the analysis, which reads its dumps, in analysis.py.

    with FlightRecorder(dump_dir, stuck_after_s=5):    rank code: record; dump when a call hangs
        ...
    request_dumps(dump_dir, ranks)                      from outside: every rank writes its buffer now
    analyse(load_dumps(dump_dir))                       the analysis; its first line names the culprit
    python -m course_lib.observe.flight_recorder DIR      the same from the files (torchrun runs)

What a rank keeps: a ring buffer of its last `capacity` calls, recorded by a layer of the one
patching engine (course_lib.observe.patching). Each entry has a sequence number: for a
collective, the k-th call this rank made on that group (the members of a group must issue
their collectives on it in the same order, so their k-th calls must be the same call); for a
point-to-point message, the k-th send to (or receive from) that peer. Then the op, the group's
global ranks (or the peer), the tensor's shape and dtype, and the state: "issued" until the
call returns, "completed" after.

When to dump: a watchdog thread wakes every `poll_s` seconds and writes the buffer to
dump_dir/rank_<r>.json when asked to: when the file dump_dir/dump_now holds a request it has
not served yet (request_dumps writes it; so can `echo 1 > DIR/dump_now` on a torchrun job),
and, with `stuck_after_s`, once the oldest call still "issued" is older than that (once per
such call: a call that was only slow and returned is overwritten when a later one sticks).
The request is the one a parent uses: it gives up on a hang whenever its own timeout says so,
and the dumps then show where the ranks are at that moment, however slowly they got there (a
fixed stuck_after_s shorter than the parent's timeout cannot promise that on a loaded machine).
The watchdog runs while the rank waits inside the collective, because torch releases the GIL
there. A rank that leaves the recorder normally writes its file too, so the analysis can say
what a rank that never entered a call did last.

The analysis takes each call a rank is stuck in and asks every other member of its group for
its call with the same sequence number (the other end, for a message). A member that never
entered it, or called something else there, is a culprit; each line names one, first, with the
ranks left waiting on it:

    rank 2 never entered all_reduce #3 on group [0, 1, 2, 3] that ranks 0, 1, 3 wait in (its last call: ...)
    rank 1 called broadcast [4] float32 #2 on group [0, 1] where rank 0 waits in all_reduce [4] float32
    rank 1 never entered send #3 to rank 0, the message rank 0 waits for (its last call: send #2 ...)

The likeliest culprit comes first: the one the most ranks wait for, then the earliest call (by
sequence number, not by clock: clocks of different hosts disagree), then a culprit itself stuck
in another call (a wrong group, a reordering) before one that has left; the order is the same
on every run.

On NCCL a call returns at once: it only queues the communication on the GPU's stream, so the
Python call returning says nothing about the communication ending, and a recorder that marked
"completed" there would show a rank stuck in a collective as having completed it (the hang then
surfaces later, at the next `.item()` or synchronize, with every call "completed"). So on a group
whose backend is NCCL an entry stays "issued" until its communication has ended: the recorder
keeps the call's Work object (async_op=True, isend, irecv, batch_isend_irecv) or, for a blocking
call, a CUDA event recorded on the current stream right after it (the call made that stream wait
for NCCL's, so the event completes when the communication does), and polls `is_completed()` /
`query()` from its own thread every poll_s, and before each dump (never a callback on the
backend's thread: CONTRIBUTING, "No backend thread runs Python"). "completed_at" is then when a
poll saw it, within poll_s of the end. On gloo nothing changes: its blocking calls return when
their communication has ended.

Limits: on gloo, asynchronous calls (isend, irecv, batch_isend_irecv, async_op=True) count as
completed when they are launched, so a hang in their wait() shows as the rank's last call, not
as a stuck one; two process groups over the same ranks share their sequence numbers.
(A few lines over 300: the recorder, its watchdog and its dump are one object; the analysis is
analysis.py.)
"""

from __future__ import annotations

import collections
import json
import pathlib
import threading
import time

import torch
import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.observe import patching
from course_lib.observe.flight_recorder.analysis import analyse, load_dumps, main  # noqa: F401 (the package's API)

DUMP_REQUEST = "dump_now"  # dump_dir/dump_now: a request for a dump (its text: the request's id)

P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
_GROUP_OPS = tuple(op for op in patching.PATCHABLE_OPS if op not in P2P and op != "batch_isend_irecv")


def _first_tensor(value):
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, torch.Tensor) else None


_RANKS: dict = {}  # group (None: the world) -> (its global ranks, its key in the counts), looked up once
_TENSOR_ARGS = ("tensor", "input_tensor", "input", "tensor_list", "input_tensor_list", "output")
_TENSOR_ARG: dict = {}  # op -> the first of _TENSOR_ARGS among its arguments (None: it has none), found once
_DTYPE_NAMES: dict = {}  # torch.float32 -> "float32"
_EARLY: dict = {}  # group -> whether its calls return before their communication ends, looked up once


def _returns_early(group) -> bool:
    """Whether a call on `group` returns before its communication ends: NCCL queues it on the GPU."""
    if group not in _EARLY:
        try:
            _EARLY[group] = dist.get_backend(group) == "nccl"
        except (RuntimeError, ValueError):  # not a group torch knows (a test's stand-in): gloo's rule
            _EARLY[group] = False
    return _EARLY[group]


def _stream_marker():
    """A CUDA event on the current stream, recorded after a blocking NCCL call (module docstring)."""
    event = torch.cuda.Event()
    event.record()
    return event


def _ended(handles) -> bool:
    return all(h.is_completed() if hasattr(h, "is_completed") else h.query() for h in handles)


def _group_ranks(group) -> tuple[list[int], tuple]:
    if group not in _RANKS:
        whole = group is None or group is dist.group.WORLD
        ranks = list(range(dist.get_world_size())) if whole else list(dist.get_process_group_ranks(group))
        _RANKS[group] = ranks, ("group", tuple(ranks))
    return _RANKS[group]


def _dtype_name(dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return _DTYPE_NAMES[dtype]


class FlightRecorder:
    """Context manager, rank code: record this rank's calls; dump them when one hangs (module docstring)."""

    def __init__(self, dump_dir=None, stuck_after_s: float | None = None, capacity: int = 256,
                 poll_s: float = 0.1):
        self.capacity = check_int("capacity", capacity)
        if stuck_after_s is not None and not stuck_after_s > 0:
            raise ValueError(f"stuck_after_s={stuck_after_s!r} must be > 0 seconds (or None: never dump by itself)")
        if stuck_after_s is not None and dump_dir is None:
            raise ValueError("stuck_after_s needs a dump_dir to write to")
        if not poll_s > 0:
            raise ValueError(f"poll_s={poll_s!r} must be > 0 seconds")
        self.dump_dir = None if dump_dir is None else pathlib.Path(dump_dir)
        self.stuck_after_s, self.poll_s = stuck_after_s, poll_s
        self.entries: collections.deque = collections.deque(maxlen=self.capacity)
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()  # one dump at a time (the watchdog, or a caller's)
        self._pending: list = []  # NCCL: (entries, handles) whose communication may not have ended
        self._pending_lock = threading.Lock()  # the rank's thread appends, the watchdog polls
        self._stop = threading.Event()
        self.ops = frozenset(_GROUP_OPS) | frozenset(P2P) | {"batch_isend_irecv"}

    # ------------------------------------------------------------ the patching layer
    # No lock on this path (it runs on every call): the calling thread alone appends and updates
    # entries, and the watchdog reads them through list(self.entries), one C-level copy that no
    # other Python thread can interleave with (the GIL is held throughout).
    def _issue(self, op, key, where, tensor) -> dict:
        counts = self._counts
        counts[key] += 1
        entry = {"seq": counts[key], "op": op, **where,
                 "shape": list(tensor.shape) if tensor is not None else [],
                 "dtype": _dtype_name(tensor.dtype) if tensor is not None else "-",
                 "state": "issued", "issued_at": time.time()}
        self.entries.append(entry)
        return entry

    def _p2p(self, op, peer, tensor) -> dict:
        me = dist.get_rank()
        kind = P2P[op]
        src, dst = (me, peer) if kind == "send" else (peer, me)
        return self._issue(kind, (kind, src, dst), {"src": src, "dst": dst}, tensor)

    def around(self, op, a, call):
        if op == "batch_isend_irecv":
            entries = [self._p2p(getattr(p.op, "__name__", "isend"), p.peer, p.tensor)
                       for p in a["p2p_op_list"]]
        elif op in P2P:
            peer = a.get("dst") if P2P[op] == "send" else a.get("src")
            entries = [self._p2p(op, peer, _first_tensor(a.get("tensor")))]
        else:
            ranks, key = _group_ranks(a.get("group"))
            if op not in _TENSOR_ARG:
                _TENSOR_ARG[op] = next((k for k in _TENSOR_ARGS if k in a), None)
            name = _TENSOR_ARG[op]
            tensor = _first_tensor(a[name]) if name is not None else None
            entries = [self._issue(op, key, {"group": ranks}, tensor)]
        result = call()
        group = a["p2p_op_list"][0].group if op == "batch_isend_irecv" and a["p2p_op_list"] else a.get("group")
        if _returns_early(group):  # NCCL: "issued" until the work or the stream says it ended
            handles = result if isinstance(result, list) else [result if result is not None else _stream_marker()]
            with self._pending_lock:
                self._pending.append((entries, handles))
            return result
        done = time.time()
        for e in entries:
            e["state"], e["completed_at"] = "completed", done
        return result

    def poll(self) -> None:
        """Mark "completed" every pending NCCL call whose communication has ended (module docstring)."""
        if not self._pending:
            return
        with self._pending_lock:
            still = []
            for entries, handles in self._pending:
                if _ended(handles):
                    done = time.time()
                    for e in entries:
                        e["state"], e["completed_at"] = "completed", done
                else:
                    still.append((entries, handles))
            self._pending = still

    # ------------------------------------------------------------ the watchdog and the dump
    def _request(self) -> str | None:
        """The pending request's id; None when there is none, or it was made before this recorder
        started (a request left over from an earlier run in the same directory is not for it)."""
        path = self.dump_dir / DUMP_REQUEST
        try:
            if path.stat().st_mtime < self._started:
                return None
            return path.read_text() or None
        except OSError:  # no request yet
            return None

    def _watch(self):
        dumped_for = None  # the stuck call the last dump was written for
        served = None
        while not self._stop.wait(self.poll_s):
            self.poll()
            request = self._request()
            if request is not None and request != served:
                self.dump(request=request)
                served = request
            if self.stuck_after_s is None:
                continue
            issued = [e for e in list(self.entries) if e["state"] == "issued"]
            if not issued:
                continue
            oldest = min(issued, key=lambda e: e["issued_at"])
            # Once per stuck call: a call that was only slow (a loaded machine) and then returned
            # must not leave a stale dump behind when the rank gets stuck in a later one.
            if oldest is not dumped_for and time.time() - oldest["issued_at"] >= self.stuck_after_s:
                self.dump()
                dumped_for = oldest

    def dump(self, path=None, request: str | None = None) -> pathlib.Path:
        """Write {"rank", "world_size", "entries", "request"} as JSON (default: dump_dir/rank_<r>.json);
        `request`: the id of the request it answers (None: the recorder's own decision)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = pathlib.Path(path) if path is not None else self.dump_dir / f"rank_{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.poll()
        with self._lock:
            data = {"rank": rank, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "entries": [dict(e) for e in list(self.entries)], "request": request}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(path)  # a reader never sees half a file
        return path

    def __enter__(self):
        patching.add_layer(self, outermost=True)  # its "issued" covers the whole wait for the peers
        if self.dump_dir is not None:
            self._started = time.time()
            self._thread = threading.Thread(target=self._watch, name="flight-recorder", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        patching.remove_layer(self)
        if self.dump_dir is not None:  # a rank that finished says so: its last calls, all completed
            self.dump()
        return False


def request_dumps(dump_dir, ranks, wait_s: float = 30.0, poll_s: float = 0.05) -> list[int]:
    """Ask every recorder writing to `dump_dir` for a dump now; wait until each of `ranks` has
    answered (its rank_<r>.json carries this request's id) or `wait_s` has passed. Returns the
    ranks that did not answer (a rank whose process is gone, or one not yet inside its recorder).
    The wait ends as soon as they have: a watchdog answers within a poll_s of its own, seconds
    at most on a loaded machine; wait_s only bounds a rank that cannot answer at all."""
    directory = pathlib.Path(dump_dir)
    request = f"{time.time_ns()}"  # an id no earlier request in this directory had
    tmp = directory / (DUMP_REQUEST + ".tmp")
    tmp.write_text(request)
    tmp.replace(directory / DUMP_REQUEST)  # a recorder never reads half an id
    waiting, deadline = set(ranks), time.monotonic() + wait_s
    while waiting and time.monotonic() < deadline:
        for r in sorted(waiting):
            try:
                answered = json.loads((directory / f"rank_{r}.json").read_text()).get("request") == request
            except (OSError, ValueError):  # not written yet
                answered = False
            if answered:
                waiting.discard(r)
        if waiting:
            time.sleep(poll_s)
    return sorted(waiting)
