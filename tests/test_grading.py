"""The grading mechanism: every exercise notebook fails with the learner's untouched stubs.

(`make test` runs the same notebooks with COURSE_GRADE_WITH=solutions and requires them to
pass: together the two prove the checks separate right from wrong code.)
"""

import os
import pathlib
import subprocess
import sys

import pytest

from course_lib import grading

from _student import load_as_student

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXERCISES = sorted(p.stem for p in (ROOT / "exercises").glob("ex*.ipynb"))


def test_there_are_exercises():
    assert "ex00_all_reduce" in EXERCISES


@pytest.mark.parametrize("exercise", EXERCISES)
def test_exercise_is_complete(exercise):
    stub = ROOT / "exercises" / exercise / "student.py"
    solution = ROOT / "exercises" / "solutions" / f"{exercise}.py"
    assert stub.exists() and solution.exists()
    assert "NotImplementedError" in stub.read_text()
    assert "NotImplementedError" not in solution.read_text()
    assert (ROOT / "exercises" / "src" / f"{exercise}.py").exists()


@pytest.mark.parametrize("exercise", EXERCISES)
@pytest.mark.skipif(os.environ.get("COURSE_STUBS_IN_BROWSER") == "1",
                    reason="CI runs the exercises' stubs in JupyterLab (tests/browser/test_exercises.py) and "
                           "each checker against its stub (tests/test_grading_exNN.py)")
def test_exercise_notebook_fails_with_the_stubs(exercise):
    env = {k: v for k, v in os.environ.items() if k != grading.GRADE_WITH_ENV}
    # -x: stop at the first failing cell, as Run All does for a learner (the cells after it would
    # only fail again on the same stubs)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--nbval",
         "--nbval-sanitize-with", "tools/nbval_sanitize.cfg", f"exercises/{exercise}.ipynb"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "NotImplementedError" in proc.stdout, proc.stdout[-3000:]


def test_load_student_switches_to_the_solutions(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    assert grading.load_student("ex00_all_reduce").__file__.endswith("ex00_all_reduce/student.py")
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    assert grading.load_student("ex00_all_reduce").__file__.endswith("solutions/ex00_all_reduce.py")
    with pytest.raises(FileNotFoundError, match="no module for exercise 'ex99'"):
        grading.load_student("ex99")


def test_checks_pass_and_fail(capsys, monkeypatch):
    monkeypatch.setitem(grading._GRADED, "path", None)  # no student loaded: no line naming one
    grading.check_close("close", [1.0, 2.0], [1.0, 2.0 + 1e-9], rtol=1e-8, atol=0)
    grading.check_equal("equal", (1, "a"), (1, "a"))
    assert capsys.readouterr().out == "PASS  close\nPASS  equal\n"
    with pytest.raises(grading.CheckFailed, match="largest difference") as far:
        grading.check_close("far", [1.0], [1.25], rtol=1e-2, atol=0)
    assert "1.25" not in str(far.value)  # the expected value (the answer) is never printed
    with pytest.raises(grading.CheckFailed, match="got shape"):
        grading.check_close("shape", [1.0, 2.0], [1.0], rtol=0, atol=0)
    with pytest.raises(TypeError):  # no default tolerance: every check states its own
        grading.check_close("no tolerance", [1.0], [1.0])
    with pytest.raises(grading.CheckFailed, match="expected: 2"):
        grading.check_equal("neq", 1, 2)


REFUSE = ("course_lib.estimate.planner", "course_lib.estimate.plan", "course_lib.parallel.topology.groups")


@pytest.mark.parametrize("source, line, name", [
    ("from course_lib.estimate import plan\n", 1, "course_lib.estimate.plan"),
    ("import course_lib.estimate.planner as p\n", 1, "course_lib.estimate.planner"),
    ("x = 1\nfrom course_lib.estimate.planner import plan as search\n", 2, "course_lib.estimate.planner.plan"),
    ("import course_lib\n\ndef f():\n    return course_lib.estimate.plan(1)\n", 4, "course_lib.estimate.plan"),
    ("from course_lib import estimate as est\nest.plan(1)\n", 2, "course_lib.estimate.plan"),
    ("from course_lib.parallel import topology\ntopology.groups({})\n", 2, "course_lib.parallel.topology.groups"),
    ("import importlib\nm = importlib.import_module('course_lib.estimate.planner')\n", 2,
     "course_lib.estimate.planner"),
    ("from course_lib.estimate import *\n", 1, "course_lib.estimate.*"),
    ("from course_lib import *\n", 1, "course_lib.*"),
])
def test_a_student_module_reaching_for_the_answer_is_refused(source, line, name):
    assert grading.refused_uses(source, REFUSE)[0] == (line, name)


def test_what_the_exercise_does_not_refuse_is_allowed():
    source = ("import torch\nfrom torch import *\nfrom course_lib.parallel import topology\nfrom course_lib.dims import ParallelDims\n"
              "topology.link_of('dp', {}, 8)\nplan = 3\n")
    assert grading.refused_uses(source, REFUSE) == []
    assert grading.refused_uses("from course_lib.estimate import plan\n", ()) == []


def test_load_student_refuses_before_running_the_module(tmp_path, monkeypatch):
    source = "raise RuntimeError('the module ran')\nfrom course_lib.estimate import plan\n"
    with pytest.raises(grading.CheckFailed, match=r"student.py, line 2 uses course_lib.estimate.plan"):
        load_as_student(tmp_path, monkeypatch, "ex98_refusal", source, refuse=REFUSE)
    with pytest.raises(RuntimeError, match="the module ran"):  # without the refusal it runs
        load_as_student(tmp_path, monkeypatch, "ex98_refusal", source)
