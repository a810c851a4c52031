"""Every widget of the course in JupyterLab in headless Chromium, as a reader meets it.

For each notebook of registry.WIDGETS: open it as from a fresh clone (untrusted, not run) and
check that each widget cell shows its static figure and the one line, never a widget repr;
Run All; check that no cell has an error output; check that each widget's first state is the
static figure it replaced (same PNG bytes, same caption); move every control with the keyboard
and with the mouse and check that the widget shows exactly what an in-process copy of the same
widget computes for the new value; no browser console errors. Screenshots of every state go
to the artifacts folder.
"""

import base64
import json
import re

import pytest

import drive
from conftest import NOTEBOOKS
from course_lib.widgets import RUN_TO_INTERACT, WIDGET_VIEW_MIME
from registry import TYPED, WIDGETS

RUN_ALL_TIMEOUT_S = 300


def _entries(name):
    return [(e, None) if callable(e) else e for e in WIDGETS[name]]


PROGRESS_BAR = re.compile(r"\d+%\|")  # tqdm's notebook progress bars are widgets too, but not controls


def _widget_cells(path):
    nb = json.loads(path.read_text())
    return [o for c in nb["cells"] for o in c.get("outputs", []) if WIDGET_VIEW_MIME in o.get("data", {})
            and not PROGRESS_BAR.search("".join(o["data"].get("text/plain", "")))]


def test_every_notebook_with_a_widget_is_registered():
    with_widgets = {p.stem for p in NOTEBOOKS.glob("*.ipynb") if _widget_cells(p)}
    missing = with_widgets - set(WIDGETS)
    assert not missing, f"notebooks with widgets missing from tests/browser/registry.py: {sorted(missing)}"
    for name in WIDGETS:
        outputs = _widget_cells(NOTEBOOKS / f"{name}.ipynb")
        assert len(outputs) == len(WIDGETS[name]), f"{name}: {len(outputs)} widget outputs, registered {len(WIDGETS[name])}"
        for o in outputs:  # shown through show_interactive: a static fallback in the same bundle
            html = o["data"].get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html  # nbformat may store lines
            assert RUN_TO_INTERACT in html, f"{name}: a widget not shown with show_interactive"


def _slug(text):
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(text))[:40]


@pytest.mark.parametrize("name", sorted(WIDGETS))
def test_widgets_in_the_browser(name, lab, lab_page, artifacts):
    page = lab_page
    out = artifacts / name
    out.mkdir(parents=True, exist_ok=True)
    entries = _entries(name)
    shadows = [make() for make, _ in entries]

    # 1. A reader who opens the notebook without running it: static figure + one line, no repr.
    drive.open_notebook(page, lab, f"notebooks/{name}.ipynb")
    text = drive.output_text(page)
    assert not drive.REPRS.search(text), f"a widget repr shows before running: {drive.REPRS.search(text).group(0)!r}"
    statics = drive.static_views(page)
    assert len(statics) == len(entries), f"{len(statics)} static fallbacks shown, {len(entries)} widgets registered"
    assert page.locator(".course-live").count() == 0
    for i, (static, shadow) in enumerate(zip(statics, shadows)):
        static["root"].scroll_into_view_if_needed()
        static["root"].screenshot(path=out / f"w{i}_0_before_running.png")
        assert static["width"] > 0 and RUN_TO_INTERACT in static["text"]
        assert base64.b64decode(static["png"]) == shadow.first_view.png, \
            "the stored static figure differs from what the widget draws now: rebuild the notebook"
        assert static["caption"] == shadow.first_view.caption

    # 2. Run All: no error output anywhere, then every widget is live and starts at its static figure.
    seconds = drive.run_all(page, RUN_ALL_TIMEOUT_S)
    print(f"{name}: Run All took {seconds:.1f} s")
    errors = drive.error_outputs(page)
    assert not errors, f"error output after Run All: {errors[0][:2000]}"
    assert drive.unexecuted_cells(page) == 0, "cells left unexecuted after Run All (an error stopped the run?)"
    page.wait_for_function(f"document.querySelectorAll('.course-live img.course-figure').length >= {len(entries)}",
                           timeout=60_000)
    lives = page.locator(".course-live").all()
    assert len(lives) == len(entries)
    for i, (root, static, (_, controls), shadow) in enumerate(zip(lives, statics, entries, shadows)):
        root.scroll_into_view_if_needed()
        seen = drive.wait_for_view(root, shadow.first_view)
        root.screenshot(path=out / f"w{i}_1_first_state.png")
        assert seen == (static["png"], static["caption"]), "the widget's first state differs from the static output"

        # 3. Move every control with the keyboard, then with the mouse; the widget must show what
        #    the in-process copy computes for the same value (and so must have changed).
        step = 2
        for control_name in controls or list(shadow.controls):
            moved = 0
            for how in ("keyboard", "mouse"):
                before = (base64.b64encode(shadow.current.png).decode(), shadow.current.caption)
                try:
                    value = drive.move(page, root, control_name, shadow.controls[control_name], how, TYPED)
                except LookupError as why:  # e.g. tp when the heads leave one valid degree
                    print(f"{name}: {control_name} by {how}: skipped ({why})")
                    continue
                moved += 1
                shadow.controls[control_name].value = value
                expected = shadow.current
                seen = drive.wait_for_view(root, expected)
                root.screenshot(path=out / f"w{i}_{step}_{control_name}_{how}_{_slug(value)}.png")
                step += 1
                assert seen == (base64.b64encode(expected.png).decode(), expected.caption), (
                    f"{control_name} moved by {how} to {value!r}: the widget shows {seen[1]!r}, "
                    f"expected {expected.caption!r}")
                if (base64.b64encode(expected.png).decode(), expected.caption) == before:
                    pytest.fail(f"{control_name} moved by {how} to {value!r} but the expected state did not change")
            c = shadow.controls[control_name]
            if not moved and len(getattr(c, "options", "ab")) > 1 and not c.disabled:
                pytest.fail(f"{control_name} could be moved neither by keyboard nor by mouse")
    assert not drive.error_outputs(page)
    assert not page.console_errors, "browser console errors:\n" + "\n".join(page.console_errors)
