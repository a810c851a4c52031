"""Give every notebook its "Open in Colab" link and its Colab set-up cell (course_lib/colab.py).

    python tools/colab.py --apply                          # notebooks/ and exercises/
    python tools/colab.py --apply exercises                # one folder
    python tools/colab.py --apply notebooks/src/08_zero_fsdp.py
    python tools/colab.py --check                          # exit 1 if a notebook lacks them or has old ones

Each notebook gets, in its source (`notebooks/src/NN_name.py`, `exercises/src/exNN_name.py`) and
in its committed .ipynb alike:

* a first markdown cell with the link that opens the committed notebook in Colab;
* a code cell before its first code cell that, in Colab only, installs the course at
  course_lib.colab.REVISION and prints what differs there. Outside Colab it does nothing and
  prints nothing, so the .ipynb is edited in place, not executed again: the new cell has no
  outputs and no execution count, every other cell keeps its outputs, and the cells are then
  exactly those `tools/nb.py build` makes from the source (ids included).

Idempotent: cells it inserted before are replaced by the current ones (a new REVISION or
REPOSITORY reaches every notebook by running it again). A notebook whose .ipynb is not built
from its current source is left alone and named (build it first; exit status 1). A new source with
no .ipynb yet gets the cells in its source only, and its first build makes the notebook.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))  # course_lib from this checkout, installed or not
from nb import percent_to_notebook  # noqa: E402

from course_lib import colab  # noqa: E402

FOLDERS = ("notebooks", "exercises")
BADGE_START = "[**Open in Colab**](https://colab.research.google.com/"


def _is_badge(cell_type: str, source: str) -> bool:
    return cell_type == "markdown" and source.startswith(BADGE_START)


def _is_setup(cell_type: str, source: str) -> bool:
    return cell_type == "code" and colab.is_setup_cell(source)


# ------------------------------------------------------------------------------------ sources

def _chunks(text: str) -> tuple[str, list[str]]:
    """(text before the first cell, [each cell's text from its `# %%` line to the next])."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("# %%")]
    if not starts:
        raise ValueError("no `# %%` cell in the source")
    head = "".join(lines[:starts[0]])
    return head, ["".join(lines[a:b]) for a, b in zip(starts, starts[1:] + [len(lines)])]


def _chunk_cell(chunk: str) -> tuple[str, str]:
    cells = percent_to_notebook(chunk).cells
    if not cells:
        return "code", ""  # an empty code cell: nb.py drops it
    return cells[0].cell_type, cells[0].source


def edit_source(text: str, folder: str, notebook: str) -> str:
    """The percent-format source with the current link and set-up cell (and no older ones)."""
    head, chunks = _chunks(text)
    kept = [c for c in chunks if not (_is_badge(*_chunk_cell(c)) or _is_setup(*_chunk_cell(c)))]
    first_code = next((i for i, c in enumerate(kept) if _chunk_cell(c)[0] == "code" and _chunk_cell(c)[1]), None)
    if first_code is None:
        raise ValueError("no code cell to set up")
    kept.insert(first_code, f"# %%\n{colab.setup_cell(folder)}\n\n")
    kept.insert(0, f"# %% [markdown]\n# {colab.badge(notebook)}\n\n")
    return head + "".join(kept)


# ---------------------------------------------------------------------------------- notebooks

def _key(cells) -> list[tuple]:
    return [(c.cell_type, c.source, sorted(c.get("metadata", {}).get("tags", []))) for c in cells]


def edit_notebook(stored, old_source: str, new_source: str):
    """`stored` (the .ipynb built from old_source) with the cells of new_source, every old cell keeping
    its outputs; raises ValueError if `stored` is not built from old_source."""
    if _key(stored.cells) != _key(percent_to_notebook(old_source).cells):
        raise ValueError("the .ipynb is not built from its current source: build it first (tools/nb.py build)")
    want = percent_to_notebook(new_source)
    old = [c for c in stored.cells if not (_is_badge(c.cell_type, c.source) or _is_setup(c.cell_type, c.source))]
    ours = {(c.cell_type, c.source): c for c in stored.cells
            if _is_badge(c.cell_type, c.source) or _is_setup(c.cell_type, c.source)}
    cells = []
    for cell in want.cells:
        if _is_badge(cell.cell_type, cell.source) or _is_setup(cell.cell_type, cell.source):
            # the current cell kept as built (a build records when it ran), else new: no outputs
            cells.append(ours.get((cell.cell_type, cell.source), cell))
        else:
            cells.append(old.pop(0))
    assert not old and _key(cells) == _key(want.cells)
    for cell, built in zip(cells, want.cells):
        cell["id"] = built["id"]  # the ids tools/nb.py gives: cell-000, cell-001, ...
    stored.cells = cells
    return stored


def sources_in(paths: list[str]) -> list[pathlib.Path]:
    found = []
    for p in map(pathlib.Path, paths or FOLDERS):
        p = p if p.is_absolute() else ROOT / p
        if p.is_dir():
            found += sorted((p / "src").glob("*.py"))
        elif p.suffix == ".py" and p.parent.name == "src" and p.parent.parent.name in FOLDERS:
            found.append(p)
        else:
            raise SystemExit(f"{p}: give notebooks/, exercises/ or a source in their src/ folder")
    return found


def apply(src: pathlib.Path, write: bool = True) -> str:
    """Bring one source and its notebook up to date; returns 'updated', 'current' or why not."""
    folder = src.parent.parent.name
    ipynb = src.parent.parent / f"{src.stem}.ipynb"
    old = src.read_text()
    new = edit_source(old, folder, f"{folder}/{ipynb.name}")
    if not ipynb.exists():  # a new notebook: its first build (tools/nb.py build) makes the .ipynb
        if new == old:
            return "current"
        if write:
            src.write_text(new)
        return "updated (the source; build its notebook)" if write else "out of date"
    stored = nbformat.read(ipynb, as_version=4)
    try:
        edited = edit_notebook(nbformat.read(ipynb, as_version=4), old, new)
    except ValueError as err:
        return f"left alone: {err}"
    if new == old and edited == stored:
        return "current"
    if write:
        src.write_text(new)
        nbformat.write(edited, ipynb)
    return "updated" if write else "out of date"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--apply", action="store_true", help="insert or update the link and the set-up cell")
    mode.add_argument("--check", action="store_true", help="exit 1 unless every notebook has the current ones")
    parser.add_argument("paths", nargs="*", help="notebooks/, exercises/ or sources in their src/ (default: both folders)")
    args = parser.parse_args(argv)
    status = 0
    for src in sources_in(args.paths):
        result = apply(src, write=args.apply)
        if result != "current":
            shown = src.relative_to(ROOT) if src.is_relative_to(ROOT) else src
            print(f"{shown}: {result}")
        if result.startswith("left alone") or (args.check and result != "current"):
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
