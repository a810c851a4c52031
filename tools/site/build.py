"""Build the course as a static website from the committed notebooks (`make site`).

    python tools/site/build.py                  # -> build/site/index.html
    python tools/site/build.py --out DIR

Nothing is executed: Sphinx with myst-nb renders the stored outputs (conf.py beside this file:
`nb_execution_mode = "off"`). This script lays out a source tree under build/site-src/ first:

* every notebook and its graded exercise as a page, in the map's order (00, ex00, 01, ex01, ...,
  15, ex15, A1), with an index page whose table of contents names them;
* on every page, right under its title, a box saying how to run it (`make lab`, the dev
  container, Colab: the notebook's "Open in Colab" link moves into the box, and its Colab set-up
  cell is left out) and linking the notebook to its exercise and back;
* "notebook 05", "exercise 02" and backticked paths such as `exercises/ex02_....ipynb` in the
  prose become links to those pages (not inside code, math, headings or existing links);
* widgets show their static figure: an output that carries a live widget view next to a static
  form (course_lib.widgets.show_interactive: PNG + caption) keeps only the static form, and a
  widget with no static form (a progress bar, whose text is its first state) is left out. The
  notebooks are built without saved widget state, so no widget JavaScript is loaded either;
* MathJax 3 is copied from the pip package django-static-mathjax (a plain copy of MathJax's
  es5 build; installed by `make site`) into the site, so formulas render offline. Without that
  package the build says so and the pages load MathJax from its CDN (formulas then need the
  network).

The committed notebooks are never changed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import posixpath
import re
import shutil
import subprocess
import sys
import time

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # course_lib from this checkout, installed or not
from course_lib import colab  # noqa: E402  (torch-free)
TITLE = "Distributed Training from First Principles"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MATHJAX_DIR = "mathjax"  # under the site's _static/


def map_order(notebooks_dir: pathlib.Path, exercises_dir: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    """[(kind, path)] in the map's order: each numbered notebook followed by its exercise, then
    the appendices (no exercise). An exercise with no notebook of its number is an error."""
    notebooks = sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb")) + sorted(notebooks_dir.glob("A[0-9]*_*.ipynb"))
    exercises = {p.name[2:4]: p for p in sorted(exercises_dir.glob("ex[0-9][0-9]_*.ipynb"))}
    numbers = {p.name.split("_")[0] for p in notebooks}
    orphans = sorted(set(exercises) - numbers)
    if orphans:
        raise ValueError(f"exercises {orphans} have no notebook of their number")
    order = []
    for nb in notebooks:
        order.append(("notebook", nb))
        number = nb.name.split("_")[0]
        if number in exercises:
            order.append(("exercise", exercises[number]))
    return order


def title_of(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise ValueError("a notebook without a '# ' title")


# ---------------------------------------------------------------------------------------- links

# Spans the link rewriting leaves alone: fenced code, inline code, display and inline math,
# existing links and images, HTML tags.
PROTECTED = re.compile(r"```.*?```|`[^`\n]+`|\$\$.*?\$\$|\$[^$\n]+\$|!?\[[^\]\n]*\]\([^)\n]*\)|<[^>\n]+>", re.S)
MENTION = re.compile(r"\b(notebooks?|[Ee]xercises?)((?:\s+|,\s*|\s+and\s+|\s+or\s+|\s*[–-]\s*)(?:\d\d|A\d)\b)+")
NUMBER = re.compile(r"\b(\d\d|A\d)\b")


class Linker:
    """Rewrites mentions of notebooks and exercises in markdown into relative links."""

    def __init__(self, pages: dict[tuple[str, str], str]):
        self.pages = pages  # {("notebook"|"exercise", "02"): "notebooks/02_collectives.ipynb"}
        self.paths = set(pages.values())

    @staticmethod
    def href(here: str, target: str) -> str:
        """`target` relative to the page `here` (both relative to the site's root)."""
        return posixpath.relpath(target, posixpath.dirname(here) or ".")

    def _mention(self, here: str, match: re.Match) -> str:
        kind = "notebook" if match.group(1).lower().startswith("notebook") else "exercise"
        text = match.group(0)
        word_end = len(match.group(1))

        def number(m):
            target = self.pages.get((kind, m.group(1)))
            return f"[{m.group(1)}]({self.href(here, target)})" if target else m.group(0)

        return text[:word_end] + NUMBER.sub(number, text[word_end:])

    def _code(self, here: str, span: str) -> str:
        inner = span[1:-1]
        return f"[{span}]({self.href(here, inner)})" if inner in self.paths else span

    def rewrite(self, here: str, source: str) -> str:
        text, pieces, last = source, [], 0
        for m in PROTECTED.finditer(text):
            pieces.append(self._plain(here, text[last:m.start()]))
            span = m.group(0)
            pieces.append(self._code(here, span) if span.startswith("`") and not span.startswith("```") else span)
            last = m.end()
        pieces.append(self._plain(here, text[last:]))
        return "".join(pieces)

    def _plain(self, here: str, text: str) -> str:
        lines = text.split("\n")
        # a line that starts a heading stays as it is (the piece may start mid-line: only a
        # piece's first line can be a heading's tail, and that line's start is not in this piece)
        return "\n".join(line if line.lstrip().startswith("#") else MENTION.sub(lambda m: self._mention(here, m), line)
                         for line in lines)


# ------------------------------------------------------------------------------------- the box

def run_box(kind: str, path: str, partner: str | None, partner_title: str | None, here: str, linker: Linker) -> str:
    """The 'how to run it' box (a MyST admonition) for one page."""
    lines = ["```{admonition} Run it yourself", ":class: tip course-run", ""]
    if kind == "notebook":
        lines.append(f"This page is `{path}` with its stored outputs. To run it: `make lab` in a clone of the "
                     "repository (it sets up `.venv` and opens JupyterLab on `notebooks/`), then open "
                     f"`{path}` and run all cells.")
    elif kind == "exercise":
        folder = path[:-len(".ipynb")]
        lines.append(f"This page is `{path}`. To do it: `make lab` in a clone of the repository, write your code in "
                     f"`{folder}/student.py` where it says so, then open `{path}`, restart the kernel and run "
                     "all cells: each check prints PASS or says what differs.")
    else:
        lines.append("To run the notebooks: `make lab` in a clone of the repository (it sets up `.venv` with the "
                     "tested versions and opens JupyterLab on `notebooks/`).")
    lines += [
        "",
        "* Nothing to install: open the repository in GitHub Codespaces or VS Code's Dev Containers "
        "(`.devcontainer/`), which runs `make setup`; then `make lab` in its terminal.",
    ]
    if kind == "index":
        lines.append("* Google Colab: every page links to its notebook in Colab; the notebook's first code cell "
                     "installs the course there (at its pinned revision, beside Colab's own torch).")
    else:
        lines.append(f"* Google Colab: [open `{path}` in Colab]({colab.colab_url(path)}); run its first code cell, "
                     "which installs the course there (at its pinned revision, beside Colab's own torch).")
    if partner:
        label = "Its graded exercise" if kind == "notebook" else "The notebook it practises"
        lines += ["", f"{label}: [{partner_title}]({linker.href(here, partner)})."]
    lines.append("```")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the pages

def static_outputs(cell) -> tuple[int, int]:
    """Keep only the static form of widget outputs; returns (kept as static, dropped)."""
    kept, dropped, outputs = 0, 0, []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if WIDGET_VIEW in data:
            if "text/html" in data or "image/png" in data:
                del data[WIDGET_VIEW]
                kept += 1
            else:
                dropped += 1  # a widget with no static form (a progress bar): its text is its first state
                continue
        outputs.append(out)
    if "outputs" in cell:
        cell.outputs = outputs
    return kept, dropped


def prepare_page(kind: str, src: pathlib.Path, here: str, partner, linker: Linker, out: pathlib.Path) -> dict:
    nb = nbformat.read(src, as_version=4)
    nb.metadata.pop("widgets", None)
    # The Colab link moves into the run box, and the Colab set-up cell (which does nothing
    # elsewhere) is left out: the page shows the lesson.
    nb.cells = [c for c in nb.cells if not (c.cell_type == "markdown" and c.source == colab.badge(here))
                and not (c.cell_type == "code" and colab.is_setup_cell(c.source))]
    widgets = dropped = 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = linker.rewrite(here, cell.source)
        elif cell.cell_type == "code":
            k, d = static_outputs(cell)
            widgets, dropped = widgets + k, dropped + d
    title_cell = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown")
    partner_path, partner_title = partner if partner else (None, None)
    box = nbformat.v4.new_markdown_cell(run_box(kind, here, partner_path, partner_title, here, linker))
    nb.cells.insert(title_cell + 1, box)
    target = out / here
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return {"title": title_of(nb), "widgets": widgets, "dropped": dropped}


def index_page(order, titles: dict[str, str], linker: Linker) -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("\n\n")
    intro = next(p for p in readme if p and not p.startswith("#"))
    parts = [f"# {TITLE}", "", intro, "", run_box("index", "", None, None, "index.md", linker), ""]
    parts.append("Each numbered notebook is followed by its graded exercise; the appendix is optional "
                 "reading. Search (top of every page) covers every page.")
    # One table of contents per row of the map: the notebook, then its exercise.
    groups: list[list[str]] = []
    for kind, here in order:
        if kind == "notebook":
            groups.append([])
        groups[-1].append(here)
    for group in groups:
        caption = titles[group[0]]
        parts += ["", "```{toctree}", f":caption: {caption}", ":maxdepth: 1", ""]
        parts += [f"{titles[h]} <{h[:-len('.ipynb')]}>" for h in group]
        parts.append("```")
    return "\n".join(parts) + "\n"


def find_mathjax() -> pathlib.Path | None:
    """MathJax 3's es5 build shipped by the pip package django-static-mathjax, or None."""
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        return None
    es5 = pathlib.Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax" / "es5"
    return es5 if (es5 / "tex-chtml.js").is_file() else None


def prepare(src_dir: pathlib.Path) -> dict:
    """Lay out the Sphinx source tree; returns what it did (for the summary and the tests)."""
    if src_dir.exists():
        shutil.rmtree(src_dir)
    src_dir.mkdir(parents=True)
    order = [(kind, p.relative_to(ROOT).as_posix()) for kind, p in map_order(ROOT / "notebooks", ROOT / "exercises")]
    pages = {(kind, pathlib.Path(h).name.split("_")[0].removeprefix("ex")): h for kind, h in order}
    linker = Linker(pages)
    titles, widgets, dropped = {}, 0, 0
    for kind, here in order:
        titles[here] = title_of(nbformat.read(ROOT / here, as_version=4))
    for kind, here in order:
        number = pathlib.Path(here).name.split("_")[0].removeprefix("ex")
        other = pages.get(("exercise" if kind == "notebook" else "notebook", number))
        info = prepare_page(kind, ROOT / here, here, (other, titles[other]) if other else None, linker, src_dir)
        widgets, dropped = widgets + info["widgets"], dropped + info["dropped"]
    (src_dir / "index.md").write_text(index_page(order, titles, linker), encoding="utf-8")
    static = src_dir / "_static"
    static.mkdir()
    for f in (HERE / "static").iterdir():
        shutil.copy2(f, static / f.name)
    mathjax = find_mathjax()
    if mathjax:
        shutil.copytree(mathjax, static / MATHJAX_DIR, ignore=shutil.ignore_patterns("*.map", "sre"))
    else:
        print("make site: MathJax is not installed here (the pip package django-static-mathjax, which `make site` "
              "installs); the pages will load MathJax from its CDN, so formulas need the network.", file=sys.stderr)
    return {"pages": len(order) + 1, "order": order, "widgets": widgets, "dropped": dropped,
            "mathjax": mathjax is not None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "site")
    parser.add_argument("--src", type=pathlib.Path, default=ROOT / "build" / "site-src")
    parser.add_argument("-j", default="auto", help="sphinx-build's parallel jobs")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.out.exists() and any(args.out.iterdir()):
        if not (args.out / ".buildinfo").is_file():  # never empty a folder that is not a site
            print(f"make site: {args.out} exists and is not a site built here; choose another --out", file=sys.stderr)
            return 2
        shutil.rmtree(args.out)  # no page left over from a notebook since renamed or removed
    info = prepare(args.src)
    env = {"COURSE_SITE_MATHJAX": "1" if info["mathjax"] else "", "COURSE_SITE_SRC": str(args.src.resolve())}
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", args.j, "-c", str(HERE), "-W", "--keep-going",
           "-d", str(args.src.parent / "site-doctrees"), str(args.src), str(args.out)]
    done = subprocess.run(cmd, env={**os.environ, **env})
    if done.returncode:
        print(f"make site: sphinx-build failed (exit {done.returncode})", file=sys.stderr)
        return done.returncode
    print(f"{info['pages']} pages ({len(info['order'])} notebooks and exercises + index), {info['widgets']} widgets "
          f"as their static figure, {info['dropped']} progress bars left out, MathJax "
          f"{'shipped' if info['mathjax'] else 'from its CDN'} -> {args.out}/index.html "
          f"in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
