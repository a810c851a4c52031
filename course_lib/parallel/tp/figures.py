"""Notebook 05's figures: the block-matrix picture, compute against communication per layer,
and the per-rank memory and bytes of one layer (the widget's drawing)."""

from __future__ import annotations

from course_lib.comm.costmodel import predict_time
from course_lib.dims import check_tp
from course_lib.estimate import activation_bytes, param_breakdown
from course_lib.parallel.tp.costs import layer_communication
from course_lib.units import fmt_bytes

RANK_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def _block(ax, x, y, w, h, color, text="", alpha=0.35):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", alpha=alpha, linewidth=1))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)


def plot_split_matmul(fig, tp: int = 2) -> None:
    """Y = X A split two ways on tp ranks: by columns of A (each rank an output slice) and by
    rows of A (each rank a partial sum of the whole output)."""
    grey = "lightgrey"
    for col, kind in enumerate(("column", "row")):
        ax = fig.add_subplot(1, 2, col + 1)
        ax.set_xlim(-0.2, 10.6)
        ax.set_ylim(-1.5, 4.6)
        ax.set_aspect("equal")
        ax.axis("off")
        w = 3.0 / tp
        if kind == "column":
            _block(ax, 0, 1, 3, 2, grey, "X\n(all of it,\nevery rank)")
            for r in range(tp):
                _block(ax, 4 + r * w, 0.5, w, 3, RANK_COLORS[r], f"A{r}")
                _block(ax, 7.6 + r * w, 1, w, 2, RANK_COLORS[r], f"Y{r}")
            ax.set_title("column split: Y = [X A0 | X A1 | ...]\nno sum needed; output stays split", fontsize=10)
        else:
            for r in range(tp):
                _block(ax, r * w, 1, w, 2, RANK_COLORS[r], f"X{r}")
                _block(ax, 4, 0.5 + (tp - 1 - r) * (3 / tp), 3, 3 / tp, RANK_COLORS[r], f"A{r}")
            _block(ax, 7.6, 1, 3, 2, grey, "Y = sum_r\nX_r A_r\n(all-reduce)")
            ax.set_title("row split: Y = X0 A0 + X1 A1 + ...\npartial sums must be added", fontsize=10)
        ax.text(3.5, 2, "x", ha="center", va="center", fontsize=14)
        ax.text(7.3, 2, "=", ha="center", va="center", fontsize=14)
        ax.text(5.3, -0.9, "colour = the rank holding the block", ha="center", fontsize=8, color="dimgray")


def compute_vs_comm(d_model: int, tp: int, link, batch: int = 1, seq: int = 2048, dtype_bytes: int = 2,
                    peak_flops: float = 989e12) -> tuple[float, float]:
    """(compute seconds, all-reduce seconds) of one layer's forward on one GPU: 24 b s h^2 / tp
    matmul FLOPs (f = 4h) at peak_flops (H100 SXM dense bf16: 989 TFLOP/s), against two ring
    all-reduces of b s h dtype_bytes on `link` (alpha-beta model)."""
    compute = 24 * batch * seq * d_model**2 / tp / peak_flops
    comm = 2 * predict_time("ring", batch * seq * d_model * dtype_bytes, tp, link)
    return compute, comm


def draw_layer_on_one_rank(fig, config, tp: int, sequence_parallel: bool, batch: int = 1, seq: int = 2048,
                           dtype_bytes: int = 2) -> str:
    """Left: one layer's weights and saved activations on one rank; right: bytes each rank puts on
    its ring link per layer (forward + backward) against tp, this tp marked. Returns the caption."""
    check_tp(tp, config.n_head, config.ff_dim)
    h, f = config.d_model, config.ff_dim
    parts = param_breakdown(config)
    b = int(config.bias)
    weights = dtype_bytes * ((4 * h * h + 3 * b * h + 2 * h * f + b * f) // tp + 2 * b * h + parts["norms"])
    acts = {s: activation_bytes(config, batch, seq, dtype_bytes, tp=tp, sequence_parallel=s,
                                attention="fused")["per_layer"] for s in (False, True)}
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    gib = 2**30
    ax1.bar(["weights", "activations\n(no SP)", "activations\n(SP)"],
            [weights / gib, acts[False] / gib, acts[True] / gib],
            color=["tab:gray", "tab:blue" if not sequence_parallel else "lightsteelblue",
                   "tab:blue" if sequence_parallel else "lightsteelblue"])
    ax1.set_ylabel("GiB per rank, one layer")
    ax1.set_title(f"one layer on one rank, tp={tp}", fontsize=10)
    tps = valid_tp(config)
    per = [layer_communication(batch, seq, h, t, sequence_parallel, dtype_bytes) for t in tps]
    ax2.plot(tps, [(p["ring_bytes_forward"] + p["ring_bytes_backward"]) / gib for p in per], "o-")
    mine = layer_communication(batch, seq, h, tp, sequence_parallel, dtype_bytes)
    ax2.plot([tp], [(mine["ring_bytes_forward"] + mine["ring_bytes_backward"]) / gib], "o", color="tab:red",
             markersize=10)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tp")
    ax2.set_ylabel("GiB per rank per layer on the link")
    ax2.set_title("ring bytes per layer, forward + backward", fontsize=10)
    fig.tight_layout()
    ops = ", ".join(f"{n} {op.replace('_', '-')}" for op, n in mine["forward"].items())
    return (f"per rank: qkv {3 * h // tp}x{h}, attn.proj {h}x{h // tp}, fc {f // tp}x{h}, mlp.proj {h}x{f // tp}"
            f" ({config.n_head // tp} heads)\n"
            f"weights {fmt_bytes(weights)}, activations {fmt_bytes(acts[sequence_parallel])} per layer; "
            f"forward: {ops} of {fmt_bytes(mine['message_bytes'])}, "
            f"{fmt_bytes(mine['ring_bytes_forward'])} on the link")


LAYER_FIGSIZE = (10.0, 3.6)


def valid_tp(config, most: int = 64) -> list[int]:
    """The tp values that split this config: those the rule book (course_lib.dims.check_tp) accepts."""
    out = []
    for t in range(1, most + 1):
        try:
            check_tp(t, config.n_head, config.ff_dim)
        except ValueError:
            continue
        out.append(t)
    return out


def _draw_layer(fig, tp, sequence_parallel, config):
    return draw_layer_on_one_rank(fig, config, tp, sequence_parallel)


def layer_view(config, tp: int = 8, sequence_parallel: bool = False):
    """The widget's static figure for one setting (a widgets.View)."""
    from course_lib.widgets import render

    return render(_draw_layer, LAYER_FIGSIZE, tp=tp, sequence_parallel=sequence_parallel, config=config)


def layer_widget(config, tp: int = 8, sequence_parallel: bool = False):
    """tp (only the valid ones) and sequence parallelism -> shapes, memory and bytes per layer."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    if tp not in valid_tp(config):
        raise ValueError(f"tp={tp} must be one of {valid_tp(config)}")
    controls = {"tp": W.Dropdown(options=valid_tp(config), value=tp, description="tp"),
                "sequence_parallel": W.Checkbox(value=sequence_parallel, description="sequence parallel")}
    return LiveFigure(controls, _draw_layer, LAYER_FIGSIZE, fixed={"config": config})
