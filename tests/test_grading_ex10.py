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
CHECKS = (grade.check_coordinates, grade.check_groups, grade.check_links, grade.check_network_bytes,
          grade.check_best_order)


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


# Plausible wrong answers: name -> (old fragment of the solution, new fragment, check, message phrase)
WRONG = {
    # the first dimension of the order varies fastest instead of the last
    "order reversed": ("for dim in reversed(order):", "for dim in order:", grade.check_coordinates,
                       "LAST dimension of the order varies fastest"),
    # ignores the order: always make_mesh's numbering
    "order ignored": ("def coordinates(rank: int, sizes: dict, order=DIMS) -> dict:",
                      "def coordinates(rank: int, sizes: dict, order=DIMS) -> dict:\n    order = DIMS",
                      grade.check_coordinates, "worked out by hand"),
    # divides before taking the remainder: every index read one dimension too far out
    "divide first": ("        out[dim] = rank % sizes[dim]\n        rank //= sizes[dim]",
                     "        rank //= sizes[dim]\n        out[dim] = rank % sizes[dim]", grade.check_coordinates,
                     "LAST dimension of the order varies fastest"),
    # groups listed in the order they were found, not by smallest rank
    "groups unsorted": ("out[dim] = sorted(by_key.values())", "out[dim] = list(by_key.values())[::-1]",
                        grade.check_groups, "listed by their smallest rank"),
    # "fits in a node" by size alone: a tp group of 3 on nodes of 4 can straddle two nodes
    "links by size": ("inside = all(len({r // gpus_per_node for r in g}) == 1 for g in groups(sizes, order)[dim])",
                      "inside = max(len(g) for g in groups(sizes, order)[dim]) <= gpus_per_node", grade.check_links,
                      "may still straddle two"),
    # a dimension of size 1 called "intra" (its groups are single ranks) instead of "none"
    "size 1 not none": ('    if sizes[dim] == 1:\n        return "none"\n', "", grade.check_links,
                        "links of .* \\(worked out by hand\\)"),
    # counts the traffic of the dimensions that stay inside the node
    "bytes intra too": ('== "inter")', '!= "none")', grade.check_network_bytes,
                        'Only the bytes of dimensions whose link is "inter"'),
    # the design decision skipped: make_mesh's order is always the best
    "always make_mesh's order": ("    return min(itertools.permutations(DIMS), key=", "    return DIMS\n    min(itertools.permutations(DIMS), key=",
                                 grade.check_best_order, "another order sends fewer"),
    # the heaviest traffic put outermost
    "most bytes, not fewest": ("    return min(itertools.permutations(DIMS), key=", "    return max(itertools.permutations(DIMS), key=",
                               grade.check_best_order, "another order sends fewer"),
}


@pytest.mark.parametrize("name", WRONG)
def test_a_plausible_wrong_answer_fails(monkeypatch, tmp_path, name):
    old, new, check, phrase = WRONG[name]
    with pytest.raises(grading.CheckFailed, match=re.compile(phrase, re.DOTALL)):
        check(load(monkeypatch, tmp_path, wrong(old, new)))


def test_no_answer_is_stored_readable():
    source = pathlib.Path(grade.__file__).read_text()
    assert '"intra"}' not in source and "[[0, 2], [1, 3]" not in source and "1049601" not in source


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
