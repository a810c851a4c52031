"""Per-rank event timelines and the Gantt chart later notebooks use for overlap and bubbles.

Inside rank code:

    tl = Timeline()
    with tl.span("forward"):
        ...
    with CommTracer(timeline=tl):      # collectives are added as "comm" events
        dist.all_reduce(t)
    return tl.events                   # plain tuples travel back to the parent

In the parent: `plot_gantt(results)` where results is the list of per-rank event lists.
Times come from time.perf_counter(), which on Linux is one system-wide monotonic clock,
so events from different rank processes on one machine share a time axis. On a GPU a span's
clock is read after the device's queued work is done (course_lib.clock.now), so a span is the
work, not its launch: pass the rank's device, `Timeline(device=rank_device())`; the default
waits for this process's GPU if it has started CUDA, and never on CPU ranks.
"""

from __future__ import annotations

import contextlib

from course_lib.clock import now

# Colours by category; anything else cycles through the default palette.
CATEGORY_COLORS = {"compute": "tab:blue", "forward": "tab:blue", "backward": "tab:orange",
                   "comm": "tab:red", "optimizer": "tab:green", "idle": "lightgrey"}


class Timeline:
    """A list of (name, start, end, category) events for one rank. device: where the timed work
    runs (course_lib.clock: a GPU is waited for at each span's ends; None: this process's GPU if
    it has started CUDA, else nothing)."""

    def __init__(self, device=None):
        self.events: list[tuple[str, float, float, str]] = []
        self.device = device

    def now(self, device=None) -> float:
        """The clock of this timeline's spans: perf_counter once `device` (default: the
        timeline's) has finished its queued work."""
        return now(self.device if device is None else device)

    def add(self, name: str, start: float, end: float, category: str = "compute"):
        if end < start:
            raise ValueError(f"event {name!r} ends ({end}) before it starts ({start})")
        self.events.append((name, start, end, category))

    @contextlib.contextmanager
    def span(self, name: str, category: str = "compute", device=None):
        """Time the block as one event; device overrides the timeline's for this span (a caller
        that knows where its tensors live, e.g. the pipeline executor's stage)."""
        start = self.now(device)
        try:
            yield
        finally:
            self.add(name, start, self.now(device), category)


def merge_timelines(per_rank: list[list[tuple]]) -> list[tuple[int, str, float, float, str]]:
    """[(rank, name, start, end, category)] with times in seconds from the earliest event."""
    starts = [e[1] for events in per_rank for e in events]
    t0 = min(starts) if starts else 0.0
    return sorted(((rank, n, s - t0, e - t0, c) for rank, events in enumerate(per_rank) for n, s, e, c in events),
                  key=lambda x: (x[0], x[2]))


def plot_gantt(per_rank: list[list[tuple]], ax=None, title: str | None = None, label_min_width: float = 0.06):
    """Draw one row per rank, one bar per event, coloured by category. Returns the Axes.

    label_min_width: events at least this fraction of the whole span get their name written in.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    merged = merge_timelines(per_rank)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(per_rank) + 1.2))
    span = max((e[3] for e in merged), default=1.0) or 1.0
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = dict(CATEGORY_COLORS)
    for _, _, _, _, cat in merged:
        colors.setdefault(cat, palette[len(colors) % len(palette)])
    for rank, name, start, end, cat in merged:
        ax.barh(rank, end - start, left=start, height=0.6, color=colors[cat], edgecolor="black", linewidth=0.3)
        if (end - start) >= label_min_width * span:
            ax.text((start + end) / 2, rank, name, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    used = sorted({c for *_, c in merged})
    ax.legend(handles=[Patch(color=colors[c], label=c) for c in used], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    return ax
