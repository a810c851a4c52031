"""Exercise 07's checkers (course_lib.grading.ex07_expert_dispatch): the stub fails, the reference
solution passes, a student module that reaches the library's expert parallelism is refused, and
plausible wrong answers fail with a message naming the mistake."""

import pathlib

import pytest

from course_lib import grading
from course_lib.grading import ex07_expert_dispatch as checks
from course_lib.runtime.pool import RankError

from _student import load_as_student

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXERCISE = "ex07_expert_dispatch"
SOLUTION = (ROOT / "exercises" / "solutions" / f"{EXERCISE}.py").read_text()
ONE_LAYOUT = [(2, 4, 2, 1.0)]  # the mutants' runs: ep = 2, top-2 with drops


def _load(tmp_path, monkeypatch, source):
    return load_as_student(tmp_path, monkeypatch, EXERCISE, source, refuse=checks.REFUSE)


def test_the_stub_fails(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    stub = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    for check in (checks.check_sort, checks.check_rows_per_rank):
        with pytest.raises(NotImplementedError, match="exercise 07"):
            check(stub)
    for check in (checks.check_layer, checks.check_traffic):  # raised on the ranks
        with pytest.raises(RankError, match="exercise 07: write expert_parallel_moe"):
            check(stub)


def test_the_solution_passes(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    solution = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    for check in (checks.check_sort, checks.check_rows_per_rank, checks.check_layer, checks.check_traffic):
        check(solution)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if not line.startswith("[rank")]
    assert lines[0] == f"grading exercises/{EXERCISE}/student.py"
    assert out.count("PASS  ") == 17 and "FAIL" not in out


@pytest.mark.parametrize("line", [
    "from course_lib.parallel.ep import dispatch",
    "from course_lib.parallel.ep.dispatch import combine, exchange_counts",
    "import course_lib.parallel.ep.dispatch as d",
    "from course_lib.parallel import ep",
    "import importlib\nD = importlib.import_module('course_lib.parallel.ep.dispatch')",
    "from course_lib.grading.ex07_expert_dispatch import shuffled_routing",
])
def test_a_module_reaching_the_librarys_dispatch_is_refused(tmp_path, monkeypatch, line):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        _load(tmp_path, monkeypatch, SOLUTION + "\n" + line + "\n")


def test_the_stub_and_the_solution_are_not_refused():
    assert grading.refused_uses(SOLUTION, checks.REFUSE) == []
    assert grading.refused_uses((ROOT / "exercises" / EXERCISE / "student.py").read_text(), checks.REFUSE) == []


# Plausible mistakes, each made in the reference solution's source: old -> new, check, message phrase.
WRONG = {
    # notebook 07's layout: sorted by expert number, which no longer groups the rows by rank
    "sorted by expert number": ("order = torch.argsort(_slot(expert, n_experts, ep), stable=True)",
                                "order = torch.argsort(expert, stable=True)", "sort",
                                "sorting by expert number does not group them by rank"),
    # rank s's experts taken as consecutive, as in notebook 07
    "consecutive experts per rank": ("return [sum(counts[s::ep]) for s in range(ep)]",
                                     "per = len(counts) // ep\n    return [sum(counts[s * per:(s + 1) * per]) "
                                     "for s in range(ep)]", "rows_per_rank", "not consecutive experts"),
    # the dispatch through torch.distributed's all_to_all_single: no backward, x gets no gradient
    "dispatch drops the gradient": (
        "received = all_to_all_single(rows, recv.sum(1).tolist(), to_rank, group)",
        "received = rows.new_empty(int(recv.sum()), rows.shape[1])\n"
        "    dist.all_to_all_single(received, rows.detach(), recv.sum(1).tolist(), to_rank, group=group)",
        "layer", r"gradients of the tokens x, every rank: .* the outputs are right but this gradient is not: in "
                 r"student.py a path of the backward is cut"),
    # the combine through torch.distributed's all_to_all_single: the experts get no gradient (was an
    # AttributeError on rank 0: 'NoneType' object has no attribute 'clone')
    "combine drops the gradient": (
        "back = all_to_all_single(expert_out, to_rank, recv.sum(1).tolist(), group)",
        "back = expert_out.new_empty(len(rows), expert_out.shape[1])\n"
        "    dist.all_to_all_single(back, expert_out.detach(), to_rank, recv.sum(1).tolist(), group=group)",
        "layer", r"expert \d got no gradient: in student.py, expert_parallel_moe's output carries no gradient"),
    # the gates detached: the router learns nothing
    "gates detached": ("weighted = back * gate[order].to(back.dtype)[:, None]",
                       "weighted = back * gate[order].detach().to(back.dtype)[:, None]", "layer",
                       "the gate must not be detached"),
    # the gates forgotten in the combine
    "gates not applied": ("weighted = back * gate[order].to(back.dtype)[:, None]", "weighted = back", "layer",
                          "no gradient back to the router: the router learns only through the gates"),
    # un-permuted by the assignment's position instead of the sorted order
    "un-permuted without the order": ("index_add(0, token[order], weighted)", "index_add(0, token, weighted)",
                                      "layer", "outputs y, every rank"),
    # the counts all-gathered (every rank's E counts to every rank) instead of exchanged
    "counts all-gathered": (
        "recv = torch.empty_like(send)\n    dist.all_to_all_single(recv, send, group=group)",
        "gathered = [torch.empty_like(send) for _ in range(ep)]\n    dist.all_gather(gathered, send, group=group)\n"
        "    recv = torch.stack([c.view(ep, n_local)[dist.get_rank(group)] for c in gathered])",
        "traffic", r"counts, dispatch, combine \(op, bytes sent, bytes received\)"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails_with_its_message(tmp_path, monkeypatch, name):
    old, new, check, match = WRONG[name]
    assert old in SOLUTION  # the mutant really changes the solution
    student = _load(tmp_path, monkeypatch, SOLUTION.replace(old, new))
    run = {"sort": lambda: checks.check_sort(student),
           "rows_per_rank": lambda: checks.check_rows_per_rank(student),
           "layer": lambda: checks.check_layer(student, ONE_LAYOUT),
           "traffic": lambda: checks.check_traffic(student)}[check]
    with pytest.raises(grading.CheckFailed, match=match):
        run()


def test_the_checker_holds_no_readable_answer():
    source = (ROOT / "course_lib" / "grading" / f"{EXERCISE}.py").read_text()
    assert "counts[s::ep]" not in source and "argsort" not in source
