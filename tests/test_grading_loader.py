"""The loader grades the student.py beside the notebook that runs the check, says which file it
graded, and refuses a module that reaches the exercise's answer by any route."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from course_lib import grading
from course_lib.grading import refusal

ROOT = pathlib.Path(__file__).resolve().parent.parent
EX = "ex00_all_reduce"
SOLUTION = (ROOT / "exercises" / "solutions" / f"{EX}.py").read_text()

# What a check cell does, run as the notebook's kernel runs it: from the notebook's folder.
CHECK = f"""
from course_lib.grading import check_equal, load_student
student = load_student({EX!r})
print("file", student.__file__)
check_equal("1 rank", student.rank_ordered_sums([7.0]), [7.0])
"""


def _clone(tmp_path, name) -> pathlib.Path:
    dest = tmp_path / name
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(dest)], check=True, timeout=300)
    return dest


def _run_check(exercises: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (grading.GRADE_WITH_ENV, "COURSE_EXERCISES_DIR",
                                                             "JPY_SESSION_NAME")}
    return subprocess.run([sys.executable, "-c", CHECK], cwd=exercises, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def two_clones(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clones")
    solved, stub = _clone(tmp, "solved"), _clone(tmp, "stub")
    (solved / "exercises" / EX / "student.py").write_text(SOLUTION)
    return solved, stub


def test_two_clones_sharing_one_environment_each_grade_their_own_student_py(two_clones):
    solved, stub = two_clones
    # both import the one course_lib installed in this environment, not either clone's
    here = _run_check(solved / "exercises")
    assert here.returncode == 0, here.stderr[-2000:]
    lines = here.stdout.splitlines()
    assert lines[0] == f"file {solved / 'exercises' / EX / 'student.py'}"
    assert lines[1:] == [f"grading exercises/{EX}/student.py", "PASS  1 rank"]
    there = _run_check(stub / "exercises")
    assert there.returncode == 1
    assert f"file {stub / 'exercises' / EX / 'student.py'}" in there.stdout
    assert "NotImplementedError: exercise 00" in there.stderr


def test_the_stub_clones_notebook_fails_naming_its_own_file(two_clones):
    """The exercise notebook itself, in the clone's JupyterLab-like kernel (nbval, lax: outputs
    not compared), graded on that clone's files."""
    solved, stub = two_clones
    env = {k: v for k, v in os.environ.items() if k not in (grading.GRADE_WITH_ENV, "COURSE_EXERCISES_DIR")}
    runs = {}
    for clone in (solved, stub):
        runs[clone] = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--nbval-lax",
             f"exercises/{EX}.ipynb"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert runs[solved].returncode == 0, runs[solved].stdout[-3000:]
    assert runs[stub].returncode == 1, runs[stub].stdout[-3000:]
    out = runs[stub].stdout
    assert re.search(rf"This function in exercises/{EX}/student.py is still a stub", out), out[-3000:]


def test_the_folder_is_the_notebooks_not_the_librarys(tmp_path, monkeypatch):
    monkeypatch.setattr(grading, "EXERCISES_DIR", None)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    (tmp_path / "course" / "exercises" / EX).mkdir(parents=True)
    (tmp_path / "course" / "exercises" / EX / "student.py").write_text(SOLUTION)
    for cwd in (tmp_path / "course" / "exercises", tmp_path / "course"):  # the notebook's folder, the root
        monkeypatch.chdir(cwd)
        assert grading.exercises_dir(EX) == tmp_path / "course" / "exercises"
    notebook = tmp_path / "course" / "exercises" / f"{EX}.ipynb"
    notebook.write_text("{}")
    monkeypatch.chdir(tmp_path)  # the kernel moved away: Jupyter's session name still finds the notebook
    monkeypatch.setenv("JPY_SESSION_NAME", str(notebook))
    assert grading.exercises_dir(EX) == tmp_path / "course" / "exercises"
    monkeypatch.delenv("JPY_SESSION_NAME")
    with pytest.raises(FileNotFoundError, match=f"no module for exercise '{EX}'"):
        grading.exercises_dir(EX)


# --------------------------------------------------------------- refusal by what is reached
# ex06's answer lives in the schedule generators; ex10's in the mesh geometry. Neither list
# names a re-export, the runner, or any helper: those are derived.
from course_lib.grading import ex06_pipeline_schedule as ex06  # noqa: E402
from course_lib.grading import ex10_mesh_coordinates as ex10  # noqa: E402


