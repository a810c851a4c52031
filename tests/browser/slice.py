"""A notebook cut down to the code its widgets need (CI's browser lane; `make test-browser` runs all).

Every notebook is executed top to bottom by `make test` (nbval) on the same commit, so CI's
JupyterLab lane need not pay for the whole notebook a second time to check its widgets. This
keeps each widget cell (an output with the widget view MIME type) and, walking backwards, every
earlier code cell that binds a name a kept cell reads (the last binding before the use), and
keeps the first code cell (the notebook's set-up, after the Colab set-up cell if there is one), and turns the other code cells into raw cells: Run All then runs just what the widgets need, and the
reader's view of the stored notebook (markdown, the widgets' static figures) is unchanged.

The analysis is static (Python's `ast`): a name bound by `import`, assignment, `def`, `class`,
`for`, `with ... as` or a walrus counts; a cell that only mutates an object (`x.attr = 1`) does
not bind `x`. A widget whose live state depended on such a mutation would differ from the
registry's in-process copy, and the test would say so.
"""

import ast
import builtins
import json
import pathlib
import shutil

from course_lib.colab import is_setup_cell
from course_lib.widgets import WIDGET_VIEW_MIME

BUILTINS = set(dir(builtins)) | {"display", "get_ipython"}


def _source(cell) -> str:
    text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    # IPython's magics and shell escapes are not Python
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in text.splitlines())


def names(source: str) -> tuple[set[str], set[str]]:
    """(bound, free): names a cell binds at its top level (what a later cell can use), and names it
    reads without binding them anywhere in itself (what it needs from an earlier cell)."""
    bound, anywhere, read = set(), set(), set()
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
              ast.DictComp, ast.GeneratorExp)

    def visit(node, top):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                anywhere.add(node.id)
                if top:
                    bound.add(node.id)
            else:
                read.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                name = (a.asname or a.name).split(".")[0]
                anywhere.add(name)
                if top:
                    bound.add(name)
        elif isinstance(node, ast.arg):
            anywhere.add(node.arg)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            anywhere.add(node.name)
            if top:
                bound.add(node.name)
        for child in ast.iter_child_nodes(node):
            visit(child, top and not isinstance(node, scopes))

    visit(ast.parse(source), True)
    return bound, read - anywhere - BUILTINS


def _is_widget_cell(cell) -> bool:
    return any(WIDGET_VIEW_MIME in o.get("data", {}) for o in cell.get("outputs", []))


def needed_cells(nb: dict) -> list[int]:
    """Indices of the code cells the widget cells need, widget cells included, in order."""
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    # the first code cell sets the notebook up (imports, plotting); a Colab set-up cell before it
    # (course_lib.colab: nothing outside Colab) is kept too, so the notebook's own set-up is
    set_up = 2 if code and is_setup_cell(_source(nb["cells"][code[0]])) else 1
    keep, wanted = set(code[:set_up]), set()
    for i in reversed(code):
        bound, read = names(_source(nb["cells"][i]))
        if _is_widget_cell(nb["cells"][i]) or bound & wanted:
            keep.add(i)
            wanted = (wanted - bound) | read
    return sorted(keep)


def slice_folder(src: pathlib.Path, dst: pathlib.Path, names) -> dict[str, tuple[int, int]]:
    """A copy of the notebook folder src at dst with the notebooks called `names` cut down."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "src"))
    return {name: slice_notebook(src / f"{name}.ipynb", dst / f"{name}.ipynb") for name in names}


def slice_notebook(src: pathlib.Path, dst: pathlib.Path) -> tuple[int, int]:
    """Write src cut down to its widgets' needs at dst; return (code cells kept, code cells)."""
    nb = json.loads(src.read_text())
    keep = set(needed_cells(nb))
    n_code = 0
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            n_code += 1
            if i not in keep:
                raw = {"cell_type": "raw", "metadata": {}, "source": cell["source"]}
                if "id" in cell:  # nbformat 4.5 cells carry one
                    raw["id"] = cell["id"]
                nb["cells"][i] = raw
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(nb, indent=1))
    return len(keep), n_code
