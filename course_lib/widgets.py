"""How every widget of the course is shown: a static figure first, the interactive version on run.

    show_interactive(static, make_widget)

`static()` draws the figure of the widget's first state (a matplotlib Figure); `make_widget()`
builds the ipywidgets control. A reader who opens a notebook without running it (or reads it
rendered elsewhere) sees the static figure and one line saying that running the cell makes it
interactive; a reader who runs the cell gets the widget, whose first state is that figure.
"""

from __future__ import annotations

import io

RUN_TO_INTERACT = "Run this cell to explore it interactively."


def figure_png(fig, dpi: int = 100) -> bytes:
    """A matplotlib Figure as PNG bytes at a fixed size and resolution."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def show_interactive(static, make_widget):
    """Display the static figure with a one-line note, then the live widget (see module docstring)."""
    from IPython.display import Image, Markdown, display

    fig = static()
    display(Image(figure_png(fig)), Markdown(f"*{RUN_TO_INTERACT}*"))
    import matplotlib.pyplot as plt

    plt.close(fig)
    widget = make_widget()
    display(widget)
    return None
