"""Exercise 15's checkers (course_lib.grading.ex15_capstone), called directly, no ranks: the plain
stub fails, the reference solution passes, a module that uses the planner is refused (by its
syntax tree, and at call time by a route the tree does not show), and plausible wrong answers
fail without the message giving the answer. (The real 8-rank run of check 6 is graded by the
exercise notebook under the solutions.)"""

import importlib.util
import pathlib
from dataclasses import replace

import pytest

from course_lib import grading
from course_lib.dims import ParallelDims as Dims
from course_lib.grading import CheckFailed
from course_lib.grading import ex15_capstone as grade


@pytest.fixture(scope="module")
def problem():
    return grade.stated_problem()


@pytest.fixture(scope="module")
def facts(problem):
    return grade.facts(problem)


def load(monkeypatch, which: str):
    if which == "solution":
        monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    else:
        monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    return grading.load_student("ex15_capstone", refuse=grade.REFUSE)


def test_the_plain_stub_fails(monkeypatch, problem):
    stub = load(monkeypatch, "stub")
    for function in (stub.choose_layout, stub.binding_constraint, stub.rejected_layout):
        with pytest.raises(NotImplementedError):
            grade.ask(function, problem)


def test_the_solution_passes(monkeypatch, capsys, problem):
    solution = load(monkeypatch, "solution")
    layout = grade.ask(solution.choose_layout, problem)
    grade.check_runnable(layout, problem)
    grade.check_fits(layout, problem)
    grade.check_fast(layout, problem)
    grade.check_binding(grade.ask(solution.binding_constraint, problem), problem)
    grade.check_rejected(grade.ask(solution.rejected_layout, problem), layout, problem)
    grade.check_choices(solution.choose_layout, problem)
    grade.check_bindings(solution.binding_constraint, problem)
    grade.check_rejections(solution.rejected_layout, solution.choose_layout, problem)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "grading exercises/ex15_capstone/student.py"  # the file graded, then the checks
    assert len(out) == 1 + 7 + 3 * 6 and all(line.startswith("PASS  ") for line in out[1:])
    assert not any("bytes" in line or "seconds" in line for line in out if "binding" in line)  # no unit, no answer


def test_the_stated_problem_is_bound_by_memory(problem, facts):
    """The exercise's premise: the fastest layout the 3D trainer runs does not fit, and more than
    one layout meets the throughput budget (the capstone stays open)."""
    assert facts["binding"][0] == "memory" and facts["binding"][1] > problem.cluster.memory_bytes
    passing = [lay for lay in grade.runnable_layouts(problem)
               if grade.predicted(problem, lay)[1] <= problem.cluster.memory_bytes
               and facts["best_time"] / grade.predicted(problem, lay)[0] >= problem.fraction]
    assert len(passing) >= 2


def test_the_solution_agrees_when_memory_does_not_bind(monkeypatch, capsys, problem):
    roomy = replace(problem, cluster=replace(problem.cluster, memory_bytes=1 << 30))
    binding = grade.facts(roomy)["binding"]
    assert binding[0] in grade.GROUPS  # a group of step-time terms, not memory
    solution = load(monkeypatch, "solution")
    grade.check_binding(grade.ask(solution.binding_constraint, roomy), roomy)
    with pytest.raises(CheckFailed, match="binding constraint"):
        grade.check_binding(("memory", 1 << 30), roomy)


def test_a_module_that_uses_the_planner_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(grading, "EXERCISES_DIR", tmp_path)
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    (tmp_path / "ex15_capstone").mkdir()
    student = tmp_path / "ex15_capstone" / "student.py"
    for source, name in [
        ("from course_lib.estimate.planner import plan\n", "course_lib.estimate.planner.plan"),
        ("import course_lib.estimate.planner_figures as f\n", "course_lib.estimate.planner_figures"),
        ("import course_lib.estimate.planner\n", "course_lib.estimate.planner"),
        ("from course_lib.grading.ex15_capstone import facts\n", "course_lib.grading.ex15_capstone.facts"),
    ]:
        student.write_text(source + "\ndef choose_layout(*args):\n    return None\n")
        with pytest.raises(CheckFailed, match=f"line 1 uses {name}"):
            grading.load_student("ex15_capstone", refuse=grade.REFUSE)


