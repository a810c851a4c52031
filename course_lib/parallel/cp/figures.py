"""Notebook 09's figures: attention memory against length, who computes which score under a
causal mask (contiguous against zig-zag chunks), the ring's per-rank timeline, the methods'
bytes, the loss curves, and the widget (sequence length x cp x method -> memory and traffic
per rank). Drawing only: the numbers come from the layout, the runs and the estimator."""

from __future__ import annotations

import torch

from course_lib.estimate import LLAMA3_8B
from course_lib.estimate.context import cp_costs
from course_lib.parallel.cp.layout import SequenceLayout, attention_work
from course_lib.units import GiB, MiB, fmt_bytes
from course_lib.widgets import LiveFigure, render

RANK_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive")
LANE_COLORS = {"compute": "tab:blue", "K/V": "tab:red", "dK/dV": "tab:purple"}
LANE_OFFSETS = {"compute": -0.2, "K/V": 0.1, "dK/dV": 0.3}  # rows of one rank, top to bottom


# ------------------------------------------------------------------ attention memory against length
def plot_attention_memory(ax, seqs, measured: dict[str, list[int]]):
    """Bytes autograd saved for one attention call against the sequence length, one line per
    implementation (log-log: a slope of 2 is quadratic, of 1 linear)."""
    for name, values in measured.items():
        ax.plot(seqs, [v / 2**20 for v in values], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(list(seqs), [str(s) for s in seqs])
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("MiB saved for backward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


# ------------------------------------------------------------------ the causal imbalance
def causal_owners(seq_len: int, cp: int, load_balance: bool):
    """A (seq_len, seq_len) integer matrix: entry (q, k) is the rank that computes the score of
    query q against key k (the rank holding query q), or -1 where the causal mask hides it
    (k > q). Its counts per rank are the score pairs each rank computes."""
    layout = SequenceLayout(seq_len, cp, load_balance)
    owner = torch.empty(seq_len, dtype=torch.long)
    for r in range(cp):
        owner[layout.positions(r)] = r
    q = torch.arange(seq_len)[:, None]
    k = torch.arange(seq_len)[None, :]
    return torch.where(k <= q, owner[:, None].expand(seq_len, seq_len), torch.full((seq_len, seq_len), -1))


def plot_causal_owners(ax, seq_len: int, cp: int, load_balance: bool) -> list[int]:
    """Draw causal_owners as a picture (rows queries, columns keys, colour the rank) and return
    the number of coloured cells per rank."""
    from matplotlib.colors import ListedColormap

    m = causal_owners(seq_len, cp, load_balance)
    cmap = ListedColormap(["white", *RANK_COLORS[:cp]])
    ax.imshow((m + 1).numpy(), cmap=cmap, vmin=0, vmax=cp, interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    counts = [int((m == r).sum()) for r in range(cp)]
    kind = "zig-zag (2cp chunks)" if load_balance else "contiguous (cp chunks)"
    ax.set_title(f"{kind}: pairs per rank {counts}", fontsize=9)
    return counts


def plot_work_per_rank(ax, seq_len: int, cp: int):
    """Causal score pairs per rank (attention_work), contiguous against zig-zag, as bars."""
    width = 0.4
    for i, (lb, label) in enumerate(((False, "contiguous"), (True, "zig-zag"))):
        work = attention_work(seq_len, cp, lb)
        xs = [r + (i - 0.5) * width for r in range(cp)]
        ax.bar(xs, work, width, label=label, color="tab:gray" if not lb else "tab:green")
    ax.axhline(seq_len * (seq_len + 1) / 2 / cp, color="black", linestyle="--", linewidth=1, label="perfect share")
    ax.set_xticks(range(cp), [f"rank {r}" for r in range(cp)])
    ax.set_ylabel("score pairs (query, key)")
    ax.set_title(f"causal attention work per rank, T = {seq_len:,}, cp = {cp}", fontsize=9)
    ax.legend(fontsize=8)


# ------------------------------------------------------------------ the ring on a timeline
def plot_ring_timeline(ax, per_rank_events, title: str = ""):
    """Three lanes per rank: compute (each block's attention, named after the rank whose K/V it
    used) on top, then the K/V and the dK/dV messages in flight (posted -> waited on). Times in ms from the first
    event. per_rank_events: one list of (name, start, end, lane) per rank (viz_ring)."""
    from matplotlib.patches import Patch

    t0 = min(e[1] for events in per_rank_events for e in events)
    span = max(e[2] for events in per_rank_events for e in events) - t0
    for rank, events in enumerate(per_rank_events):
        for name, start, end, lane in events:
            y, h = rank + LANE_OFFSETS.get(lane, 0.3), 0.3 if lane == "compute" else 0.16
            ax.barh(y, (end - start) * 1e3, left=(start - t0) * 1e3, height=h, color=LANE_COLORS.get(lane, "grey"),
                    edgecolor="black", linewidth=0.3, alpha=0.9 if lane == "compute" else 0.6)
            if lane == "compute" and (end - start) > 0.06 * span:
                ax.text((start + end - 2 * t0) / 2 * 1e3, y, name.split(" ", 1)[1], ha="center", va="center",
                        fontsize=6, color="white")
    ax.set_yticks(range(len(per_rank_events)), [f"rank {r}" for r in range(len(per_rank_events))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[Patch(color=c, label=lane if lane == "compute" else f"{lane} in flight")
                       for lane, c in LANE_COLORS.items()], fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title, fontsize=9)


# ------------------------------------------------------------------ the widget
SEQ_CHOICES = tuple(4096 * 2**k for k in range(9))  # 4K ... 1M tokens
CP_CHOICES = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("ring", "allgather", "ulysses")
H100_BYTES = 80 * 10**9
FIGSIZE = (10, 3.6)


def _tokens(n: int) -> str:
    return f"{n // 2**20}M" if n >= 2**20 else f"{n // 1024}K"


def _draw(fig, seq: int, cp: int, method: str, config=None, model_name: str = "Llama-3 8B") -> str:
    config = LLAMA3_8B if config is None else config
    if seq not in SEQ_CHOICES or cp not in CP_CHOICES or method not in METHODS:
        raise ValueError(f"seq={seq!r}, cp={cp!r}, method={method!r}: pick from the controls")
    here = cp_costs(config, seq, cp, method)  # raises ValueError (the rule book) for e.g. Ulysses with cp > heads
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for c, style in ((1, "k--"), (cp, "o-")):
        ys = [cp_costs(config, s, c, method)["activations"] / GiB for s in SEQ_CHOICES]
        left.plot(SEQ_CHOICES, ys, style, markersize=3, label="cp = 1" if c == 1 else f"cp = {cp}, {method}")
    left.plot([seq], [here["activations"] / GiB], "o", color="tab:red", markersize=8, zorder=3)
    left.axhline(H100_BYTES / GiB, color="red", linestyle=":", linewidth=1, label="H100 80 GB")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xticks(list(SEQ_CHOICES), [_tokens(s) for s in SEQ_CHOICES], fontsize=7)
    left.set_xlabel("sequence length T")
    left.set_ylabel("activations per rank (GiB)")
    left.set_title(f"{model_name}, one sequence, bf16, fused attention", fontsize=9)
    left.legend(fontsize=7, loc="upper left")
    heights, labels = [], []
    for m in METHODS:
        try:
            heights.append(cp_costs(config, seq, cp, m)["bytes_per_layer"] / MiB)
        except ValueError:  # Ulysses beyond the heads: not a layout
            heights.append(0.0)
        labels.append(m if heights[-1] or cp == 1 else f"{m}\n(needs cp | heads)")
    bars = right.bar(range(len(METHODS)), heights, color=["tab:red" if m == method else "tab:gray" for m in METHODS])
    for b, h in zip(bars, heights):
        right.text(b.get_x() + b.get_width() / 2, h, f"{h:,.0f}", ha="center", va="bottom", fontsize=8)
    right.set_xticks(range(len(METHODS)), labels, fontsize=8)
    right.set_ylabel("MiB sent per rank per layer")
    right.set_ylim(0, max(max(heights), 1.0) * 1.2)
    right.set_title(f"T = {_tokens(seq)}, cp = {cp}: forward + backward, on the wire", fontsize=9)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.18, wspace=0.3)
    fits = "fits" if here["activations"] <= H100_BYTES else "does not fit"
    return (f"{method}, T = {seq:,} tokens over cp = {cp}: {here['seq_per_rank']:,} tokens per rank; activations "
            f"{here['activations'] / GiB:,.1f} GiB per rank ({fits} in an 80 GB H100 before the weights); "
            f"{fmt_bytes(here['bytes_per_layer'])} sent per rank per layer.")


def cp_view(seq: int = 131072, cp: int = 8, method: str = "ring"):
    """The widget's first state as a static View."""
    return render(_draw, FIGSIZE, seq=seq, cp=cp, method=method)


def cp_widget(seq: int = 131072, cp: int = 8, method: str = "ring"):
    """Controls: sequence length (4K-1M), cp (powers of two), method."""
    import ipywidgets as W

    controls = {"seq": W.SelectionSlider(options=[(_tokens(s), s) for s in SEQ_CHOICES], value=seq,
                                         description="sequence T"),
                "cp": W.SelectionSlider(options=list(CP_CHOICES), value=cp, description="cp ranks"),
                "method": W.ToggleButtons(options=list(METHODS), value=method, description="method")}
    return LiveFigure(controls, _draw, FIGSIZE)
