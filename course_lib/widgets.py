"""How every widget of the course is shown: a static figure first, the interactive version on run.

    show_interactive(static, make_widget)
    LiveFigure(controls, draw, figsize)      controls + one fixed-size figure + a caption
    render(draw, figsize, **values)          one state as a View (PNG bytes + caption)

**What a reader sees.** `show_interactive` displays ONE output whose bundle carries several
mimetypes; every front end shows the richest one it can:

    application/vnd.jupyter.widget-view+json   the live widget   (a kernel ran this cell)
    text/html     the static figure (inline PNG), its caption, "Run this cell for the interactive version."
    image/png     the static figure alone            text/plain   caption + that line

JupyterLab renders the widget view only for output it trusts, i.e. output produced in the
reader's own session; a notebook opened from a fresh clone is untrusted, so it falls back to
the sanitised HTML (the static figure and the line), never to the widget's repr. nbconvert's
HTML export, nbviewer and other renderers that lack the widget's state fall back the same way,
so the exported HTML needs no network. The notebooks are built without saved widget state
(tools/nb.py), so there is no frozen copy of the widget that would appear and not respond;
a reader who trusts the notebook without running it gets JupyterLab's "model not found" line
in its place until the cell runs.

**First state = static figure.** `static()` returns a `View`, PNG bytes or a matplotlib Figure.
When the widget is a `LiveFigure` (or has a `first_view`), `show_interactive` checks that its
first state is byte-for-byte the static figure and caption, and raises otherwise.

**Fixed size and resolution.** `render` draws on a fresh Figure of the given size in
matplotlib's default style (the notebook's rcParams do not leak in), at DPI dots per inch,
without tight bounding boxes, and `LiveFigure` shows the PNG at exactly its pixel size: the
image neither rescales nor jumps when the caption changes. A `draw` that raises ValueError
(invalid settings) gives a grey placeholder instead of a stale chart, and the error in red.
"""

from __future__ import annotations

import base64
import html
import io
import struct
from dataclasses import dataclass
from typing import Callable

RUN_TO_INTERACT = "Run this cell for the interactive version."
DPI = 100
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
CSS_LIVE, CSS_STATIC = "course-live", "course-static"  # classes the browser test looks for