def test_the_planner_reached_at_call_time_is_refused(problem):
    def sneaky(config, cluster, global_batch, seq, recipe):
        import importlib

        planner = importlib.import_module("course_lib.estimate." + "planner")  # no literal to refuse
        return planner.plan(config, cluster, global_batch, seq, recipe).best.layout

    with pytest.raises(CheckFailed, match="the planner is not available"):
        grade.ask(sneaky, problem)
    from course_lib.estimate import planner
    assert planner.plan.__name__ == "plan"  # restored after the call


def test_a_layout_that_does_not_fit_fails(problem, facts):
    too_big = Dims(dp=8)  # the fastest of all, memory ignored
    grade.check_runnable(too_big, problem)
    with pytest.raises(CheckFailed, match="it fits"):
        grade.check_fits(too_big, problem)


@pytest.mark.parametrize("layout, message", [
    (Dims(dp=2, tp=2, pp=2, microbatches=8), "fitting layout's predicted throughput"),  # fits, slow
])
def test_a_slow_layout_fails(problem, layout, message):
    grade.check_fits(layout, problem)
    with pytest.raises(CheckFailed, match=message):
        grade.check_fast(layout, problem)


@pytest.mark.parametrize("layout, message", [
    (Dims(dp=4, pp=2, microbatches=2, zero=1, reshard_after_forward=False), "reshard_after_forward=False with zero=1"),
    (Dims(dp=4, pp=2, microbatches=2, recompute="selective"), "whole blocks"),
    (Dims(dp=4, tp=2, sequence_parallel=True), "no sequence parallelism"),
    (Dims(dp=2, pp=2, microbatches=2), "all 8 devices"),
    (Dims(dp=4, pp=2, microbatches=8), "per-replica batch"),
    ("dp4 pp2", "not a course_lib.dims.ParallelDims"),
])
def test_a_layout_the_trainer_cannot_run_fails(problem, layout, message):
    with pytest.raises(CheckFailed, match=message):
        grade.check_runnable(layout, problem)


@pytest.mark.parametrize("answer, message", [
    (("communication", 0.02), "is not what stops a faster layout"),  # the biggest term, not the constraint
    (("bubble", 0.0), "is not what stops a faster layout"),
    (("memory", 120 * 1024), "below the estimator's"),  # the device's memory: binds, but not the threshold
    (("memory", "221.8 KiB"), "must be a number"),
    (("latency", 1.0), "must be one of"),
    ("memory", "must return \\(name, number\\)"),
])
def test_a_wrong_binding_constraint_fails(problem, facts, answer, message):
    with pytest.raises(CheckFailed, match=message) as err:
        grade.check_binding(answer, problem)
    assert str(facts["binding"][1]) not in str(err.value)  # the message never gives the answer


def test_a_wrong_rejection_fails(monkeypatch, problem):
    chosen = grade.ask(load(monkeypatch, "solution").choose_layout, problem)
    too_big = Dims(dp=8)
    excess = grade.predicted(problem, too_big)[1] - problem.cluster.memory_bytes
    grade.check_rejected((too_big, "memory", excess), chosen, problem)
    grade.check_rejected((too_big, "memory", excess + grade.BYTES_ATOL), chosen, problem)  # read off fmt_bytes
    slow = Dims(dp=2, tp=2, pp=2, microbatches=8)
    share = grade.facts(problem)["best_time"] / grade.predicted(problem, slow)[0]
    grade.check_rejected((slow, "throughput", round(share, 2)), chosen, problem)  # read off a percentage
    cases = [
        ((too_big, "memory", 2 * excess), "above the estimator's"),
        ((too_big, "throughput", 0.5), "fits but misses"),
        ((slow, "memory", 1000), "exceeds the device's memory"),
        ((slow, "throughput", share + 0.1), "above the estimator's"),
        ((chosen, "memory", 0), "the one you chose"),
        ((Dims(dp=4, pp=2, microbatches=2, zero=1, reshard_after_forward=False), "memory", 0), "3D trainer could run"),
        ((too_big, "too slow", 1.0), "must be one of"),
        ((too_big, "memory"), "must return \\(layout, reason, number\\)"),
    ]
    for answer, message in cases:
        with pytest.raises(CheckFailed, match=message):
            grade.check_rejected(answer, chosen, problem)