def _load(tmp_path, monkeypatch, exercise, source, refuse, sibling=None):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    monkeypatch.setattr(grading, "EXERCISES_DIR", tmp_path)
    (tmp_path / exercise).mkdir(exist_ok=True)
    (tmp_path / exercise / "student.py").write_text(source)
    if sibling:  # a module of the learner's own, importable as the notebook's folder is
        name = f"helper_{tmp_path.name[-12:].replace('-', '_')}"
        (tmp_path / f"{name}.py").write_text(sibling)
        monkeypatch.syspath_prepend(str(tmp_path))
        source = source.replace("helper", name)
        (tmp_path / exercise / "student.py").write_text(source)
    return grading.load_student(exercise, refuse=refuse)


STUB6 = "def capped_1f1b(*a, **k):\n    raise NotImplementedError\n"


@pytest.mark.parametrize("source, sibling, reached", [
    # a re-export: course_lib.parallel.pp re-exports make_schedule from schedules
    ("from course_lib.parallel.pp import make_schedule\n", None, "course_lib.parallel.pp.schedules.make_schedule"),
    # an attribute chain inside a function, the import inside the function too
    ("def f():\n    from course_lib.parallel import pp\n    return pp.make_schedule('1f1b', 4, 8)\n", None,
     "course_lib.parallel.pp.schedules.make_schedule"),
    # a sibling module of the learner's that imports the answer
    ("from helper import mine\n", "from course_lib.parallel.pp.schedules import one_f_one_b as mine\n",
     "course_lib.parallel.pp.schedules"),
    # a helper of the learner's that wraps the answer in a function
    ("import helper\ndef capped(*a):\n    return helper.wrap(*a)\n",
     "def wrap(*a):\n    import course_lib.parallel.pp as pp\n    return pp.make_schedule(*a)\n",
     "course_lib.parallel.pp.schedules.make_schedule"),
    # a library helper that wraps it (the runner builds its schedules with make_schedule)
    ("from course_lib.parallel.pp import runner\ndef f(*a):\n    return runner.run_schedule(*a)\n", None,
     "course_lib.parallel.pp"),
    # a name computed at load time
    ("import course_lib.parallel.pp as pp\nf = getattr(pp, 'make_' + 'schedule')\n", None,
     "course_lib.parallel.pp.schedules.make_schedule"),
])
def test_an_indirect_route_to_the_answer_is_refused(tmp_path, monkeypatch, source, sibling, reached):
    with pytest.raises(grading.CheckFailed, match=re.escape(f"uses {reached}")):
        _load(tmp_path, monkeypatch, "ex06_pipeline_schedule", source + STUB6, ex06.REFUSE, sibling)


def test_what_does_not_reach_the_answer_is_allowed(tmp_path, monkeypatch):
    source = ("import torch\nfrom course_lib.parallel.pp import Action\nimport helper\n"
              "def capped_1f1b(p, m, caps):\n    return [Action('F', 0, 0)] + helper.more()\n")
    student = _load(tmp_path, monkeypatch, "ex06_pipeline_schedule", source, ex06.REFUSE,
                    sibling="def more():\n    return []\n")
    assert callable(student.capped_1f1b)


def test_the_refused_names_are_where_the_answers_live():
    """Every exercise's list resolves (a name that moved or was misspelt would refuse nothing),
    and none of them is a re-export of another: the list says where, the walk finds the rest."""
    from course_lib.grading import (ex05_tensor_parallel, ex08_zero2_step, ex09_context_parallel, ex11_step_time,
                                    ex12_reshard, ex13_diloco, ex14_debugging, ex15_capstone)
    lists = [ex05_tensor_parallel.REFUSE, ex06.REFUSE, ex08_zero2_step.REFUSE, ex09_context_parallel.REFUSE,
             ex10.REFUSE, ex11_step_time.REFUSED, ex12_reshard.REFUSE, ex13_diloco.REFUSE, ex14_debugging.REFUSE,
             ex15_capstone.REFUSE]
    for names in lists:
        modules, objects = refusal.resolve(names)
        for name in names:
            if name in modules:
                continue
            parent, _, attr = name.rpartition(".")
            obj = getattr(sys.modules[parent], attr)
            assert getattr(obj, "__module__", parent) == parent, f"{name} is a re-export of {obj.__module__}"
    with pytest.raises(ValueError, match="names no module or object"):
        refusal.resolve(("course_lib.estimate.no_such_planner",))


def test_the_solutions_and_stubs_are_not_refused(monkeypatch):
    from course_lib.grading import ex11_step_time, ex15_capstone
    for exercise, names in (("ex06_pipeline_schedule", ex06.REFUSE), ("ex10_mesh_coordinates", ex10.REFUSE),
                            ("ex11_step_time", ex11_step_time.REFUSED), ("ex15_capstone", ex15_capstone.REFUSE)):
        monkeypatch.setattr(grading, "EXERCISES_DIR", ROOT / "exercises")
        for mode in ("solutions", "student"):
            monkeypatch.setenv(grading.GRADE_WITH_ENV, mode)
            grading.load_student(exercise, refuse=names)
