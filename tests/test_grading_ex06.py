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
    for (p, m, caps), best in ex06.STEP_UNDER_CAPS.items():  # the stored times are the pattern's own
        sched = ex06.as_schedule(SOLUTION.capped_1f1b(p, m, list(caps)), p, m, "capped")
        assert ex06.step_time(sched) == best, (p, m, caps)


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
    with pytest.raises(CheckFailed, match="steps longer than the 1F1B pattern's"):
        ex06.check_capped(greedy)
    # no warm-up at all (never more than one in flight): valid, within every cap, far too slow
    with pytest.raises(CheckFailed, match="steps longer than the 1F1B pattern's"):
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


def test_v_placement_stub_fails_solution_passes_and_wrong_placements_fail(capsys):
    with pytest.raises(NotImplementedError, match="exercise 06: write v_placement"):
        ex06.check_v_placement(STUB.v_placement)
    ex06.check_v_placement(SOLUTION.v_placement)
    assert capsys.readouterr().out.count("PASS  ") == 2
    loop = lambda p: [[r, r + p] for r in range(p)]  # noqa: E731  Megatron's interleaving: the loss on rank p-1
    with pytest.raises(CheckFailed, match="stage 3 on rank 1"):
        ex06.check_v_placement(loop)
    def swapped(p):  # rank 0 holds stages 0 and 2p-1, but ranks 1 and 2 trade their first stages
        v = SOLUTION.v_placement(p)
        if p > 2:
            v[1][0], v[2][0] = v[2][0], v[1][0]
        return v

    with pytest.raises(CheckFailed, match="stage 0 -> 1 jumps from rank 0 to 2"):
        ex06.check_v_placement(swapped)
    with pytest.raises(CheckFailed, match="2 stage numbers"):
        ex06.check_v_placement(lambda p: [[r] for r in range(p)])