SOLUTION = (pathlib.Path(__file__).resolve().parents[1] / "exercises" / "solutions" / "ex15_capstone.py").read_text()
CHOSEN = "    return next(layout for layout, _, memory in rows if memory <= cluster.memory_bytes)"
FASTEST = """    fastest, _, memory = candidates(config, cluster, global_batch, seq, recipe)[0]
    if memory > cluster.memory_bytes:
        return "memory", memory"""
# Plausible wrong answers, each one change to the reference solution's source:
# name -> (old fragment, new fragment, which check, a phrase its message holds)
WRONG = {
    # the stated problem's answer read off facts(problem) or a stored output and typed in
    "binding typed in": (FASTEST, '    return "memory", {threshold}', "bindings",
                         "a global batch of 32 on 160 KiB devices: the number at which it would stop binding"),
    "the device's memory as the threshold": ('return "memory", memory', 'return "memory", cluster.memory_bytes',
                                             "bindings", "the stated problem: the number .* below the estimator's"),
    "memory always binds": ("    if memory > cluster.memory_bytes:\n        return", "    if True:\n        return",
                            "bindings", "devices of 1 GiB: the binding constraint: 'memory' is not what stops"),
    "memory ignored": ("    if memory > cluster.memory_bytes:\n        return", "    if False:\n        return",
                       "bindings", "the stated problem: the binding constraint: 'communication' is not what stops"),
    "layout typed in": (CHOSEN, '    return ParallelDims(dp=4, pp=2, microbatches=2, zero=1, recompute="full")',
                        "choices", "devices of 1 GiB: it reaches at least 75%.*a faster layout fits"),
    "fastest, memory ignored": (CHOSEN, "    return rows[0][0]", "choices", "it fits: .*bytes per rank"),
    "smallest memory": (CHOSEN, "    return min(rows, key=lambda row: row[2])[0]", "choices",
                        "it reaches at least 75%.*a faster layout fits"),
    "memory excess negated": ('return layout, "memory", memory - cluster.memory_bytes',
                              'return layout, "memory", cluster.memory_bytes - memory', "rejections",
                              "the stated problem: by how many bytes per rank it exceeds it: .* below"),
    "throughput share inverted": ('return layout, "throughput", best / seconds',
                                  'return layout, "throughput", seconds / best', "rejections",
                                  "devices of 1 GiB: the share of the best throughput it reaches: .* above"),
    "a slow layout rejected for memory": ('return layout, "throughput", best / seconds', 'return layout, "memory", 0',
                                          "rejections", "devices of 1 GiB: the rejected layout exceeds the device's "
                                                        "memory: by the estimator it fits"),
}


def _module(tmp_path, source, name):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", WRONG)
def test_a_plausible_wrong_answer_fails(tmp_path, problem, facts, name):
    import re

    old, new, check, phrase = WRONG[name]
    assert old in SOLUTION  # the mutant really changes the solution
    wrong = _module(tmp_path, SOLUTION.replace(old, new.format(threshold=facts["binding"][1])), "wrong_ex15")
    run = {"choices": lambda: grade.check_choices(wrong.choose_layout, problem),
           "bindings": lambda: grade.check_bindings(wrong.binding_constraint, problem),
           "rejections": lambda: grade.check_rejections(wrong.rejected_layout, wrong.choose_layout, problem)}[check]
    with pytest.raises(CheckFailed, match=re.compile(phrase, re.DOTALL)):
        run()


def test_the_variants_have_different_answers(problem):
    """Each variant changes what a typed-in answer would get wrong: the threshold, the binding group,
    the layouts within the budget."""
    answers = [grade.facts(q)["binding"] for _, q in grade.variants(problem)]
    assert len({a for a in answers}) == 3 and answers[2][0] in grade.GROUPS
