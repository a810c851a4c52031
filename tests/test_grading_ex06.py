"""Exercise 06's grader (course_lib.grading.ex06_pipeline_schedule): the untouched stubs fail, the
reference solution passes, a student module that reaches for the library's schedules is refused,
and plausible wrong answers fail the property checks (in flight, deadlock, step time, bad caps).
"""

import importlib.util
import pathlib
import re

import pytest

from course_lib import grading
from course_lib.grading import CheckFailed
from course_lib.grading import ex06_pipeline_schedule as ex06
from course_lib.grading.stored import digest
from course_lib.parallel.pp import Action

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module(path):
    spec = importlib.util.spec_from_file_location(f"ex06_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOLUTION = _module(ROOT / "exercises" / "solutions" / "ex06_pipeline_schedule.py")
STUB = _module(ROOT / "exercises" / "ex06_pipeline_schedule" / "student.py")


def _pattern(m, warmups):
    """The 1F1B pattern with the given warm-up per rank (written here, not taken from the solution)."""
    out = []
    for w in warmups:
        acts = [Action("F", j) for j in range(w)]
        for k in range(m - w):
            acts += [Action("F", w + k), Action("B", k)]
        out.append(acts + [Action("B", j) for j in range(m - w, m)])
    return out


def _checked(caps_rule):
    """A capped_1f1b that refuses bad caps like the solution, then builds caps_rule's lists."""
    def capped(p, m, caps):
        SOLUTION.capped_1f1b(p, m, caps)  # raises ValueError on bad caps
        return caps_rule(p, m, caps)
    return capped


def test_the_stubs_fail():
    with pytest.raises(NotImplementedError, match="exercise 06: write one_f_one_b"):
        ex06.check_one_f_one_b(STUB.one_f_one_b)
    with pytest.raises(NotImplementedError, match="exercise 06: write capped_1f1b"):
        ex06.check_capped(STUB.capped_1f1b)


def test_the_solution_passes_the_checks_as_data(capsys):
    ex06.check_one_f_one_b(SOLUTION.one_f_one_b)
    ex06.check_capped(SOLUTION.capped_1f1b)
    out = capsys.readouterr().out
    assert out.count("PASS  ") == 9 and "got" not in out
    for (p, m, caps), best in ex06.STEP_UNDER_CAPS.items():  # the stored digests are the pattern's own times
        sched = ex06.as_schedule(SOLUTION.capped_1f1b(p, m, list(caps)), p, m, "capped")
        assert digest(int(ex06.step_time(sched))) == best, (p, m, caps)


def test_the_solution_trains_like_the_single_process_on_4_ranks(capsys):
    ex06.check_training(SOLUTION.capped_1f1b(4, 8, [2, 3, 1, 2]), 8, "capped, m=8")
    assert capsys.readouterr().out.count("PASS  ") == 6


@pytest.mark.parametrize("source", [
    "from course_lib.parallel.pp import Action, make_schedule\n",
    "from course_lib.parallel.pp.schedules import one_f_one_b\n",
    "from course_lib.parallel import pp\n\ndef f(p, m):\n    return pp.make_schedule('1f1b', p, m).actions\n",
    "from course_lib.parallel.pp.runner import validate_run\n",
    "import importlib\nS = importlib.import_module('course_lib.parallel.pp.schedules')\n",
    "from course_lib.parallel.pp import *\n",
    "from course_lib.parallel.pp import stage_of\n",  # Check 4's V placement
    "from course_lib.parallel.pp.actions import rank_of\n",
])
def test_a_student_module_using_the_library_schedules_is_refused(source, tmp_path, monkeypatch):
    (tmp_path / "ex06_pipeline_schedule").mkdir()
    (tmp_path / "ex06_pipeline_schedule" / "student.py").write_text(source)
    monkeypatch.setattr(grading, "EXERCISES_DIR", tmp_path)
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    with pytest.raises(CheckFailed, match="already holds this exercise's answer"):
        grading.load_student("ex06_pipeline_schedule", refuse=ex06.REFUSE)


def test_the_stub_and_the_solution_are_not_refused():
    for path in (ROOT / "exercises" / "ex06_pipeline_schedule" / "student.py",
                 ROOT / "exercises" / "solutions" / "ex06_pipeline_schedule.py"):
        assert grading.refused_uses(path.read_text(), ex06.REFUSE) == []


def test_gpipe_order_fails_the_in_flight_bound():
    def gpipe(p, m):
        return [[Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)] for _ in range(p)]
    with pytest.raises(CheckFailed, match="more than p - r micro-batches in flight"):
        ex06.check_one_f_one_b(gpipe)


