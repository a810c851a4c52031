"""Notebook 12's pictures: flat shards resharded by global offsets, and the checkpoint-interval
widget (expected waste against the interval, Young/Daly's optimum marked).

    draw_flat_reshard(ax, numel, old_world, new_world)   which old shard feeds which new one
    draw_boxes(ax, shape, boxes_by_rank, title)           boxes of a 2-D tensor, one colour per rank
    interval_view(save_s, n_gpus) / interval_widget(...)  static figure / live version (same first state)
"""

from __future__ import annotations

from course_lib.checkpoint.interval import llama3_per_gpu_mtbf_hours, wasted_fraction, young_daly_interval
from course_lib.parallel.zero.flat import shard_bounds

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
GPU_COUNTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SAVE_STOPS = (0.1, 1.0, 10.0, 30.0, 60.0, 300.0, 600.0)  # seconds of stalled training per save
FIGSIZE = (7.5, 3.6)


def draw_flat_reshard(ax, numel: int, old_world: int, new_world: int) -> None:
    """Top: the old shards [r*S, (r+1)*S); bottom: the new ones, each cut where an old shard ends
    and coloured by the old rank (the file) it is read from. Hatched: padding."""
    for row, world, label in ((1, old_world, "saved"), (0, new_world, "loaded")):
        for r in range(world):
            a, b = shard_bounds(numel, world, r)
            ax.barh(row, min(b, numel) - a, left=a, height=0.5, color="white", edgecolor="black")
            if b > numel:
                ax.barh(row, b - max(a, numel), left=max(a, numel), height=0.5, color="white", edgecolor="grey",
                        hatch="//")
            ax.text((a + min(b, numel)) / 2, row + 0.33, f"{label} rank {r}", ha="center", fontsize=8)
            if row == 0:
                for q in range(old_world):
                    qa, qb = shard_bounds(numel, old_world, q)
                    lo, hi = max(a, qa), min(b, qb, numel)
                    if lo < hi:
                        ax.barh(0, hi - lo, left=lo, height=0.5, color=COLORS[q % len(COLORS)], alpha=0.8,
                                edgecolor="black")
                        ax.text((lo + hi) / 2, 0, f"[{lo},{hi})", ha="center", va="center", fontsize=7)
            else:
                ax.barh(1, min(b, numel) - a, left=a, height=0.5, color=COLORS[r % len(COLORS)], alpha=0.8,
                        edgecolor="black")
    ax.set_yticks([0, 1], [f"{new_world} ranks", f"{old_world} ranks"])
    ax.set_xlabel("global offset in the flat parameter vector")
    ax.set_xlim(0, max(shard_bounds(numel, w, w - 1)[1] for w in (old_world, new_world)))
    ax.set_ylim(-0.5, 1.6)


def draw_boxes(ax, shape, boxes_by_rank, title: str) -> None:
    """Each rank's boxes (reshard.Box) of a 2-D tensor, rows downwards."""
    import matplotlib.patches as mpatches

    rows, cols = shape
    for r, boxes in enumerate(boxes_by_rank):
        for b in boxes:
            (r0, c0), (nr, nc) = b.offsets, b.lengths
            ax.add_patch(mpatches.Rectangle((c0, r0), nc, nr, facecolor=COLORS[r % len(COLORS)], alpha=0.75,
                                            edgecolor="black"))
            ax.text(c0 + nc / 2, r0 + nr / 2, f"r{r}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("column")
    ax.set_ylabel("row")


def _draw_interval(fig, save_s: float, n_gpus: int, per_gpu_mtbf_h: float) -> str:
    import numpy as np

    if n_gpus not in GPU_COUNTS:
        raise ValueError(f"n_gpus={n_gpus} must be one of {GPU_COUNTS}")
    mtbf_s = per_gpu_mtbf_h * 3600 / n_gpus
    best = young_daly_interval(save_s, mtbf_s)
    taus = np.logspace(np.log10(best / 30), np.log10(best * 30), 200)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(taus / 60, [100 * wasted_fraction(t, save_s, mtbf_s) for t in taus], color=COLORS[0],
            label="saving + recomputing: δ/τ + τ/(2M)")
    ax.plot(taus / 60, 100 * save_s / taus, ":", color="grey", label="saving δ/τ")
    ax.plot(taus / 60, 100 * taus / (2 * mtbf_s), "--", color="grey", label="recomputing τ/(2M)")
    waste = wasted_fraction(best, save_s, mtbf_s)
    ax.plot([best / 60], [100 * waste], "o", color=COLORS[3], label=f"τ* = √(2δM) = {best / 60:.1f} min")
    ax.set_xscale("log")
    ax.set_ylim(0, 100 * waste * 4)
    ax.set_xlabel("checkpoint interval τ (minutes)")
    ax.set_ylabel("expected time wasted (%)")
    ax.legend(fontsize=8, loc="upper right")
    fig.subplots_adjust(left=0.1, right=0.97, top=0.95, bottom=0.15)
    return (f"{n_gpus:,} GPUs: job MTBF M = {mtbf_s / 3600:.2f} h; save stall δ = {save_s:g} s -> "
            f"τ* = {best / 60:.1f} min, {100 * waste:.2f}% of the run wasted")


def interval_view(save_s: float = 30.0, n_gpus: int = 16384):
    """The static figure: waste against the interval for a save stall of save_s seconds on n_gpus."""
    from course_lib.widgets import render

    _check_stop(save_s)
    return render(_draw_interval, FIGSIZE, save_s=save_s, n_gpus=n_gpus, per_gpu_mtbf_h=llama3_per_gpu_mtbf_hours())


def interval_widget(save_s: float = 30.0, n_gpus: int = 16384):
    """Sliders over GPU_COUNTS and SAVE_STOPS above the same figure (first state = interval_view)."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    _check_stop(save_s)
    gpus = W.SelectionSlider(options=[(f"{g:,}", g) for g in GPU_COUNTS], value=n_gpus, description="GPUs")
    save = W.SelectionSlider(options=[(f"{d:g} s", d) for d in SAVE_STOPS], value=save_s, description="save stall δ")
    return LiveFigure({"n_gpus": gpus, "save_s": save}, _draw_interval, FIGSIZE,
                      fixed={"per_gpu_mtbf_h": llama3_per_gpu_mtbf_hours()})


def _check_stop(save_s):
    if save_s not in SAVE_STOPS:
        raise ValueError(f"save_s={save_s!r} must be one of the slider's stops {SAVE_STOPS}")
