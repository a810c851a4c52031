"""`python -m course_lib.grading.grade SUBMISSIONS --json out.json`: a cohort graded on real ranks,
each learner and exercise in its own process, on right and wrong submissions."""

import json
import pathlib
import subprocess
import sys

import pytest

from course_lib.grading import grade

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "exercises" / "solutions"
HIDDEN = ROOT / "exercises" / "hidden" / "cases.py"
# seven graders' processes, each importing torch and starting ranks: minutes on a busy 2-core machine
pytestmark = pytest.mark.timeout(1200)

# A plausible wrong ring: right sums, but by a collective the exercise forbids (its check on the
# calls used fails, its sums pass).
MUTANT_02 = (SOLUTIONS / "ex02_ring_all_reduce.py").read_text() + '''

def ring_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor
'''


def _write(root: pathlib.Path, learner: str, exercise: str, source: str) -> None:
    (root / learner / exercise).mkdir(parents=True, exist_ok=True)
    (root / learner / exercise / "student.py").write_text(source)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    subs = tmp_path_factory.mktemp("submissions")
    for ex in ("ex00_all_reduce", "ex02_ring_all_reduce"):
        _write(subs, "right", ex, (SOLUTIONS / f"{ex}.py").read_text())
    _write(subs, "stub", "ex00_all_reduce", (ROOT / "exercises" / "ex00_all_reduce" / "student.py").read_text())
    _write(subs, "mutant", "ex02_ring_all_reduce", MUTANT_02)
    _write(subs, "crash", "ex00_all_reduce", "import os\nos._exit(3)\n")
    (subs / "empty" / "ex00_all_reduce").mkdir(parents=True)
    return _grade(subs, "--hidden", str(HIDDEN), "--seed", "3", "--timeout", "300")


@pytest.fixture(scope="module")
def hang_report(tmp_path_factory):
    """A hang costs the whole --timeout, which the right submissions above need long on a busy
    machine: it runs alone with a short one, followed by a learner graded after it."""
    subs = tmp_path_factory.mktemp("hang")
    _write(subs, "hang", "ex00_all_reduce", "import time\ntime.sleep(3600)\n")
    (subs / "later" / "ex00_all_reduce").mkdir(parents=True)  # sorted after "hang": the grader went on
    return _grade(subs, "--timeout", "5")


def _grade(subs: pathlib.Path, *flags: str) -> dict:
    out = subs.parent / f"{subs.name}.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib.grading.grade", str(subs), "--json", str(out), *flags],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_right_submissions_pass_every_check_hidden_ones_included(report):
    right = report["learners"]["right"]
    for ex in ("ex00_all_reduce", "ex02_ring_all_reduce"):
        r = right[ex]
        assert r["status"] == "graded" and r["failed"] == 0 and r["passed"] > 3, r
        assert all(c["result"] == "PASS" and c["message"] == "" for c in r["checks"])
        hidden = [c for c in r["checks"] if c["hidden"]]
        assert len(hidden) == 1 and "seed 3" in hidden[0]["check"], hidden
    assert report["seed"] == 3


def test_the_stub_fails_with_the_message_a_learner_reads(report):
    r = report["learners"]["stub"]["ex00_all_reduce"]
    assert r["status"] == "graded" and r["passed"] == 0 and r["failed"] >= 1
    first = r["checks"][0]
    assert first["check"].startswith("NotImplementedError") and "exercise 00" in first["check"]
    assert "stub" in first["message"] and "\x1b" not in first["message"]


def test_the_mutant_fails_the_checks_it_breaks(report):
    r = report["learners"]["mutant"]["ex02_ring_all_reduce"]
    failed = [c for c in r["checks"] if c["result"] == "FAIL"]
    assert r["passed"] > 0 and failed, r
    assert all("check failed" in c["check"] for c in failed)
    assert all("ring_all_reduce" in c["check"] for c in failed), failed  # ring_reduce_scatter / all_gather pass


def test_a_learner_who_crashes_or_hangs_does_not_stop_the_grader(report, hang_report):
    assert report["learners"]["crash"]["ex00_all_reduce"]["status"] == "crashed"
    assert report["learners"]["empty"]["ex00_all_reduce"]["status"] == "missing"
    hang = hang_report["learners"]["hang"]["ex00_all_reduce"]
    assert hang["status"] == "timeout" and hang["checks"][-1]["result"] == "FAIL"
    assert hang["checks"][-1]["message"] == "still running after 5 s"
    assert hang_report["learners"]["later"]["ex00_all_reduce"]["status"] == "missing"


def test_the_cell_parsers():
    cells = grade.code_cells("# %% [markdown]\n# text\n# %%\n%matplotlib inline\nx = 1\n# %%\n\n# %%\ny = 2\n")
    assert cells == ["x = 1", "y = 2"]
    assert grade.hidden_cells("# a comment\n# %% ex00\na = 1\n# %% ex02\nb = 2\n# %% ex00\nc = 3\n") == {
        "ex00": ["a = 1", "c = 3"], "ex02": ["b = 2"]}
