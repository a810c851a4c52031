"""Every committed notebook is built from its current source (notebooks/src, exercises/src):
the same cells, the same code, the same tags. A source edited without re-running
`tools/nb.py build` would otherwise test stale code."""

import json
import pathlib
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
