"""Notebook 11's figures: predicted against measured, the memory / step-time Pareto front, the
planner's top layouts with their cost breakdown, and the widget (model, cluster, batch).

    plot_predicted_vs_measured(ax, result)      a course_lib.measure.validation.compare result
    plot_pareto(ax, candidates, memory_bytes)   every layout: bytes per device against step time
    plot_breakdown(ax, plan, top)               stacked cost terms of the top layouts
    planner_view(...) / planner_widget(...)     show with course_lib.widgets.show_interactive
"""

from __future__ import annotations

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from course_lib.comm.costmodel import predict_time
from course_lib.estimate.clusters import gpu_cluster
from course_lib.estimate.params import PRESETS
from course_lib.estimate.planner import plan
from course_lib.estimate.step_time import ALL_TERMS, TERMS
from course_lib.units import GiB

COLORS = {"compute": "tab:blue", "recompute": "tab:cyan", "tp": "tab:red", "pp": "tab:purple", "ep": "tab:pink",
          "bubble": "tab:gray", "dp_exposed": "tab:orange", "optimizer": "tab:green", "cp": "tab:olive",
          "overhead": "tab:brown", "checks": "black"}
MODELS = ("Llama-3 8B", "Llama-3 70B", "GPT-3 175B", "Llama-3 405B")
GPUS = {"A100 (8 per node)": ("A100 SXM 80 GB", 8), "H100 (8 per node)": ("H100 SXM 80 GB", 8),
        "H200 (8 per node)": ("H200 SXM 141 GB", 8), "B200 (8 per node)": ("B200 180 GB", 8),
        "GB200 (NVL72 racks)": ("GB200 186 GB", 72)}
N_GPUS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_TOKENS_M = (1, 2, 4, 8, 16)  # millions of tokens per step
SEQ = 4096  # tokens per sequence (GPT-3: its 2048)
FIGSIZE = (9.5, 3.8)


def plot_predicted_vs_measured(ax, result):
    """Predicted against measured step time, one point per layout: blue where the model predicts
    low, orange where high. The labels stand in a column right of the axes, in the order of the
    predicted times, each joined to its point by a thin line (close points would overlap)."""
    rows = sorted(result["rows"], key=lambda r: r["predicted"])
    meas = [r["measured"] * 1e3 for r in rows]
    pred = [r["predicted"] * 1e3 for r in rows]
    low = [r["error"] < 0 for r in rows]
    for flag, color, word in ((True, "tab:blue", "low"), (False, "tab:orange", "high")):
        picked = [i for i in range(len(rows)) if low[i] == flag]
        if picked:
            ax.scatter([meas[i] for i in picked], [pred[i] for i in picked], color=color, s=18, zorder=3,
                       label=f"predicted {word}: {len(picked)} of {len(rows)}")
    for k, (r, x, y) in enumerate(zip(rows, meas, pred)):
        ax.annotate(f"{r['label']} ({r['error']:+.1%})", xy=(x, y), xytext=(1.03, (k + 0.5) / len(rows)),
                    textcoords="axes fraction", fontsize=7, va="center",
                    arrowprops=dict(arrowstyle="-", color="0.7", lw=0.5, shrinkA=0, shrinkB=3))
    lo, hi = min(meas + pred) * 0.8, max(meas + pred) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):  # milliseconds as plain numbers at 1, 2, 3, 5 x 10^k
        axis.set_major_locator(LogLocator(subs=(1, 2, 3, 5)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"rank correlation {result['spearman']:.2f}, median |error| {result['median_error']:.0%}",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return ax


def plot_collective_table(ax, table, op: str = "all_reduce"):
    """The measured seconds of `op` against bytes, one line per group size, beside the single
    alpha-beta ring line fitted through the whole world's all-reduces (table.fit)."""
    groups = sorted(table.entries[op], key=int)
    for g in groups:
        sizes, seconds = table.entries[op][g]
        ax.plot(sizes, [t * 1e3 for t in seconds], "o-", label=f"measured, {g} ranks")
    if table.fit is not None and op == "all_reduce":
        sizes = table.entries[op][groups[-1]][0]
        ax.plot(sizes, [predict_time("ring", s, int(groups[-1]), table.fit) * 1e3 for s in sizes], "k--",
                label=f"one alpha-beta line, {groups[-1]} ranks")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes")
    ax.set_ylabel(f"seconds per {op.replace('_', '-')} (ms)")
    ax.legend(fontsize=8)
    return ax


def plot_pareto(ax, candidates, memory_bytes: float):
    fits = [c for c in candidates if c.fits]
    over = [c for c in candidates if not c.fits]
    for group, color, label in ((fits, "tab:blue", "fits"), (over, "lightgray", "does not fit")):
        ax.scatter([c.time["total"] for c in group], [c.memory["total"] / GiB for c in group], s=8, color=color,
                   label=label)
    front, best_mem = [], float("inf")
    for c in sorted(fits, key=lambda c: c.time["total"]):
        if c.memory["total"] < best_mem:
            front.append(c)
            best_mem = c.memory["total"]
    ax.plot([c.time["total"] for c in front], [c.memory["total"] / GiB for c in front], "r.-",
            label="Pareto front")
    ax.axhline(memory_bytes / GiB, color="red", linestyle="--", linewidth=1, label="device memory")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("GiB per device")
    ax.legend(fontsize=8)
    return front


def plot_breakdown(ax, p, top: int = 5):
    cands = p.ranked[:top][::-1]
    for i, c in enumerate(cands):
        left = 0.0
        for term in ALL_TERMS:  # cp drawn only where it is > 0
            w = c.time[term]
            if w > 0:
                ax.barh(i, w, left=left, color=COLORS[term], label=term if i == len(cands) - 1 else None)
                left += w
        ax.text(left, i, f"  MFU {c.time['mfu']:.0%}, {c.memory['total'] / GiB:.0f} GiB", va="center", fontsize=8)
    ax.set_yticks(range(len(cands)), [c.label() for c in cands], fontsize=8)
    ax.set_xlabel("predicted seconds per step")
    ax.set_xlim(0, max(c.time["total"] for c in cands) * 1.45)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.16), ncol=len(TERMS), frameon=False)


