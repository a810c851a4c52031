"""Notebook 07's widget: number of experts, top_k and capacity factor -> each expert's load on
one real batch (512 tokens through layer 0 of a fresh MoE GPT), kept and dropped.

    show_interactive(lambda: load_view(), load_widget)

Only valid settings are offered: top_k never exceeds the number of experts.
"""

from __future__ import annotations

import functools

import torch

from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT, GPTConfig
from course_lib.model.moe import routing_stats

FIGSIZE = (6.5, 3.2)
EXPERTS = (2, 4, 8, 16)
TOP_K = (1, 2, 4)
FACTORS = (("none", 0.0), ("0.5", 0.5), ("0.75", 0.75), ("1", 1.0), ("1.25", 1.25), ("1.5", 1.5), ("2", 2.0))
FIRST = dict(n_experts=8, top_k=2, capacity_factor=1.0)
BLOCK, BATCH = 64, 8


@functools.lru_cache(maxsize=1)
def view_batch() -> torch.Tensor:
    """The batch every state of the widget routes (8 sequences of 64 characters, seeded)."""
    x, _ = get_batch(CharDataset("train", BLOCK), BATCH, torch.Generator().manual_seed(7))
    return x


def valid_top_k(n_experts: int) -> list[int]:
    return [k for k in TOP_K if k <= n_experts]


def draw_load(fig, n_experts: int, top_k: int, capacity_factor: float) -> str:
    """Bars of kept (blue) and dropped (red) assignments per expert, the capacity as a line.
    capacity_factor 0 means no limit."""
    if top_k not in valid_top_k(n_experts):
        raise ValueError(f"top_k={top_k} must be one of {valid_top_k(n_experts)} for n_experts={n_experts}")
    cf = capacity_factor or None
    x = view_batch()
    cfg = GPTConfig.tiny(CharDataset("train", BLOCK).vocab_size, n_experts=n_experts, top_k=top_k, capacity_factor=cf)
    model = GPT(cfg, seed=0)
    with torch.no_grad():
        model(x)
    s = routing_stats(model)[0]
    ax = fig.add_subplot(1, 1, 1)
    ax.bar(range(n_experts), s.kept.numpy(), color="tab:blue", label="kept")
    ax.bar(range(n_experts), s.dropped.numpy(), bottom=s.kept.numpy(), color="tab:red", label="dropped")
    if s.capacity is not None:
        ax.axhline(s.capacity, color="k", ls="--", lw=1, label=f"capacity C = {s.capacity}")
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments (layer 0)")
    ax.set_xticks(range(n_experts))
    ax.set_ylim(0, x.numel() * top_k / n_experts * 2.6)
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    fig.subplots_adjust(bottom=0.16, top=0.95)
    cap = "no capacity limit" if cf is None else f"capacity factor {cf:g}"
    return (f"{n_experts} experts, top-{top_k}, {cap}: {int(s.routed.sum())} assignments, "
            f"{int(s.dropped.sum())} dropped ({s.drop_fraction:.1%})")


def load_view(**values):
    """The static figure: FIRST's state (or `values`) as a View."""
    from course_lib.widgets import render

    return render(draw_load, FIGSIZE, **{**FIRST, **values})


def load_widget(n_experts: int = FIRST["n_experts"], top_k: int = FIRST["top_k"],
                capacity_factor: float = FIRST["capacity_factor"]):
    """The live version: dropdowns for experts and top_k (narrowed to the valid ones), a slider
    for the capacity factor."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    class LoadWidget(LiveFigure):
        def on_change(self, name):
            if name == "n_experts":
                k = self.controls["top_k"]
                valid = valid_top_k(self.controls["n_experts"].value)
                value = k.value if k.value in valid else valid[-1]
                k.options = valid
                k.value = value

    controls = {"n_experts": W.Dropdown(options=list(EXPERTS), value=n_experts, description="experts"),
                "top_k": W.Dropdown(options=valid_top_k(n_experts), value=top_k, description="top_k"),
                "capacity_factor": W.SelectionSlider(options=list(FACTORS), value=capacity_factor,
                                                     description="capacity factor")}
    return LoadWidget(controls, draw_load, FIGSIZE)
