"""A flight recorder: each rank's last calls of torch.distributed, written to a file when one
hangs, and the analysis that lines the ranks up and names where they diverge. Llama 3's team
found stuck ranks this way, with NCCL's own recorder (Dubey et al. 2024, §3.3.4). (A little
over 300 lines: the recorder and the analysis read the same entries, and belong together.)

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

Limits: asynchronous calls (isend, irecv, batch_isend_irecv, async_op=True) count as completed
when they are launched, so a hang in their wait() shows as the rank's last call, not as a stuck
one; two process groups over the same ranks share their sequence numbers.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import threading
import time

import torch
import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.observe import patching

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
        done = time.time()
        for e in entries:
            e["state"], e["completed_at"] = "completed", done
        return result

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


# ------------------------------------------------------------------ the analysis
def load_dumps(directory) -> dict[int, list[dict]]:
    """{rank: entries} from the rank_<r>.json files in `directory`."""
    files = sorted(pathlib.Path(directory).glob("rank_*.json"))
    if not files:
        raise ValueError(f"{directory} holds no rank_<r>.json dump")
    dumps = {}
    for f in files:
        data = json.loads(f.read_text())
        dumps[data["rank"]] = data["entries"]
    return dumps


def _where(e) -> str:
    if "group" in e:
        return f"{e['op']} #{e['seq']} on group {e['group']}"
    peer = e["dst"] if e["op"] == "send" else e["src"]
    return f"{e['op']} #{e['seq']} {'to' if e['op'] == 'send' else 'from'} rank {peer}"


def _other_end(e) -> dict:
    """The call a point-to-point entry's peer must make: the send for a recv, the recv for a send."""
    return {**e, "op": "recv" if e["op"] == "send" else "send"}


def _partner(e, entries: list[dict]):
    """The entry among a member's `entries` that must match e (same group and number, or the other
    end of a message); None when the member has not issued it."""
    for f in entries:
        if "group" in e and f.get("group") == e["group"] and f["seq"] == e["seq"]:
            return f
        if "group" not in e and "group" not in f and f["seq"] == e["seq"] and (f["src"], f["dst"]) == (e["src"], e["dst"]) \
                and f["op"] != e["op"]:
            return f
    return None


def _describe(member: int, entries: list[dict]) -> str:
    stuck = [e for e in entries if e["state"] == "issued"]
    if stuck:
        return f"it is in {_where(stuck[0])}"
    if entries:
        return f"its last call: {_where(entries[-1])}, completed"
    return "it made no call"


def _ranks(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _wait(ranks) -> str:
    return f"{_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def analyse(dumps: dict[int, list[dict]], world_size: int | None = None) -> str:
    """Lines naming the culprits: for each stuck call, the members that never entered it or
    called something else there, with the ranks left waiting; the most likely culprit first
    (module docstring). Ranks missing from `dumps` (no file) are named."""
    world = world_size or max(dumps) + 1
    # Each stuck call asks its members for their call with its number. Earliest in its group's
    # order first (sequence number, then rank), not by clock: clocks of different hosts disagree.
    stuck = sorted(((e["seq"], r, e) for r, entries in dumps.items() for e in entries
                    if e["state"] == "issued"), key=lambda t: (t[0], t[1]))
    found: dict = {}  # (culprit, what it did wrong, the call) -> [the waiting ranks, the call's number, order]
    for seq, rank, e in stuck:
        members = e["group"] if "group" in e else [e["dst"] if e["op"] == "send" else e["src"]]
        for m in members:
            if m == rank:
                continue
            if m not in dumps:
                key = (m, "no dump", _where(e))
            else:
                f = _partner(e, dumps[m])
                if f is None:
                    key = (m, "never", _where(e) + " that" if "group" in e else _where(_other_end(e)) + ", the message")
                elif "group" in e and (f["op"], f["shape"], f["dtype"]) != (e["op"], e["shape"], e["dtype"]):
                    key = (m, f"called {f['op']} {f['shape']} {f['dtype']} #{f['seq']} on group {f['group']}",
                           f"{e['op']} {e['shape']} {e['dtype']}")
                else:
                    continue
            found.setdefault(key, [[], seq, len(found)])[0].append(rank)
    stuck_ranks = {r for _, r, _ in stuck}

    def order(item):
        # The likeliest culprit first: the one most ranks wait for; then the earliest call; then one
        # itself stuck elsewhere (it went to another call: a wrong group, a reordering) before one
        # that finished (it may only have left, its own calls all matched); then discovery order.
        (culprit, _, _), (waiters, seq, n) = item
        return (-len(waiters), seq, culprit not in stuck_ranks, n)

    lines = []
    for (culprit, what, call), (waiters, _, _) in sorted(found.items(), key=order):
        if what == "no dump":
            lines.append(f"rank {culprit} wrote no dump (it finished, died, or never recorded); "
                         f"{_wait(waiters)} for it in {call}")
        elif what == "never":
            verb = "in" if call.endswith(" that") else "for"  # a collective is waited in, a message for
            lines.append(f"rank {culprit} never entered {call} {_wait(waiters)} {verb} "
                         f"({_describe(culprit, dumps[culprit])})")
        else:
            lines.append(f"rank {culprit} {what} where {_wait(waiters)} in {call}")
    missing = sorted(set(range(world)) - set(dumps))
    if not lines:
        lines.append("no divergence found: every stuck call's partners are in the same call "
                     "(a rank may be stuck outside torch.distributed)" if stuck else "no rank is stuck in a call")
    if missing:
        lines.append(f"no dump from rank(s) {', '.join(map(str, missing))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m course_lib.observe.flight_recorder DIR", file=sys.stderr)
        return 2
    try:
        dumps = load_dumps(args[0])
    except (ValueError, OSError) as e:  # a wrong directory: one line, not a traceback
        print(f"flight_recorder: {e}", file=sys.stderr)
        return 2
    print(analyse(dumps))
    return 0
