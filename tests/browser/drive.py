"""Driving JupyterLab and ipywidgets controls in the page, the way a reader does.

    open_notebook(page, lab, "notebooks/02_collectives.ipynb")
    run_all(page, timeout_s)                  Run > Run All Cells, wait until no cell is queued
    static_views(page) / live_view(page, i)   what the reader sees: (png base64, caption)
    move(page, root, name, control, how)      move one control with the keyboard or the mouse;
                                              returns the value the control should now hold
"""

from __future__ import annotations

import base64
import re
import time

# JupyterLab renders an error output like a stderr stream: tell them apart by their text.
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|^\s*(✗ |\w+(Error|Exception|Timeout|Interrupt)\b)")
REPRS = re.compile(r"\b(VBox|HBox|interactive|IntSlider|FloatLogSlider|MemoryCalculator|LiveFigure)\(|"
                   r"Error displaying widget|Loading widget")

READ_LIVE = """async (root) => {
  const img = root.querySelector('img.course-figure');
  const cap = root.querySelector('.course-caption');
  if (!img || !img.src) return null;
  const buf = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
  let s = '';
  for (let i = 0; i < buf.length; i += 0x8000) s += String.fromCharCode.apply(null, buf.subarray(i, i + 0x8000));
  return [btoa(s), cap ? cap.textContent : ''];
}"""

READ_STATIC = """(root) => {
  const img = root.querySelector('img');
  const cap = root.querySelector('pre');
  return [img ? img.getAttribute('src') : '', cap ? cap.textContent : '', root.textContent,
          img ? img.naturalWidth : 0];
}"""


def open_notebook(page, lab, path: str, timeout_s: float = 90) -> None:
    """Open `path` as a reader of a fresh clone would; wait for the idle kernel and for the stored
    outputs to finish rendering (their count stable for a second)."""
    page.goto(lab.url(path), timeout=timeout_s * 1000)  # a fresh workspace: this notebook's tab only
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    # the kernel has started and answered: the status bar reads "Python 3 (ipykernel) | Idle"
    try:
        page.get_by_text(re.compile(r"\| Idle$")).first.wait_for(timeout=timeout_s * 1000)
    except Exception as e:  # say what the server knows: the kernel's state and its last log lines
        try:
            kernels = [(k["id"][:8], k["execution_state"]) for k in lab.api("kernels", timeout_s=5)]
        except Exception as api_error:
            kernels = f"(the server did not answer: {api_error})"
        raise AssertionError(f"{path}: no idle kernel after {timeout_s:g} s; kernels {kernels}; "
                             f"JupyterLab's log ends:\n{lab.log_tail()}") from e
    count = "document.querySelectorAll('.jp-Notebook .jp-OutputArea-output, .jp-Notebook img').length"
    deadline, last, stable_since = time.monotonic() + 30, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = page.evaluate(count)
        if n != last:
            last, stable_since = n, time.monotonic()
        elif time.monotonic() - stable_since > 1.0:
            break
        time.sleep(0.2)


def output_text(page) -> str:
    return page.evaluate("Array.from(document.querySelectorAll('.jp-Notebook .jp-OutputArea-output'))"
                         ".map(e => e.innerText).join('\\n')")


def error_outputs(page) -> list[str]:
    """Texts of the error outputs (tracebacks, or the course's one-line check failures)."""
    texts = page.evaluate("Array.from(document.querySelectorAll("
                          "'.jp-Notebook [data-mime-type=\"application/vnd.jupyter.stderr\"]'))"
                          ".map(e => e.innerText)")
    return [t for t in texts if ERROR_TEXT.search(t)]


def unexecuted_cells(page) -> int:
    """Code cells without an execution count after Run All (an error aborts the ones after it)."""
    return page.evaluate("Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt'))"
                         ".filter(e => !/\\[\\d+\\]/.test(e.textContent)).length")


def queued_cells(page) -> int:
    return page.evaluate("Array.from(document.querySelectorAll('.jp-Notebook .jp-InputPrompt'))"
                         ".filter(e => e.textContent.includes('[*]')).length")


