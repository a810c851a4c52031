"""Exercise 10's checkers (course_lib.grading.ex10_mesh_coordinates): the untouched stubs fail, the
reference solution passes (one launch of 8 ranks builds the real meshes), plausible wrong answers
fail, and a student module that imports the library's mesh bookkeeping is refused."""

import pathlib
import re

import pytest

from course_lib import grading
from course_lib.grading import ex10_mesh_coordinates as grade

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXERCISE = "ex10_mesh_coordinates"
SOLUTION = ROOT / "exercises" / "solutions" / f"{EXERCISE}.py"
CHECKS = (grade.check_coordinates, grade.check_groups, grade.check_links, grade.check_network_bytes)


def load(monkeypatch, tmp_path=None, source=None, solutions=False):
    """The module load_student gives the notebook: the stub, the solution, or `source` as student.py."""
    if source is not None:
        (tmp_path / EXERCISE).mkdir()
        (tmp_path / EXERCISE / "student.py").write_text(source)
        monkeypatch.setattr(grading, "EXERCISES_DIR", tmp_path)
    if solutions:
        monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    else:
        monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    return grading.load_student(EXERCISE, refuse=grade.REFUSE)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_every_check_fails_on_the_stubs(monkeypatch, check):
    stub = load(monkeypatch)
    with pytest.raises(NotImplementedError):  # each check calls a stub before it starts any rank
        check(stub)


def test_the_solution_passes_every_check(monkeypatch, capsys):
    solution = load(monkeypatch, solutions=True)
    for check in CHECKS:
        check(solution)
    out = capsys.readouterr().out.splitlines()
    # the first line names the file graded (the solution stands in the learner's student.py)
    assert out[0] == "grading exercises/ex10_mesh_coordinates/student.py"
    out = out[1:]
    assert out and all(line.startswith("PASS  ") for line in out)
    assert sum("against a real mesh on 8 ranks" in line for line in out) == 2 * len(grade.REAL_CASES)


def wrong(old, new):
    source = SOLUTION.read_text()
    assert old in source
    return source.replace(old, new)


@pytest.mark.parametrize("source, check", [
    # the first dimension of the order varies fastest instead of the last
    (wrong("for dim in reversed(order):", "for dim in order:"), grade.check_coordinates),
    # ignores the order: always make_mesh's numbering
    (wrong("def coordinates(rank: int, sizes: dict, order=DIMS) -> dict:",
           "def coordinates(rank: int, sizes: dict, order=DIMS) -> dict:\n    order = DIMS"), grade.check_coordinates),
    # groups listed in the order they were found, not by smallest rank
    (wrong("out[dim] = sorted(by_key.values())", "out[dim] = list(by_key.values())[::-1]"), grade.check_groups),
    # "fits in a node" by size alone: a tp group of 3 on nodes of 4 can straddle two nodes
    (wrong("inside = all(len({r // gpus_per_node for r in g}) == 1 for g in groups(sizes, order)[dim])",
           "inside = max(len(g) for g in groups(sizes, order)[dim]) <= gpus_per_node"), grade.check_links),
    # counts the traffic of the dimensions that stay inside the node
    (wrong('== "inter")', '!= "none")'), grade.check_network_bytes),
], ids=["order-reversed", "order-ignored", "groups-unsorted", "links-by-size", "bytes-intra-too"])
def test_a_plausible_wrong_answer_fails(monkeypatch, tmp_path, source, check):
    with pytest.raises(grading.CheckFailed):
        check(load(monkeypatch, tmp_path, source))


@pytest.mark.parametrize("line, name", [
    ("from course_lib.parallel.topology import coordinates", "course_lib.parallel.topology.coordinates"),
    ("from course_lib.parallel import topology as t\nx = t.groups", "course_lib.parallel.topology"),
    ("from course_lib.parallel.topology import *", "course_lib.parallel.topology.*"),
    ("import course_lib.parallel.topology", "course_lib.parallel.topology"),
    # re-exports: refused by what they are, named where the answer lives
    ("from course_lib.parallel import mesh_groups", "course_lib.parallel.mesh.mesh_groups"),
    ("from course_lib import mesh_groups", "course_lib.parallel.mesh.mesh_groups"),
    ("from course_lib.parallel.mesh import mesh_groups as g", "course_lib.parallel.mesh.mesh_groups"),
])
def test_importing_the_library_answer_is_refused(monkeypatch, tmp_path, line, name):
    source = f"{line}\n\n" + SOLUTION.read_text()
    with pytest.raises(grading.CheckFailed, match=re.escape(f"student.py, line 1 uses {name}")):
        load(monkeypatch, tmp_path, source)


def test_the_stub_and_the_solution_are_not_refused():
    for path in (ROOT / "exercises" / EXERCISE / "student.py", SOLUTION):
        assert grading.refused_uses(path.read_text(), grade.REFUSE) == []
