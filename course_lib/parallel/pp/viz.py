"""Drawing schedules: the Gantt chart of a schedule's data, and the notebook's widget.

A schedule's chart comes from `simulate` (unit times t_F = t_B = t_W = 1, a chunk 1/v of
that); a real run's chart from its Timeline events, drawn with course_lib.plot_gantt.
"""

from __future__ import annotations

from course_lib.observe.timeline import plot_gantt
from course_lib.parallel.pp.bubble import formula_for, measured_bubble
from course_lib.parallel.pp.schedules import SCHEDULES, in_flight, make_schedule, schedule_events
from course_lib.parallel.pp.v_schedules import V_SCHEDULES

# the schedules with one action list per step (pipedream_2bw runs across steps: pipedream.py)
PER_STEP = tuple(s for s in SCHEDULES if s != "pipedream_2bw")


def messages_per_step(p: int, m: int, v: int = 1, placement: str = "loop") -> int:
    """Point-to-point messages of one step: each micro-batch crosses pv - 1 stage boundaries
    forward (activations) and as many backward (gradients); in a V (v = 2) the turn from stage
    p-1 to p stays on rank p-1, so 2p - 2 of them leave a rank."""
    return 2 * m * (p * v - 1 - (placement == "v"))


def plot_schedule(sched, ax, title: str | None = None):
    """The schedule's own chart (simulated, unit times), one row per rank."""
    plot_gantt(schedule_events(sched), ax=ax, title=title, label_min_width=0.028)
    ax.set_xlabel("time (units of one micro-batch's forward on one rank)")
    return ax


def draw_schedule(fig, schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2) -> str:
    """Widget body: the chart of `schedule` for p ranks, m micro-batches (v chunks if
    interleaved), and a caption with its bubble, in-flight micro-batches and messages."""
    v = v if schedule == "interleaved_1f1b" else 2 if schedule in V_SCHEDULES else 1
    sched = make_schedule(schedule, p, m, v)  # ValueError on settings no schedule can run
    ax = fig.add_subplot(1, 1, 1)
    plot_schedule(sched, ax, title=f"{schedule}: p={p}, m={m}" + (f", v={v}" if v > 1 else ""))
    fig.subplots_adjust(left=0.1, right=0.84, bottom=0.18, top=0.88)
    bubble = measured_bubble(schedule_events(sched))
    return (f"bubble {bubble:.3f} (formula {formula_for(schedule, p, m, v):.3f}); micro-batch chunks in flight "
            f"per rank {in_flight(sched)}; {messages_per_step(p, m, v, sched.placement)} messages per step")


def schedule_widget(schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2, figsize=(10, 3.6)):
    """LiveFigure with schedule, p, m and v controls. m offers multiples of p when the schedule
    is interleaved (its rule); v matters only for interleaved (zbv and dualpipev: always 2)."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    def m_options(name, p):
        return [k for k in range(1, 17) if name != "interleaved_1f1b" or k % p == 0]

    controls = {
        "schedule": W.Dropdown(options=list(PER_STEP), value=schedule, description="schedule"),
        "p": W.Dropdown(options=[2, 3, 4, 6, 8], value=p, description="ranks p"),
        "m": W.Dropdown(options=m_options(schedule, p), value=m, description="micro-batches m"),
        "v": W.Dropdown(options=[2, 3, 4], value=v, description="chunks v"),
    }

    class ScheduleWidget(LiveFigure):
        def on_change(self, name):
            c = self.controls
            options = m_options(c["schedule"].value, c["p"].value)
            keep = c["m"].value if c["m"].value in options else min(options, key=lambda k: abs(k - c["m"].value))
            c["m"].options = options
            c["m"].value = keep
            c["v"].disabled = c["schedule"].value != "interleaved_1f1b"

    w = ScheduleWidget(controls, draw_schedule, figsize)
    w.controls["v"].disabled = schedule != "interleaved_1f1b"
    return w


def schedule_view(schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2, figsize=(10, 3.6)):
    """The widget's first state as a static View."""
    from course_lib.widgets import render

    return render(draw_schedule, figsize, schedule=schedule, p=p, m=m, v=v)
