"""Every committed notebook is built from its current source (notebooks/src, exercises/src):
the same cells, the same code, the same tags. A source edited without re-running
`tools/nb.py build` would otherwise test stale code. And no code cell carries prose as
comments (a heading, a folded answer): it would show as code."""

import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from nb import percent_to_notebook  # noqa: E402

SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py")) + sorted((ROOT / "exercises" / "src").glob("*.py"))


def _cells(cells):
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"],
             sorted(c.get("metadata", {}).get("tags", []))) for c in cells]


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_notebook_is_built_from_its_source(src):
    built = src.parent.parent / (src.stem + ".ipynb")
    assert built.exists(), f"{built} is missing: run tools/nb.py build {src.relative_to(ROOT)}"
    want = _cells(percent_to_notebook(src.read_text()).cells)
    have = _cells(json.loads(built.read_text())["cells"])
    assert have == want, f"{built.name} is stale: run tools/nb.py build {src.relative_to(ROOT)}"


# A markdown heading or an answer block written as comments: `# ## 9. At scale`, `# <details>`.
# Inside a code cell they render as code, not as a section or a folded answer.
_PROSE_IN_CODE = re.compile(r"^\s*#\s*(#{1,6}\s+\S|.*</?details)")


def prose_in_code_cells(source: str) -> list[str]:
    """The comment lines of code cells that are markdown headings or <details> blocks."""
    return [line for cell in percent_to_notebook(source).cells if cell.cell_type == "code"
            for line in cell.source.splitlines() if _PROSE_IN_CODE.match(line)]


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_no_code_cell_holds_markdown_as_comments(src):
    found = prose_in_code_cells(src.read_text())
    assert not found, f"{src.name}: markdown inside a code cell, give it a `# %% [markdown]` cell: {found[:3]}"


def test_the_check_catches_a_section_left_in_a_code_cell():
    source = "# %%\nx = 1  # #1 is a number, not a heading\n\n# ## 9. At scale\n#\n# <details><summary>Answer</summary>\n"
    assert prose_in_code_cells(source) == ["# ## 9. At scale", "# <details><summary>Answer</summary>"]
    assert prose_in_code_cells(source.replace("\n\n# ## 9.", "\n\n# %% [markdown]\n# ## 9.")) == []
