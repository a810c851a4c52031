"""Explore the activation-checkpointing memory model (notebook 04): a figure and a widget.

    checkpoint_view(L, a_over_b)    M(k) = ceil(L/k) b + k a for k = 1..L, as a static widgets.View
    checkpoint_widget(L, a_over_b)  sliders over L and a/b (show it with widgets.show_interactive)

M(k) is `checkpoint_memory`'s peak in units of b (the boundary activation kept per segment),
a is what one layer saves inside a segment; the best k is near sqrt(L b / a).
"""

from __future__ import annotations

import math
from fractions import Fraction

from course_lib._validate import check_int
from course_lib.techniques.activation_checkpointing import checkpoint_memory

RATIOS = tuple(Fraction(2) ** e for e in range(-2, 6))  # a/b = 1/4 ... 32, one octave per stop
FIGSIZE = (5.6, 3.3)


def _label(r: Fraction) -> str:
    return str(r)  # '1/4', '1', '32'


def _draw(fig, L: int, a_over_b: Fraction) -> str:
    ks = range(1, L + 1)
    peaks = [checkpoint_memory(L, k, float(a_over_b), 1.0)["peak"] for k in ks]
    best = min(ks, key=lambda k: peaks[k - 1])
    ax = fig.add_subplot()
    ax.plot(ks, peaks, "o-", ms=3)
    ax.axvline(best, color="k", lw=0.6)
    ax.set_title(f"L = {L}, a/b = {_label(a_over_b)}: best k = {best}  "
                 f"(√(L·b/a) = {math.sqrt(L / a_over_b):.1f})", fontsize=10)
    ax.set_xlabel("k (layers per segment)")
    ax.set_ylabel("peak (units of b)")
    fig.subplots_adjust(left=0.12, right=0.97, top=0.89, bottom=0.15)
    return f"best k = {best}: peak {peaks[best - 1]:g} b, against {peaks[0]:g} b at k = 1 and {peaks[-1]:g} b at k = L"


def _check(L, a_over_b):
    check_int("L", L, minimum=2, maximum=64, rule="an int between 2 and 64")
    if a_over_b not in RATIOS:
        raise ValueError(f"a_over_b={a_over_b} must be one of {[_label(r) for r in RATIOS]}")


def checkpoint_view(L: int = 16, a_over_b=1):
    from course_lib.widgets import render

    _check(L, Fraction(a_over_b))
    return render(_draw, FIGSIZE, L=L, a_over_b=Fraction(a_over_b))


def checkpoint_widget(L: int = 16, a_over_b=1):
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    _check(L, Fraction(a_over_b))
    controls = {"L": W.IntSlider(value=L, min=2, max=64, description="L (layers)"),
                "a_over_b": W.SelectionSlider(options=[(_label(r), r) for r in RATIOS], value=Fraction(a_over_b),
                                              description="a / b")}
    return LiveFigure(controls, _draw, FIGSIZE)