def run_all(page, timeout_s: float) -> float:
    """Edit > Clear Outputs of All Cells, then Run > Run All Cells; wait (bounded) until no cell is
    queued and either every code cell has run or an error stopped the run. Returns seconds."""
    start = time.monotonic()
    page.locator(".jp-NotebookPanel .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.get_by_role("menuitem", name="Edit", exact=True).click()
    page.get_by_role("menuitem", name="Clear Outputs of All Cells").click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.locator('li[data-command="runmenu:run-all"]').click()
    deadline = start + timeout_s
    while queued_cells(page) or (unexecuted_cells(page) and not error_outputs(page)):
        if time.monotonic() > deadline:
            raise AssertionError(f"Run All did not finish within {timeout_s:g} s "
                                 f"({queued_cells(page)} cells queued, {unexecuted_cells(page)} not run)")
        time.sleep(0.5)
    return time.monotonic() - start


def static_views(page) -> list[dict]:
    """Every widget cell's fallback as the reader sees it: PNG (base64), caption, all text."""
    views = []
    for root in page.locator(".course-static").all():
        src, caption, text, width = root.evaluate(READ_STATIC)
        views.append({"png": src.split(",", 1)[1] if src.startswith("data:image/png;base64,") else "",
                      "caption": caption, "text": text, "width": width, "root": root})
    return views


def live_view(root) -> tuple[str, str] | None:
    return root.evaluate(READ_LIVE)


def wait_for_view(root, expected, timeout_s: float = 30) -> tuple[str, str]:
    """Wait until the live widget shows `expected` (a widgets.View); return what it shows last."""
    want = (base64.b64encode(expected.png).decode(), expected.caption)
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        seen = live_view(root)
        if seen is not None and tuple(seen) == want:
            return want
        time.sleep(0.2)
    return tuple(seen) if seen else ("", "")


# ---------------------------------------------------------------- moving controls


def _index(control) -> tuple[int, list]:
    """(current index, option values) of a slider-like or selection control."""
    import ipywidgets as W

    if isinstance(control, W.widgets.widget_selection._Selection):
        values = list(control._options_values)
        return values.index(control.value), values
    values = list(range(control.min, control.max + 1, control.step))  # IntSlider
    return values.index(control.value), values


def move(page, root, name: str, control, how: str, typed: dict | None = None):
    """Move control `name` inside widget `root` by `how` ("keyboard" or "mouse"); return the value
    it now holds (what the in-process copy is set to), or raise LookupError if it cannot be moved."""
    import ipywidgets as W

    box = root.locator(f".course-control-{name}").first
    if getattr(control, "disabled", False):
        raise LookupError(f"{name!r} is disabled in this state: nothing to move")
    if hasattr(control, "options") and len(control.options) < 2:
        raise LookupError(f"{name!r} has a single valid value now: nothing to move")
    if isinstance(control, (W.IntSlider, W.SelectionSlider)):
        i, values = _index(control)
        handle = box.locator(".noUi-handle").first
        if how == "keyboard":
            handle.focus()
            forward = i + 1 < len(values)
            page.keyboard.press("ArrowRight" if forward else "ArrowLeft")
            return values[i + 1 if forward else i - 1]
        to_end = i < len(values) / 2  # drag to the farther end, in one move (no intermediate values)
        track = box.locator(".noUi-target").first.bounding_box()
        h = handle.bounding_box()
        page.mouse.move(h["x"] + h["width"] / 2, h["y"] + h["height"] / 2)
        page.mouse.down()
        page.mouse.move(track["x"] + track["width"] + 40 if to_end else track["x"] - 40,
                        h["y"] + h["height"] / 2, steps=1)
        page.mouse.up()
        return values[-1] if to_end else values[0]
    if isinstance(control, W.Dropdown):
        i, values = _index(control)
        select = box.locator("select").first
        j = i + 1 if i + 1 < len(values) else i - 1
        if how == "keyboard":  # in JupyterLab a bare arrow key on a closed list moves the cell
            select.focus()      # selection instead: open the list, move, choose, as a reader does
            page.keyboard.press("Space")
            page.keyboard.press("ArrowDown" if j > i else "ArrowUp")
            page.keyboard.press("Enter")
        else:
            select.select_option(index=len(values) - 1 if j > i else 0)  # what a click in the list does
            j = len(values) - 1 if j > i else 0
        return values[j]
    if isinstance(control, W.ToggleButtons):
        i, values = _index(control)
        j = (i + 1) % len(values) if how == "keyboard" else (len(values) - 1 if i != len(values) - 1 else 0)
        button = box.locator("button").nth(j)
        if how == "keyboard":
            button.focus()
            page.keyboard.press("Space")
        else:
            button.click()
        return values[j]
    if isinstance(control, W.Checkbox):
        target = box.locator("input[type=checkbox]").first
        if how == "keyboard":
            target.focus()
            page.keyboard.press("Space")
        else:
            target.click()
        return not control.value
    if isinstance(control, W.Text):
        texts = (typed or {}).get(name)
        if not texts:
            raise LookupError(f"no text to type into {name!r}: add it to registry.TYPED")
        text = texts[0] if how == "keyboard" else texts[-1]
        field = box.locator("input").first
        if how == "keyboard":
            field.focus()
        else:
            field.click()
        page.keyboard.press("Control+A")
        page.keyboard.type(text)
        page.keyboard.press("Enter")
        return text
    raise LookupError(f"no driver for {type(control).__name__} {name!r}")