def test_a_longer_warm_up_fails_the_in_flight_bound_and_a_shorter_one_the_step_time():
    with pytest.raises(CheckFailed, match="more than p - r"):
        ex06.check_one_f_one_b(lambda p, m: _pattern(m, [min(p - r, m) for r in range(p)]))
    with pytest.raises(CheckFailed, match=r"steps longer than \(m \+ p - 1\)"):
        ex06.check_one_f_one_b(lambda p, m: _pattern(m, [min(p - r - 2, m) if r < p - 1 else 0 for r in range(p)]))


def test_capped_answers_that_break_a_rule_fail():
    # each rank's own cap, ignoring that a rank cannot hold more than the rank before it: deadlock
    own_cap = _checked(lambda p, m, caps: _pattern(m, [min(caps[r] - 1, p - r - 1, m) for r in range(p)]))
    with pytest.raises(CheckFailed, match="deadlock"):
        ex06.check_capped(own_cap)
    # caps ignored: plain 1F1B holds more than the cap
    with pytest.raises(CheckFailed, match="more micro-batches in flight than their cap"):
        ex06.check_capped(_checked(lambda p, m, caps: _pattern(m, [min(p - r - 1, m) for r in range(p)])))
    # within the caps but warming up beyond 1F1B's need (the last rank delays its backwards): too slow
    greedy = _checked(lambda p, m, caps: _pattern(m, [min(min(caps[:r + 1]) - 1, m) for r in range(p)]))
    with pytest.raises(CheckFailed, match="not the 1F1B pattern's best under the same caps"):
        ex06.check_capped(greedy)
    # no warm-up at all (never more than one in flight): valid, within every cap, far too slow
    with pytest.raises(CheckFailed, match="not the 1F1B pattern's best under the same caps"):
        ex06.check_capped(_checked(lambda p, m, caps: _pattern(m, [0] * p)))
    # bad caps accepted
    with pytest.raises(CheckFailed, match=r"must raise ValueError: an entry below 1"):
        ex06.check_capped(lambda p, m, caps: _pattern(m, [0] * p))


def test_lists_of_the_wrong_shape_get_a_clear_message():
    with pytest.raises(CheckFailed, match=r"must return a list of 2 lists \(one per rank\)"):
        ex06.as_schedule([[Action("F", 0)]], 2, 1, "one_f_one_b")
    with pytest.raises(CheckFailed, match="rank 1's entry must be a list of Action"):
        ex06.as_schedule([[Action("F", 0)], ["F0"]], 2, 1, "one_f_one_b")


def test_no_notebook_prints_or_imports_the_answer():
    exercise = (ROOT / "exercises" / "src" / "ex06_pipeline_schedule.py").read_text()
    lesson = (ROOT / "notebooks" / "src" / "06_pipeline_parallel.py").read_text()
    assert "make_schedule" not in exercise and "pp.schedules" not in exercise
    # notebook 06 draws 1F1B and ZB-H1 (whose F/B order is 1F1B's) but prints neither's lists
    assert not re.search(r"make_schedule\(\"(1f1b|zero_bubble)\"[^)]*\)\.(table|actions)", lesson)
    assert "capped" not in lesson
    assert lesson.index("course_lib/parallel/pp") > lesson.index("## References")