@dataclass(frozen=True)
class View:
    """One state of a widget as the reader sees it: a figure (PNG) and a caption under it."""

    png: bytes
    caption: str = ""
    valid: bool = True

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels, from the PNG header."""
        return struct.unpack(">II", self.png[16:24])

    def caption_html(self) -> str:
        if not self.caption:
            return ""
        color = "" if self.valid else "color:#b00;"
        return f"<pre class='course-caption' style='white-space:pre-wrap;{color}'>{html.escape(self.caption, quote=False)}</pre>"

    def static_html(self) -> str:
        """The fallback a reader sees without a live kernel: figure, caption, one line."""
        w, h = self.size
        src = "data:image/png;base64," + base64.b64encode(self.png).decode()
        return (f"<div class='{CSS_STATIC}'><img src='{src}' width='{w}' height='{h}' alt='static figure'>"
                f"{self.caption_html()}<p><em>{RUN_TO_INTERACT}</em></p></div>")


def figure_png(fig, dpi: int = DPI) -> bytes:
    """A matplotlib Figure as PNG bytes at its own size and `dpi` (no version stamp: stable bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def render(draw: Callable[..., str | None], figsize: tuple[float, float], **values) -> View:
    """Call `draw(fig, **values)` on a fresh figsize-inch Figure and return the View.

    `draw` returns the caption (or None). If it raises ValueError the settings are invalid:
    the figure is replaced by a grey placeholder and the caption is the error's message."""
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.style.context("default"):
        fig = Figure(figsize=figsize, dpi=DPI)
        FigureCanvasAgg(fig)
        try:
            caption = draw(fig, **values) or ""
        except ValueError as err:
            fig.clear()
            fig.set_facecolor("#e6e6e6")
            fig.text(0.5, 0.5, "invalid settings:\nnothing to draw", ha="center", va="center", color="#666",
                     fontsize=11)
            return View(figure_png(fig), f"invalid settings: {err}", valid=False)
        return View(figure_png(fig), caption)


def _as_view(static) -> View:
    if isinstance(static, View):
        return static
    if isinstance(static, (bytes, bytearray)):
        return View(bytes(static))
    png = figure_png(static)  # a matplotlib Figure
    import matplotlib.pyplot as plt

    plt.close(static)  # drawn by pyplot? then inline plotting must not show it a second time
    return View(png)


try:  # ipywidgets is a course dependency; the static functions above work without it
    import ipywidgets as _W
except ImportError:  # pragma: no cover
    _W = None


class LiveFigure(_W.VBox if _W else object):
    """Controls above (or beside) a fixed-size figure and a caption; any control change redraws.

    controls: {name: ipywidgets value widget}; `draw(fig, **values)` as in `render`, with the
    controls' values plus `fixed` (constant keyword arguments). Subclasses may override
    `values()` (to translate control values) and `on_change(name)` (e.g. to narrow another
    control's options to the valid ones) before the redraw."""

    def __init__(self, controls: dict, draw: Callable[..., str | None], figsize: tuple[float, float],
                 fixed: dict | None = None, beside: bool = False, controls_width: str = "360px"):
        if _W is None:
            raise ImportError("LiveFigure needs ipywidgets; use render() for a static figure")
        self.controls, self._draw, self._figsize, self._fixed = dict(controls), draw, figsize, dict(fixed or {})
        self._busy = False
        w, h = int(round(figsize[0] * DPI)), int(round(figsize[1] * DPI))
        px = _W.Layout(width=f"{w}px", height=f"{h}px", min_width=f"{w}px", min_height=f"{h}px",
                       object_fit="none", flex="0 0 auto")
        self.image = _W.Image(format="png", layout=px)
        self.caption = _W.HTML()
        for name, c in self.controls.items():
            c.add_class(f"course-control-{name}")
            c.style.description_width = "110px"
        self.image.add_class("course-figure")
        self.caption.add_class("course-caption-box")
        self.first_view = self.redraw()
        for name, c in self.controls.items():
            c.observe(lambda change, name=name: self._changed(name), names="value")
        panel = _W.VBox(list(self.controls.values()),
                        layout=_W.Layout(width=controls_width, min_width=controls_width, flex="0 0 auto")
                        if beside else _W.Layout())
        figure = _W.VBox([self.image, self.caption])
        super().__init__([_W.HBox([panel, figure])] if beside else [panel, figure])
        self.add_class(CSS_LIVE)

    def __repr__(self):  # what a plain-text front end prints: stable, never a widget tree
        return f"<{type(self).__name__}: {RUN_TO_INTERACT}>"

    def values(self) -> dict:
        return {**{name: c.value for name, c in self.controls.items()}, **self._fixed}

    def view(self, **overrides) -> View:
        """The View for the current control values (with `overrides`), without changing anything."""
        return render(self._draw, self._figsize, **{**self.values(), **overrides})

    def redraw(self) -> View:
        self.current = v = self.view()
        self.image.value = v.png
        self.caption.value = v.caption_html()
        return v

    def on_change(self, name: str) -> None:
        """Hook: runs after control `name` changed, before the redraw."""

    @staticmethod
    def set_options(control, options, value) -> None:
        """Give a selection control new options and a value in ONE message to the page; set one
        after the other, the page can echo a stale index back and the kernel takes it as a move."""
        with control.hold_sync():
            if list(control.options) != list(options):
                control.options = options
            control.value = value

    def _changed(self, name: str) -> None:
        if self._busy:
            return
        self._busy = True  # on_change may set other controls: redraw once, at the end
        try:
            self.on_change(name)
        finally:
            self._busy = False
        self.redraw()


def show_interactive(static, make_widget) -> None:
    """Display one output: the live widget for a kernel-backed reader, the static figure, its
    caption and one line saying to run the cell for everyone else (see the module docstring)."""
    from IPython.display import display

    view = _as_view(static())
    widget = make_widget()
    first = getattr(widget, "first_view", None)
    if first is not None and (first.png, first.caption) != (view.png, view.caption):
        raise RuntimeError(f"{type(widget).__name__}'s first state differs from the static figure "
                           f"(caption {first.caption!r} vs {view.caption!r}): build both from the same settings")
    bundle = {
        "text/html": view.static_html(),
        "image/png": base64.b64encode(view.png).decode(),
        "text/plain": "\n".join(filter(None, [view.caption, RUN_TO_INTERACT])),
    }
    if getattr(widget, "_model_id", None):  # an ipywidget: the live view, for front ends that can run it
        bundle[WIDGET_VIEW_MIME] = {"model_id": widget._model_id, "version_major": 2, "version_minor": 0}
    display(bundle, raw=True)
