"""Export the executed notebooks to standalone HTML that reads offline (`make html`).

    python tools/export_html.py                      # notebooks/*.ipynb -> build/html/*.html + index.html
    python tools/export_html.py --out DIR NB.ipynb   # chosen notebooks

Figures are inline PNGs already. A widget cell's output carries the live widget view and a
static fallback (course_lib.widgets.show_interactive); the export drops any saved widget state,
so nbconvert renders the fallback (the static figure, its caption and "Run this cell for the
interactive version.") instead of loading the widget renderer from the network. Only MathJax
comes from the network: offline, formulas show as their TeX source.
"""

from __future__ import annotations

import argparse
import html
import pathlib
import sys

import nbformat
from nbconvert import HTMLExporter

ROOT = pathlib.Path(__file__).resolve().parent.parent


def export(notebook: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
    nb = nbformat.read(notebook, as_version=4)
    nb.metadata.pop("widgets", None)  # no widget state: every widget falls back to its static figure
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    target = out_dir / f"{notebook.stem}.html"
    target.write_text(body, encoding="utf-8")
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "html")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    args.out.mkdir(parents=True, exist_ok=True)
    pages = [export(nb, args.out) for nb in notebooks]
    links = "\n".join(f'<li><a href="{html.escape(p.name)}">{html.escape(p.stem)}</a></li>' for p in pages)
    (args.out / "index.html").write_text(
        f"<!doctype html><meta charset='utf-8'><title>Distributed Training from First Principles</title>"
        f"<h1>Distributed Training from First Principles</h1><ul>\n{links}\n</ul>\n", encoding="utf-8")
    print(f"{len(pages)} notebooks -> {args.out}/index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
