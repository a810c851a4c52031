"""Watch ring attention run: a per-rank timeline of its compute and its messages (notebook 09).

    with RingRecorder(layout) as rec:            # inside rank code, around a forward + backward
        out = context_attention(q, k, v, q_pos, None, layout, "ring")
        out.backward(dout)
    rec.events   # [(name, start, end, lane)], lane "compute", "K/V" or "dK/dV"

Nothing in the ring changes. The recorder listens in two places:

* compute: `ring.block_attention` and `ring.block_attention_backward` (the work of one block)
  are wrapped for the duration, each call a span named after the rank whose K/V it used;
* messages: a layer of the course's patching engine (course_lib.observe.patching, the one the
  tracer uses) sees each `batch_isend_irecv` the ring posts, and wraps the requests it returns
  so that their `wait()` is timed. A message is "in flight" from its post until the ring's wait
  on it returns; the ring computes in between, which is the overlap the notebook shows.

Times are time.perf_counter(), one clock for every process on the machine (observe.timeline).
"""

from __future__ import annotations

import time
from unittest import mock

from course_lib.observe import patching
from course_lib.parallel.cp import ring
from course_lib.parallel.cp.layout import SequenceLayout

LANES = {ring.KV_TAG: "K/V", ring.GRAD_TAG: "dK/dV"}


class _TimedWork:
    """A request whose wait() records when it returned (into the message it belongs to)."""

    def __init__(self, work, message: dict):
        self._work, self._message = work, message

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._message["end"] = max(self._message.get("end", 0.0), time.perf_counter())
        return result

    def __getattr__(self, name):  # anything else the ring might ask of a request
        return getattr(self._work, name)


class _MessageLayer:
    ops = frozenset({"batch_isend_irecv"})

    def __init__(self, messages: list):
        self.messages = messages

    def around(self, op, args, call):
        ops = args["p2p_op_list"]
        message = {"start": time.perf_counter(), "lane": LANES.get(ops[0].tag, "message")}
        works = call()
        self.messages.append(message)
        return [_TimedWork(w, message) for w in works]


class RingRecorder:
    """Context manager recording this rank's ring-attention timeline (module docstring)."""

    def __init__(self, layout: SequenceLayout):
        self.layout = layout
        self._owner = {int(p): r for r in range(layout.cp) for p in layout.positions(r)}
        self._compute: list[tuple[str, float, float, str]] = []
        self._messages: list[dict] = []
        self._layer = _MessageLayer(self._messages)
        self._patches = []

    def _timed(self, fn, what: str):
        def wrapped(q, k, v, q_pos, k_pos, *args, **kwargs):
            start = time.perf_counter()
            result = fn(q, k, v, q_pos, k_pos, *args, **kwargs)
            self._compute.append((f"{what} K/V {self._owner[int(k_pos[0])]}", start, time.perf_counter(),
                                  "compute"))
            return result
        return wrapped

    def __enter__(self):
        self._patches = [mock.patch.object(ring, "block_attention", self._timed(ring.block_attention, "fwd")),
                         mock.patch.object(ring, "block_attention_backward",
                                           self._timed(ring.block_attention_backward, "bwd"))]
        for p in self._patches:
            p.start()
        patching.add_layer(self._layer)
        return self

    def __exit__(self, *exc):
        patching.remove_layer(self._layer)
        for p in reversed(self._patches):
            p.stop()
        return False

    @property
    def events(self) -> list[tuple[str, float, float, str]]:
        """(name, start, end, lane), compute first, then every message that was waited on."""
        msgs = [(m["lane"], m["start"], m["end"], m["lane"]) for m in self._messages if "end" in m]
        return list(self._compute) + msgs


def overlaps(events, phase: str = "") -> int:
    """How many compute spans (of `phase`: "fwd", "bwd" or "" for both) lie wholly inside some
    message's flight (posted before the span started, waited on after it ended): work done
    while a block was on the wire."""
    flights = [(s, e) for _, s, e, lane in events if lane != "compute"]
    return sum(any(fs <= s and e <= fe for fs, fe in flights)
               for name, s, e, lane in events if lane == "compute" and name.startswith(phase))