def test_snake_placement_stub_fails_and_solution_passes(capsys):
    with pytest.raises(NotImplementedError, match="exercise 06: write snake_placement"):
        ex06.check_snake_placement(STUB.snake_placement)
    ex06.check_snake_placement(SOLUTION.snake_placement)
    assert capsys.readouterr().out.count("PASS  ") == 1


def test_the_checker_holds_no_placement_and_no_step_time():
    source = (ROOT / "course_lib" / "grading" / "ex06_pipeline_schedule.py").read_text()
    assert "p - 1 - i" not in source and "2 * p - 1 - r" not in source
    assert ": 69.0" not in source and ": 96.0" not in source  # the step times under caps are digests


# Plausible mistakes, each made in the reference solution's source: old fragment -> new fragment,
# the check that must reject it and a phrase of its message (the learner's terms).
SOLUTION_SOURCE = (ROOT / "exercises" / "solutions" / "ex06_pipeline_schedule.py").read_text()
WRONG = {
    # GPipe's order: every forward first, then every backward
    "all forwards first": ("return _pattern(m, [min(p - r - 1, m) for r in range(p)])",
                           "return _pattern(m, [m] * p)", "one_f_one_b", "more than p - r micro-batches in flight"),
    # one warm-up forward too many on every rank
    "warm-up one too long": ("return _pattern(m, [min(p - r - 1, m) for r in range(p)])",
                             "return _pattern(m, [min(p - r, m) for r in range(p)])", "one_f_one_b",
                             "more than p - r micro-batches in flight"),
    # no warm-up at all: one in flight, valid, a long step
    "no warm-up": ("return _pattern(m, [min(p - r - 1, m) for r in range(p)])", "return _pattern(m, [0] * p)",
                   "one_f_one_b", r"steps longer than \(m \+ p - 1\)"),
    # each rank's own cap, forgetting that rank r+1 cannot hold more than rank r: deadlock
    "own cap only": ("limit = min(limit, caps[r])", "limit = min(m, caps[r])", "capped", "deadlock"),
    # the caps ignored: plain 1F1B
    "caps ignored": ("warmups.append(min(limit - 1, p - r - 1, m))", "warmups.append(min(p - r - 1, m))", "capped",
                     "more micro-batches in flight than their cap"),
    # the cap as the warm-up (one forward more in flight than the cap)
    "cap as warm-up": ("warmups.append(min(limit - 1, p - r - 1, m))", "warmups.append(min(limit, p - r - 1, m))",
                       "capped", "more micro-batches in flight than their cap"),
    # a cap of 0 (or a float) accepted
    "bad caps accepted": ("c < 1:", "c < 0:", "capped", "must raise ValueError: an entry below 1"),
    # Megatron's interleaving: every pass goes down the ranks, the turn jumps from rank p-1 to 0
    "every pass downward": ("placement[i if k % 2 == 0 else p - 1 - i].append(k * p + i)",
                            "placement[i].append(k * p + i)", "snake", "jumps from rank"),
    # each rank's v stages consecutive: no interleaving, the passes stay on one rank
    "stages in blocks": ("placement[i if k % 2 == 0 else p - 1 - i].append(k * p + i)",
                         "placement[(k * p + i) // v].append(k * p + i)", "snake",
                         "must go through every rank once"),
    # the V, whatever v is
    "always two chunks": ("for k in range(v):", "for k in range(2):", "snake", "must be on exactly one rank"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails_with_its_message(name, tmp_path):
    old, new, check, match = WRONG[name]
    assert old in SOLUTION_SOURCE  # the mutant really changes the solution
    path = tmp_path / "wrong" / "ex06_pipeline_schedule.py"
    path.parent.mkdir()
    path.write_text(SOLUTION_SOURCE.replace(old, new))
    wrong = _module(path)
    run = {"one_f_one_b": lambda: ex06.check_one_f_one_b(wrong.one_f_one_b),
           "capped": lambda: ex06.check_capped(wrong.capped_1f1b),
           "snake": lambda: ex06.check_snake_placement(wrong.snake_placement)}[check]
    with pytest.raises(CheckFailed, match=match):
        run()