def _draw(fig, model: str, gpus: str, n_gpus: int, batch_m: int) -> str:
    if model not in MODELS or gpus not in GPUS or n_gpus not in N_GPUS or batch_m not in BATCH_TOKENS_M:
        raise ValueError(f"model={model!r}, gpus={gpus!r}, n_gpus={n_gpus!r}, batch={batch_m!r}: pick from the controls")
    name, per_node = GPUS[gpus]
    cluster = gpu_cluster(name, n_gpus, per_node)
    config = PRESETS[model]
    seq = min(SEQ, config.block_size)
    batch = batch_m * 2**20 // seq
    p = plan(config, cluster, batch, seq, recomputes=("none", "full"), micro_batches=(1, 2))
    ax = fig.add_subplot()
    plot_breakdown(ax, p)
    ax.set_title(f"{model} on {n_gpus:,} x {gpus}, {batch_m}M tokens per step ({batch:,} x {seq:,})",
                 fontsize=10)
    fig.subplots_adjust(left=0.3, right=0.98, top=0.9, bottom=0.24)
    return p.explain().replace("\n", "; ")


def planner_view(model: str = "Llama-3 70B", gpus: str = "H100 (8 per node)", n_gpus: int = 1024, batch_m: int = 4):
    from course_lib.widgets import render

    return render(_draw, FIGSIZE, model=model, gpus=gpus, n_gpus=n_gpus, batch_m=batch_m)


def planner_widget(model: str = "Llama-3 70B", gpus: str = "H100 (8 per node)", n_gpus: int = 1024,
                   batch_m: int = 4):
    """Controls: model, GPU and node kind, number of GPUs, millions of tokens per step."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    controls = {"model": W.Dropdown(options=list(MODELS), value=model, description="model"),
                "gpus": W.Dropdown(options=list(GPUS), value=gpus, description="GPUs"),
                "n_gpus": W.SelectionSlider(options=list(N_GPUS), value=n_gpus, description="how many"),
                "batch_m": W.SelectionSlider(options=list(BATCH_TOKENS_M), value=batch_m,
                                             description="M tokens/step")}
    return LiveFigure(controls, _draw, FIGSIZE)
