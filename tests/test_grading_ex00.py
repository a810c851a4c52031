"""Exercise 00's checkers (course_lib.grading.ex00_all_reduce): the stub fails, the reference
solution passes, and plausible wrong answers fail, each with a message naming the mistake."""

import pathlib

import pytest

from course_lib import grading
from course_lib.grading import ex00_all_reduce as grade

from _student import assert_rejected, load_as_student, mutated

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = (ROOT / "exercises" / "solutions" / "ex00_all_reduce.py").read_text()
CHECKS = (grade.check_all_reduce_sum, grade.check_rank_ordered_sums, grade.check_global_mean)


def test_the_plain_stub_fails(tmp_path, monkeypatch):
    stub = load_as_student(tmp_path, monkeypatch, "ex00_all_reduce", refuse=grade.REFUSE)
    with pytest.raises(grading.RankError, match="NotImplementedError"):
        grade.check_all_reduce_sum(stub)
    with pytest.raises(NotImplementedError):
        grade.check_rank_ordered_sums(stub)
    with pytest.raises(grading.RankError, match="NotImplementedError"):
        grade.check_global_mean(stub)


def test_the_reference_solution_passes(tmp_path, monkeypatch, capsys):
    solution = load_as_student(tmp_path, monkeypatch, "ex00_all_reduce", SOLUTION, refuse=grade.REFUSE)
    for check in CHECKS:
        check(solution)
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[rank")]
    assert out[0].startswith("grading ") and out[0].endswith("ex00_all_reduce/student.py")
    assert len(out) == 9 and all(line.startswith("PASS  ") for line in out[1:])


def test_the_checker_module_is_refused(tmp_path, monkeypatch):
    source = "from course_lib.grading import ex00_all_reduce as g\n" + SOLUTION
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        load_as_student(tmp_path, monkeypatch, "ex00_all_reduce", source, refuse=grade.REFUSE)


MEAN = '''    t = torch.tensor([sum(values), len(values)], dtype=torch.float64)  # sum and count travel together
    dist.all_reduce(t)
    return (t[0] / t[1]).item()
'''

# Plausible mistakes, each made in the reference solution's source: (replacements, check, message phrase).
WRONG = {
    # the largest, not the sum
    "MAX instead of SUM": ([("op=dist.ReduceOp.SUM", "op=dist.ReduceOp.MAX")], grade.check_all_reduce_sum,
                           "the sum of every rank's value"),
    # the tensor handed back
    "returns a tensor": ([("    return t.item()\n", "    return t\n")], grade.check_all_reduce_sum, "Python float"),
    # only rank 0's answer
    "only rank 0's result": ([("world_size=len(values))", "world_size=len(values))[:1]")],
                             grade.check_rank_ordered_sums, "one result per rank"),
    # each rank's mean, then the mean of those
    "mean of the ranks' means": (
        [(MEAN, "    t = torch.tensor([sum(values) / max(len(values), 1), float(len(values) > 0)], dtype=torch.float64)\n"
                "    dist.all_reduce(t)\n    return (t[0] / t[1]).item()\n")],
        grade.check_global_mean, "mean of the ranks' means"),
    # the world size as the count
    "divided by the world size": (
        [(MEAN, "    t = torch.tensor([sum(values)], dtype=torch.float64)\n    dist.all_reduce(t)\n"
                "    return (t[0] / dist.get_world_size()).item()\n")],
        grade.check_global_mean, "mean of all the ranks' numbers together"),
    # sum and count in two calls
    "two collective calls": (
        [(MEAN, "    s = torch.tensor([sum(values)], dtype=torch.float64)\n    c = torch.tensor([len(values)], dtype=torch.float64)\n"
                "    dist.all_reduce(s)\n    dist.all_reduce(c)\n    return (s / c).item()\n")],
        grade.check_global_mean, "exactly one each"),
    # this rank's own mean
    "local mean": ([(MEAN, "    return sum(values) / max(len(values), 1)\n")], grade.check_global_mean,
                   "mean of all the ranks' numbers together"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails(tmp_path, monkeypatch, capsys, name):
    replacements, check, phrase = WRONG[name]
    assert_rejected(tmp_path, monkeypatch, capsys, "ex00_all_reduce", mutated(SOLUTION, replacements), check, phrase,
                    refuse=grade.REFUSE)
