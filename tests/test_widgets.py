"""course_lib.widgets (what a reader sees with and without a kernel) and the course's widgets.

The browser half (JupyterLab in headless Chromium) is tests/browser/, run by `make test-browser`."""

import base64

import ipywidgets as W
import pytest

from course_lib import widgets
from course_lib.comm import ringviz
from course_lib.estimate import calculator as C
from course_lib.estimate import calculator_widget as CW
from course_lib.parallel.dp import bucketviz
from course_lib.techniques import checkpoint_viz
from course_lib.widgets import RUN_TO_INTERACT, WIDGET_VIEW_MIME, LiveFigure, View, render, show_interactive


def _draw_line(fig, slope):
    if slope < 0:
        raise ValueError(f"slope={slope} must be >= 0")
    fig.add_subplot().plot([0, 1], [0, slope])
    return f"slope {slope}"


def test_render_is_fixed_size_and_deterministic():
    a, b = render(_draw_line, (3.0, 2.0), slope=1), render(_draw_line, (3.0, 2.0), slope=1)
    assert a == b and a.size == (300, 200) and a.caption == "slope 1" and a.valid
    assert render(_draw_line, (3.0, 2.0), slope=2).png != a.png


def test_invalid_settings_grey_out_instead_of_a_stale_chart():
    bad = render(_draw_line, (3.0, 2.0), slope=-1)
    assert not bad.valid and bad.caption == "invalid settings: slope=-1 must be >= 0" and bad.size == (300, 200)
    assert "color:#b00" in bad.caption_html()


def _shown(monkeypatch, static, make):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.append((objs, kw)))
    show_interactive(static, make)
    (objs, kw), = shown
    assert kw == {"raw": True}
    return objs[0]


def test_bundle_falls_back_to_the_static_figure_and_one_line(monkeypatch):
    view = render(_draw_line, (3.0, 2.0), slope=1)
    live = LiveFigure({"slope": W.IntSlider(value=1, min=0, max=3)}, _draw_line, (3.0, 2.0))
    bundle = _shown(monkeypatch, lambda: view, lambda: live)
    # the widget view for a live kernel; safe fallbacks (html, png, text) for everyone else
    assert bundle[WIDGET_VIEW_MIME]["model_id"] == live.model_id
    assert base64.b64decode(bundle["image/png"]) == view.png
    html = bundle["text/html"]
    assert base64.b64encode(view.png).decode() in html and RUN_TO_INTERACT in html and "slope 1" in html
    assert "LiveFigure" not in bundle["text/plain"] and RUN_TO_INTERACT in bundle["text/plain"]
    assert "VBox" not in repr(live)


def test_first_state_must_equal_the_static_figure(monkeypatch):
    live = LiveFigure({"slope": W.IntSlider(value=1, min=0, max=3)}, _draw_line, (3.0, 2.0))
    with pytest.raises(RuntimeError, match="first state differs from the static figure"):
        _shown(monkeypatch, lambda: render(_draw_line, (3.0, 2.0), slope=2), lambda: live)


def test_live_figure_redraws_on_change():
    live = LiveFigure({"slope": W.IntSlider(value=1, min=0, max=3)}, _draw_line, (3.0, 2.0))
    first = live.image.value
    live.controls["slope"].value = 3
    assert live.image.value != first and live.current.caption == "slope 3" and "slope 3" in live.caption.value
    assert live.image.layout.width == "300px" and live.image.layout.height == "200px"


@pytest.mark.parametrize("view, make", [
    (lambda: ringviz.ring_view(4), lambda: ringviz.ring_widget(4)),
    (lambda: checkpoint_viz.checkpoint_view(), lambda: checkpoint_viz.checkpoint_widget()),
    (lambda: CW.calculator_view(), lambda: CW.MemoryCalculator()),
])
def test_course_widgets_start_at_their_static_figure(view, make):
    assert make().first_view == view()


