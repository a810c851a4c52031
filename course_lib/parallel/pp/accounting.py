"""What one run of a schedule costs on a rank, kept beside the executor (runner.py) as an observer.

The executor runs the actions; before and after each it calls a StepAccounting, which keeps:

* memory: the bytes of the autograd graph each F saved (the storages its saved tensors use,
  parameters excluded, each storage once), live until its B frees the graph; with a split
  backward B keeps the (x, dy) stash its W later consumes. `peak` is the most bytes live after
  any action: run_schedule leaves it in stage.last_peak_activation_bytes.
* the timeline: a span per F/B/W ("forward", "backward", "weight-grad") and per send or receive
  that waited ("comm"), when a Timeline is given; on the stage's device (its parameters'), so on
  a GPU each span's clock is read once the device has finished (course_lib.clock), and the
  bubble measured from them is idle device time, not idle launching.
* padding: action_seconds {"F", "B", "W"} slept inside each action's span (a whole micro-batch's
  time, 1/v of it per chunk), so a tiny model behaves like a big one on a crowded CPU. Without
  W actions the W time is part of B.
"""

from __future__ import annotations

import contextlib
import time

import torch

from course_lib.parallel.pp.deferred import stashed_tensors

CATEGORY = {"F": "forward", "B": "backward", "W": "weight-grad"}


def storage_bytes(tensors, exclude: set) -> int:
    """Bytes of the distinct storages behind `tensors`, those in `exclude` (data pointers) left out."""
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in exclude:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class StepAccounting:
    """One rank's bookkeeping of one run_schedule: saved bytes live and their peak, timeline
    spans, padding. The executor calls forward() around an F's compute, backward()/weight()
    around a B's or a W's, comm() around a wait, and done() after every action."""

    def __init__(self, stage, timeline=None, action_seconds: dict | None = None, split_backward: bool = False):
        self.params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        self.device = next((p.device for p in stage.parameters()), None)  # where the spans' work runs
        self.timeline, self.v = timeline, stage.virtual_stages
        self.pad = {k: 0.0 for k in "FBW"} | dict(action_seconds or {})
        if not split_backward:
            self.pad["B"] += self.pad["W"]
        self.graph_bytes: dict = {}
        self.live = self.peak = 0

    def span(self, label: str, category: str):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(label, category, device=self.device)

    def comm(self, label: str):
        return self.span(label, "comm")

    @contextlib.contextmanager
    def forward(self, key, name: str):
        """Around F's compute: its span, its padding, and the bytes its graph saves."""
        saved = []
        with self.span(name, CATEGORY["F"]), torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or t, lambda t: t):
            yield
            time.sleep(self.pad["F"] / self.v)
        self.graph_bytes[key] = storage_bytes(saved, self.params)
        self.live += self.graph_bytes[key]

    @contextlib.contextmanager
    def backward(self, key, name: str, stash: list | None = None):
        """Around B's compute: its span and padding; after it the graph is freed and the stash
        (split backward: the (x, dy) its W needs) is held."""
        with self.span(name, CATEGORY["B"]):
            yield
            time.sleep(self.pad["B"] / self.v)
        self.live -= self.graph_bytes.pop(key)
        if stash is not None:
            self.live += storage_bytes(stashed_tensors(stash), self.params)

    @contextlib.contextmanager
    def weight(self, name: str, stash: list):
        """Around W: the stash is released (measured before W consumes it), its span and padding."""
        self.live -= storage_bytes(stashed_tensors(stash), self.params)
        with self.span(name, CATEGORY["W"]):
            yield
            time.sleep(self.pad["W"] / self.v)

    def done(self) -> None:
        """After every action: the peak of live bytes."""
        self.peak = max(self.peak, self.live)
