"""How a failing check looks to a learner: one short message, not a wall of tracebacks."""

import re

import pytest

from course_lib import RankError, grading, run_on_ranks

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _plain(lines):
    return [ANSI.sub("", line) for line in lines]


def _stub():
    raise NotImplementedError("exercise 99: write the thing")


def test_a_check_failure_is_one_message():
    with pytest.raises(grading.CheckFailed) as err:
        grading.check_equal("answer", 1, 2)
    lines = _plain(grading.failure_lines(err.value, err.tb))
    assert lines[0].startswith("✗ check failed: answer:") and "expected: 2" in lines[0]
    assert len(lines) <= 4 and not any("Traceback" in line for line in lines)


def test_a_stub_on_ranks_is_one_message_per_notebook_cell():
    with pytest.raises(RankError) as err:
        run_on_ranks(_stub, world_size=2, timeout_s=60)
    lines = _plain(grading.failure_lines(err.value, err.tb))
    assert lines[0] == "✗ NotImplementedError on rank 0 (and 1 other rank): exercise 99: write the thing"
    assert any("still a stub" in line for line in lines)
    assert len(lines) <= 5 and not any("Traceback" in line for line in lines)


def test_a_stub_in_the_parent_names_its_place_in_student_py(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    student = grading.load_student("ex01_memory_math")
    stubs = [f for f in vars(student).values() if callable(f) and getattr(f, "__module__", None) == student.__name__]
    failures = []
    for stub in stubs:
        try:
            stub(*[1] * stub.__code__.co_argcount)
        except NotImplementedError as e:
            failures.append(e)
        except Exception:
            pass
    assert failures, "the untouched ex01 stubs raise NotImplementedError"
    lines = _plain(grading.failure_lines(failures[0], failures[0].__traceback__))
    assert lines[0].startswith("✗ NotImplementedError: exercise 01")
    assert lines[1].startswith("  raised in exercises/ex01_memory_math/student.py, line ")


def test_outside_ipython_nothing_is_registered():
    assert grading.show_failures_briefly() is False
