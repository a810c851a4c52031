"""Build the course notebooks from their readable sources, and execute them.

Sources live in `notebooks/src/NN_name.py` and `exercises/src/exNN_name.py` (built into
`notebooks/NN_name.ipynb` and `exercises/exNN_name.ipynb`), in "percent" format:

    # %% [markdown]
    # # A title
    # Prose, each line behind "# ".
    # %%
    code()
    # %% tags=["nbval-ignore-output"]
    timing_that_varies()

Cell tags are nbval's (see CONTRIBUTING.md): "nbval-ignore-output" (run, output not compared),
"nbval-skip" (not run under nbval), "raises-exception" (the error is the lesson).

    python tools/nb.py build notebooks/src/00_launching_ranks.py     # -> notebooks/00_launching_ranks.ipynb, executed
    COURSE_GRADE_WITH=solutions python tools/nb.py build exercises/src/ex00_all_reduce.py
    python tools/nb.py build --no-execute SRC                          # just convert
    python tools/nb.py time notebooks/*.ipynb                         # re-execute and print seconds

Executing stores the outputs, so the committed notebook is what nbval compares against.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

import nbformat
from nbclient import NotebookClient

CELL_TIMEOUT_S = 300
TAGS = re.compile(r"tags=(\[.*?\])")
KNOWN_TAGS = {"nbval-ignore-output", "nbval-skip", "raises-exception", "hide-input"}


def percent_to_notebook(text: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    kind, lines, tags = None, [], []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in body.splitlines())
            nb.cells.append(nbformat.v4.new_markdown_cell(body))
        elif body.strip():
            cell = nbformat.v4.new_code_cell(body)
            if tags:
                cell.metadata["tags"] = list(tags)
            nb.cells.append(cell)

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
            match = TAGS.search(line)
            tags = json.loads(match.group(1)) if match else []
            unknown = set(tags) - KNOWN_TAGS
            if unknown:
                raise ValueError(f"unknown cell tag(s) {sorted(unknown)} in {line!r}: use {sorted(KNOWN_TAGS)}")
        else:
            lines.append(line)
    flush()
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell["id"] = f"cell-{i:03d}"
    return nb


def execute(nb, cwd: pathlib.Path) -> float:
    start = time.perf_counter()
    # No saved widget state: without it every front end shows a widget cell's static figure until the
    # cell runs (course_lib/widgets.py), instead of a frozen copy of the widget that does not respond.
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", store_widget_state=False,
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("sources", nargs="+")
    b.add_argument("--out", help="output path (only with one source)")
    b.add_argument("--no-execute", action="store_true")
    t = sub.add_parser("time")
    t.add_argument("notebooks", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        for src in map(pathlib.Path, args.sources):
            out = pathlib.Path(args.out) if args.out else src.parent.parent / (src.stem + ".ipynb")
            nb = percent_to_notebook(src.read_text())
            if not args.no_execute:
                print(f"{out}: executed in {execute(nb, out.parent.resolve()):.1f} s", flush=True)
            nbformat.write(nb, out)
    else:
        for path in map(pathlib.Path, args.notebooks):
            nb = nbformat.read(path, as_version=4)
            print(f"{path}: {execute(nb, path.parent.resolve()):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
