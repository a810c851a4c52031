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
    python tools/nb.py build --prose-only SRC      # only markdown changed: keep the stored outputs
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


def keep_outputs(nb, stored) -> None:
    """Give `nb`'s code cells the outputs of `stored`'s, which must hold the same code cells.

    Only markdown may differ: a code cell whose source or tags changed must be executed again,
    so any difference raises instead of storing outputs that the new code might not print.
    """
    new = [c for c in nb.cells if c.cell_type == "code"]
    old = [c for c in stored.cells if c.cell_type == "code"]
    for i, (n, o) in enumerate(zip(new, old)):
        if n.source != o.source or n.metadata.get("tags", []) != o.metadata.get("tags", []):
            raise ValueError(f"code cell {i} changed (first line {n.source.splitlines()[0]!r}): "
                             "build it without --prose-only so it is executed")
    if len(new) != len(old):
        raise ValueError(f"{len(new)} code cells against {len(old)} stored: build without --prose-only")
    for n, o in zip(new, old):
        n.outputs, n.execution_count, n.metadata = o.outputs, o.execution_count, o.metadata
    nb.metadata = stored.metadata  # the kernel's language_info, as the executed build stored it


def main(argv=None):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("sources", nargs="+")
    b.add_argument("--out", help="output path (only with one source)")
    b.add_argument("--no-execute", action="store_true")
    b.add_argument("--prose-only", action="store_true",
                   help="only markdown changed: reuse the stored notebook's outputs (checked)")
    t = sub.add_parser("time")
    t.add_argument("notebooks", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        for src in map(pathlib.Path, args.sources):
            out = pathlib.Path(args.out) if args.out else src.parent.parent / (src.stem + ".ipynb")
            nb = percent_to_notebook(src.read_text())
            if args.prose_only:
                keep_outputs(nb, nbformat.read(out, as_version=4))
                print(f"{out}: markdown rebuilt, stored outputs kept", flush=True)
            elif not args.no_execute:
                print(f"{out}: executed in {execute(nb, out.parent.resolve()):.1f} s", flush=True)
            nbformat.write(nb, out)
    else:
        for path in map(pathlib.Path, args.notebooks):
            nb = nbformat.read(path, as_version=4)
            print(f"{path}: {execute(nb, path.parent.resolve()):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
