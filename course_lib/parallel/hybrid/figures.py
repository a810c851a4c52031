"""Notebook 10's mesh picture and widget: a layout of 8 ranks on a cluster shape -> the groups of
each dimension (ranks coloured by group, nodes as grey boxes), the link each dimension crosses,
its traffic per step and the memory per rank of one model (course_lib.estimate).

    show_interactive(lambda: mesh_view(), mesh_widget)

Only valid layouts are offered (pp * dp * ep * tp = 8).
"""

from __future__ import annotations

import itertools

from course_lib.estimate import per_gpu_memory
from course_lib.estimate.params import MoEConfig
from course_lib.model import GPTConfig
from course_lib.dims import ParallelDims
from course_lib.parallel import topology
from course_lib.units import fmt_bytes

FIGSIZE = (8.0, 3.6)
WORLD = 8
DIMS = ("tp", "ep", "dp", "pp")  # panels, innermost first
# The widget's model: a 1.3B-parameter-class GPT whose MLPs are 8 experts (top-2), bf16, seq 2048.
MODEL = GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, d_model=2048, n_experts=8, top_k=2)
BATCH = 32  # global batch, sequences
LAYOUTS = [dict(zip(("pp", "dp", "ep", "tp"), c)) for c in itertools.product((1, 2, 4, 8), repeat=4)
           if c[0] * c[1] * c[2] * c[3] == WORLD]
ORDERS = {"topology-aware (tp innermost)": topology.TOPOLOGY_AWARE, "naive (pp innermost)": topology.NAIVE}
FIRST = dict(layout="pp 2 · dp 2 · ep 1 · tp 2", gpus_per_node=4, order="topology-aware (tp innermost)")


def layout_name(sizes: dict) -> str:
    return " · ".join(f"{d} {sizes[d]}" for d in ("pp", "dp", "ep", "tp"))


LAYOUT_NAMES = {layout_name(s): s for s in LAYOUTS}


def memory_per_rank(sizes: dict) -> int:
    """Bytes on the busiest rank for MODEL (bf16 mixed, ZeRO-1 over dp, micro-batch 1)."""
    from dataclasses import replace

    config = MoEConfig(replace(MODEL, n_experts=0), n_experts=MODEL.n_experts, top_k=MODEL.top_k)
    return per_gpu_memory(config, batch=1, seq=MODEL.block_size, zero_stage=1, **sizes)["total"]


def draw_mesh(fig, layout: str = FIRST["layout"], gpus_per_node: int = FIRST["gpus_per_node"],
              order: str = FIRST["order"]) -> str:
    """One panel per dimension: the 8 ranks in node boxes, coloured by that dimension's group."""
    if layout not in LAYOUT_NAMES:
        raise ValueError(f"layout={layout!r} must be one of {list(LAYOUT_NAMES)}")
    if order not in ORDERS:
        raise ValueError(f"order={order!r} must be one of {list(ORDERS)}")
    from matplotlib.patches import Rectangle

    sizes = LAYOUT_NAMES[layout]
    dims = ParallelDims(**sizes, microbatches=1)
    groups = topology.groups(sizes, ORDERS[order])
    traffic = topology.traffic_per_step(MODEL, dims, BATCH, dtype_bytes=2)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    for i, dim in enumerate(DIMS):
        ax = fig.add_subplot(len(DIMS), 1, i + 1)
        link = topology.link_of(dim, sizes, gpus_per_node, ORDERS[order])
        for node in range(WORLD // gpus_per_node):
            ax.add_patch(Rectangle((node * gpus_per_node - 0.45, -0.45), gpus_per_node - 0.1, 0.9, color="0.9",
                                   zorder=0))
        for g, ranks in enumerate(groups[dim]):
            for r in ranks:
                ax.scatter([r], [0], s=260, color=colors[g % len(colors)] if sizes[dim] > 1 else "0.75",
                           marker="s", zorder=2)
                ax.text(r, 0, str(r), ha="center", va="center", fontsize=7, color="white", zorder=3)
        sent = traffic.get(dim, {}).get("bytes_per_rank", 0)
        what = "no traffic" if sizes[dim] == 1 else \
            f"{'NVLink' if link == 'intra' else 'InfiniBand'}, {fmt_bytes(sent)}/step per rank"
        ax.text(WORLD - 0.3, 0, f"{dim} = {sizes[dim]}: {what}", va="center", fontsize=8,
                color="tab:red" if link == "inter" and dim == "tp" else "black")
        ax.set_xlim(-0.6, WORLD + 4.6)
        ax.set_ylim(-0.6, 0.6)
        ax.axis("off")
    fig.subplots_adjust(left=0.02, right=0.98, top=0.97, bottom=0.03, hspace=0.1)
    seconds = sum(r["seconds"] for r in topology.placement(MODEL, dims, BATCH, topology.ClusterShape(
        gpus_per_node, topology.DGX_H100.intra, topology.DGX_H100.inter), ORDERS[order]))
    return (f"{layout} on nodes of {gpus_per_node} GPUs, {order}: memory per rank "
            f"{fmt_bytes(memory_per_rank(sizes))}, communication {seconds * 1e3:,.0f} ms/step (H100 links)")


def mesh_view(**values):
    """The static figure: FIRST's state (or `values`) as a View."""
    from course_lib.widgets import render

    return render(draw_mesh, FIGSIZE, **{**FIRST, **values})


def mesh_widget(layout: str = FIRST["layout"], gpus_per_node: int = FIRST["gpus_per_node"],
                order: str = FIRST["order"]):
    """The live version: the valid 8-rank layouts, GPUs per node (2, 4, 8) and the order."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    controls = {"layout": W.Dropdown(options=list(LAYOUT_NAMES), value=layout, description="layout"),
                "gpus_per_node": W.Dropdown(options=[2, 4, 8], value=gpus_per_node, description="GPUs/node"),
                "order": W.Dropdown(options=list(ORDERS), value=order, description="order")}
    return LiveFigure(controls, draw_mesh, FIGSIZE)
