"""Which gradients share a DDP bucket (notebook 03): a figure and a widget over the bucket cap.

    bucket_sizes(config)            [(name, bytes)] of a GPT's fp32 gradients, in parameter order
    draw_bucket_layout(ax, sizes, cap_mib)   one bar per gradient (width = its MiB), coloured by bucket
    bucket_view(config, cap_mib)    the widget's picture of one cap as a static widgets.View
    bucket_widget(config)           a slider over caps (show it with widgets.show_interactive)

Buckets come from `assign_buckets`, the rule the course's DDP uses (walk from the last
parameter, close a bucket once it holds at least the cap). The cap is in MiB, which is what
PyTorch's `bucket_cap_mb` means (it multiplies by 1024 * 1024).
"""

from __future__ import annotations

from course_lib.model import GPT
from course_lib.parallel.dp.ddp import assign_buckets

CAPS_MIB = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 25.0)  # the slider's stops; 25 is torch DDP's default
FIGSIZE = (9.0, 1.9)


def bucket_sizes(config) -> list[tuple[str, int]]:
    """(name, bytes of its fp32 gradient) for every parameter of GPT(config), in parameter order."""
    return [(name, p.numel() * 4) for name, p in GPT(config).named_parameters()]


def draw_bucket_layout(ax, sizes: list[tuple[str, int]], cap_mib: float) -> list[list[int]]:
    """Bars in the order backward produces the gradients (the last parameter first), coloured by
    bucket; returns the buckets (lists of parameter indices)."""
    import matplotlib

    buckets = assign_buckets([b for _, b in sizes], cap_mib * 2**20)
    colors = matplotlib.colormaps["tab10"]
    x = 0.0
    for k, idx in enumerate(buckets):
        for i in idx:
            width = sizes[i][1] / 2**20
            ax.barh(0, width, left=x, color=colors(k % 10), edgecolor="white", linewidth=0.3)
            x += width
    ax.set_xlim(0, x)
    ax.set_yticks([])
    ax.set_xlabel(f"MiB of gradient, in the order backward produces it ({sizes[-1][0]} ... {sizes[0][0]})",
                  fontsize=8)
    ax.set_title(f"bucket_cap_mb = {cap_mib:g} MiB: {len(buckets)} buckets for {len(sizes)} tensors", fontsize=9)
    return buckets


def _draw(fig, sizes, cap_mib) -> str:
    buckets = draw_bucket_layout(fig.add_subplot(), sizes, cap_mib)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.82, bottom=0.3)
    last = buckets[-1]
    return (f"cap {cap_mib:g} MiB: {len(buckets)} buckets; the last one ({len(last)} tensors, "
            f"{sum(sizes[i][1] for i in last) / 2**20:.2f} MiB) ends with {sizes[last[-1]][0]}")


def bucket_view(config, cap_mib: float = 0.25):
    from course_lib.widgets import render

    if cap_mib not in CAPS_MIB:
        raise ValueError(f"cap_mib={cap_mib!r} must be one of the slider's stops {CAPS_MIB}")
    return render(_draw, FIGSIZE, sizes=bucket_sizes(config), cap_mib=cap_mib)


def bucket_widget(config, cap_mib: float = 0.25):
    """A slider over CAPS_MIB above the layout for GPT(config)'s gradients."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    if cap_mib not in CAPS_MIB:
        raise ValueError(f"cap_mib={cap_mib!r} must be one of the slider's stops {CAPS_MIB}")
    cap = W.SelectionSlider(options=[(f"{c:g}", c) for c in CAPS_MIB], value=cap_mib, description="cap (MiB)")
    return LiveFigure({"cap_mib": cap}, _draw, FIGSIZE, fixed={"sizes": bucket_sizes(config)})
