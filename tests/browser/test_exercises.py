"""The exercise notebooks as a learner meets them: running a check on an untouched stub shows
one clear failure message (what is missing and where), not a wall of tracebacks."""

import os
import re

import pytest

import drive
from conftest import REPO

ALL = sorted(p.stem for p in (REPO / "exercises").glob("ex*.ipynb"))
# COURSE_BROWSER_EXERCISES="ex00_all_reduce ...": only these (CI: two, one graded in the kernel and
# one on ranks; every exercise's stubs are checked in its tests/test_grading_exNN.py; see .ci/run)
CHOSEN = os.environ.get("COURSE_BROWSER_EXERCISES", "").split()
assert set(CHOSEN) <= set(ALL), f"COURSE_BROWSER_EXERCISES names no exercise: {sorted(set(CHOSEN) - set(ALL))}"
EXERCISES = CHOSEN or ALL
MAX_LINES = 8


@pytest.mark.parametrize("name", EXERCISES)
def test_a_stub_fails_with_a_clear_message(name, lab, lab_page, artifacts):
    page = lab_page
    drive.open_notebook(page, lab, f"exercises/{name}.ipynb")
    drive.run_all(page, 180)
    errors = drive.error_outputs(page)
    assert errors, "Run All with the stubs raised nothing: the checks cannot fail"
    first = page.locator('.jp-Notebook [data-mime-type="application/vnd.jupyter.stderr"]',
                         has_text=errors[0].splitlines()[0]).first
    first.scroll_into_view_if_needed()
    first.screenshot(path=artifacts / f"{name}_stub_failure.png")
    lines = [l for l in errors[0].splitlines() if l.strip()]
    assert len(errors) == 1, f"{len(errors)} error outputs: Run All should stop at the first failing check"
    assert "Traceback" not in errors[0] and len(lines) <= MAX_LINES, f"a traceback wall:\n{errors[0][:3000]}"
    assert re.match(r"✗ (NotImplementedError|check failed|RankTimeout)", lines[0]), lines[0]
    if "NotImplementedError" in lines[0]:
        assert re.search(rf"exercises/{name}/student\.py, line \d+, in \w+", errors[0]), errors[0]
    assert not page.console_errors, "browser console errors:\n" + "\n".join(page.console_errors)
