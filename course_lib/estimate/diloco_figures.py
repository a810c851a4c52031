"""Notebook 13's widget: how much of the wall clock goes to communication when R replicas that
meet every H steps share a slow link (DiLoCo between sites; H = 1 is data parallelism).

    sync_seconds(params, replicas, gbps, wire_bytes)       one sync: a ring all-reduce of the model
    round_share(params, replicas, inner_steps, gbps, step_s, wire_bytes)   communication / wall
    bytes_per_step(params, inner_steps, wire_bytes)        what a replica sends per step, on average
    diloco_view(...) / diloco_widget(...)                  static figure / live version (same first state)

The model, plainly: each replica computes an inner step in step_s seconds; every H steps the
replicas all-reduce the whole model (P parameters of e bytes: the averaged delta of
course_lib.estimate.traffic.diloco, P e every H steps) by a ring over a link of G Gb/s each
way (vendor units: G * 1e9 / 8 bytes/s), course_lib.comm.costmodel's 2 (R-1)/R * P e / beta,
latency left out (one message of gigabytes per sync is bandwidth-bound). Nothing overlaps:
a round takes H * step_s + T_sync. That is an upper bound for DDP, which hides part of its
all-reduce under the backward pass, and for Streaming DiLoCo, which overlaps its fragments
with the inner steps.
"""

from __future__ import annotations

from course_lib.comm.costmodel import LinkModel, predict_time
from course_lib.estimate.params import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, param_count
from course_lib.units import fmt_bytes

MODELS = {"Llama-3 8B": LLAMA3_8B, "Llama-3 70B": LLAMA3_70B, "Llama-3 405B": LLAMA3_405B}
REPLICAS = (2, 4, 8, 16, 32)
H_STOPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
GBPS = (1, 10, 100, 400, 3200)  # Gb/s each way: a site's uplink ... a node's eight 400 Gb/s NICs
STEP_STOPS = (0.5, 1.0, 2.0, 5.0)  # seconds of compute per inner step
FIGSIZE = (7.5, 3.6)
COLOR = "#4C72B0"


def _check(name, value, stops):
    if value not in stops:
        raise ValueError(f"{name}={value!r} must be one of {stops}")


def sync_seconds(params: int, replicas: int, gbps: float, wire_bytes: int = 4) -> float:
    """One sync: a ring all-reduce of params * wire_bytes bytes over `replicas` on a gbps link."""
    link = LinkModel(alpha=0.0, beta=gbps * 1e9 / 8, name=f"{gbps:g} Gb/s")
    return predict_time("ring", params * wire_bytes, replicas, link)


def round_share(params: int, replicas: int, inner_steps: int, gbps: float, step_s: float,
                wire_bytes: int = 4) -> float:
    """Communication's share of a round's wall time: T_sync / (H step_s + T_sync)."""
    t = sync_seconds(params, replicas, gbps, wire_bytes)
    return t / (inner_steps * step_s + t)


def bytes_per_step(params: int, inner_steps: int, wire_bytes: int = 4) -> float:
    """What one replica hands to the network per step, on average: P e / H."""
    return params * wire_bytes / inner_steps


def _draw(fig, model: str, replicas: int, inner_steps: int, gbps: int, step_s: float) -> str:
    if model not in MODELS:
        raise ValueError(f"model={model!r} must be one of {tuple(MODELS)}")
    for name, value, stops in (("replicas", replicas, REPLICAS), ("inner_steps", inner_steps, H_STOPS),
                               ("gbps", gbps, GBPS), ("step_s", step_s, STEP_STOPS)):
        _check(name, value, stops)
    p = param_count(MODELS[model])
    ax = fig.add_subplot(1, 1, 1)
    for g in GBPS:
        shares = [100 * round_share(p, replicas, h, g, step_s) for h in H_STOPS]
        mine = g == gbps
        ax.plot(H_STOPS, shares, "-" if mine else ":", color=COLOR if mine else "#999999", lw=2 if mine else 1,
                zorder=3 if mine else 2, label=f"{g:g} Gb/s")
    share = round_share(p, replicas, inner_steps, gbps, step_s)
    ax.plot([inner_steps], [100 * share], "o", color="#C44E52", zorder=4)
    ax.set_xscale("log")
    ax.set_xlim(0.8, H_STOPS[-1] * 1.25)
    ax.legend(title="link, each way", fontsize=8, title_fontsize=8, loc="upper right")
    ax.set_ylim(0, 100)
    ax.set_xlabel("H: inner steps between syncs (1 = data parallelism)")
    ax.set_ylabel("communication (% of wall time)")
    ax.set_title(f"{model}, {replicas} replicas, {step_s:g} s per inner step, fp32 on the wire", fontsize=9)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.91, bottom=0.14)
    t = sync_seconds(p, replicas, gbps)
    return (f"{model}: {p / 1e9:.2f} B parameters, {fmt_bytes(p * 4)} per sync in fp32; a ring all-reduce over "
            f"{replicas} replicas at {gbps:g} Gb/s takes {t:,.1f} s. Every H = {inner_steps} steps: "
            f"{fmt_bytes(bytes_per_step(p, inner_steps))} per step per replica on average, communication "
            f"{100 * share:.1f}% of the wall time (bf16 deltas halve the bytes).")


def diloco_view(model: str = "Llama-3 8B", replicas: int = 4, inner_steps: int = 100, gbps: int = 10,
                step_s: float = 1.0):
    """The static figure: communication's share of the wall time against H, one line per link."""
    from course_lib.widgets import render

    return render(_draw, FIGSIZE, model=model, replicas=replicas, inner_steps=inner_steps, gbps=gbps, step_s=step_s)


def diloco_widget(model: str = "Llama-3 8B", replicas: int = 4, inner_steps: int = 100, gbps: int = 10,
                  step_s: float = 1.0):
    """Sliders over the stops above the same figure (first state = diloco_view with the same arguments)."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    _check("model", model, tuple(MODELS))
    _check("replicas", replicas, REPLICAS)
    _check("inner_steps", inner_steps, H_STOPS)
    _check("gbps", gbps, GBPS)
    _check("step_s", step_s, STEP_STOPS)
    controls = {
        "model": W.SelectionSlider(options=list(MODELS), value=model, description="model"),
        "replicas": W.SelectionSlider(options=list(REPLICAS), value=replicas, description="replicas R"),
        "inner_steps": W.SelectionSlider(options=list(H_STOPS), value=inner_steps, description="H"),
        "gbps": W.SelectionSlider(options=[(f"{g:g} Gb/s", g) for g in GBPS], value=gbps, description="link"),
        "step_s": W.SelectionSlider(options=[(f"{s:g} s", s) for s in STEP_STOPS], value=step_s,
                                    description="inner step"),
    }
    return LiveFigure(controls, _draw, FIGSIZE)