def test_bucket_widget_starts_at_its_static_figure(tiny_config):
    w = bucketviz.bucket_widget(tiny_config)
    assert w.first_view == bucketviz.bucket_view(tiny_config)
    assert w.first_view.caption.startswith("cap 0.25 MiB:")
    w.controls["cap_mib"].value = 25.0
    assert w.current.caption.startswith("cap 25 MiB: 1 buckets")
    with pytest.raises(ValueError, match="cap_mib=0.3 must be one of"):
        bucketviz.bucket_widget(tiny_config, cap_mib=0.3)


def test_ring_widget_steps():
    w = ringviz.ring_widget(4)
    assert w.controls["step"].max == 6
    w.controls["step"].value = 4
    assert w.current == ringviz.ring_view(4, 4) and w.current.caption == "step 4 of 6: all-gather"
    with pytest.raises(ValueError, match="world_size=1"):
        ringviz.ring_widget(1)


def test_checkpoint_widget_titles_are_formatted():
    w = checkpoint_viz.checkpoint_widget()
    labels = [label for label, _ in w.controls["a_over_b"].options]
    assert labels == ["1/4", "1/2", "1", "2", "4", "8", "16", "32"]
    with pytest.raises(ValueError, match="a_over_b=3 must be one of"):
        checkpoint_viz.checkpoint_view(16, 3)


# ---------------------------------------------------------------- the memory calculator


def test_tokens_are_typed_and_exact():
    assert C.parse_tokens("300B") == 300e9 and C.parse_tokens("15T") == 15e12 and C.parse_tokens(" 2e9 ") == 2e9
    assert C.fmt_tokens(300e9) == "300B" and C.fmt_tokens(15e12) == "15T" and C.fmt_tokens(409600) == "409.6K"
    for bad in ("abc", "0", "-3B", "1.2.3T"):
        with pytest.raises(ValueError, match="tokens="):
            C.parse_tokens(bad)


def test_calculator_first_state_is_the_prose_number():
    w = CW.MemoryCalculator()
    assert w.controls["tokens"].value == "300B"
    assert "300B tokens -> 29.2 days on 1024 GPUs" in w.first_view.caption  # the static text of notebook 01
    w.controls["preset"].value = "Llama-3 405B"
    assert w.controls["tokens"].value == "15T" and "15T tokens" in w.current.caption


def test_calculator_offers_only_valid_layouts():
    w = CW.MemoryCalculator()
    assert list(w.controls["tp"].options) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]  # divisors of 96 heads
    assert list(w.controls["pp"].options) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]  # of 96 layers
    w.controls["preset"].value = "Llama-3 8B"  # 32 heads, 8 KV heads: tp divides both
    assert list(w.controls["tp"].options) == [1, 2, 4, 8] and w.current.valid
    w.controls["n_experts"].value = 6
    assert list(w.controls["ep"].options) == [1, 2, 3, 6] and list(w.controls["top_k"].options) == list(range(1, 7))
    w.controls["ep"].value = 6
    w.controls["n_experts"].value = 4  # ep=6 no longer divides: the nearest valid degree is taken
    assert w.controls["ep"].value == 4 and w.current.valid
    w.controls["n_layer"].value = 7
    assert list(w.controls["pp"].options) == [1, 7]


def test_calculator_gpus_say_gb_and_gib():
    labels = [label for label, _ in CW.MemoryCalculator().controls["gpu"].options]
    for expected in ("H100 SXM: 80 GB = 74.5 GiB", "H200 SXM: 141 GB = 131.3 GiB", "B200: 180 GB = 167.6 GiB", "GB200: 186 GB = 173.2 GiB",
                     "MI300X: 192 GB = 178.8 GiB", "B300: 288 GB = 268.2 GiB", "MI355X: 288 GB = 268.2 GiB"):
        assert expected in labels
    r = C.evaluate(C.Settings(gpu="H200 SXM 141 GB"))
    assert r["gpu"].memory == 141e9
