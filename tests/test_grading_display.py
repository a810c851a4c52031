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


def _first_stub(student):
    """A stub of the untouched ex00 module that needs no arguments to raise."""
    import inspect

    for f in vars(student).values():
        if inspect.isfunction(f) and f.__module__ == student.__name__:
            return f
    raise AssertionError("ex00's student.py defines no function")


def test_a_stub_on_ranks_names_its_place_in_student_py(monkeypatch):
    # The rank runs student.py from its source under its real path (course_lib.runtime.modules),
    # so the location does not depend on what the pickler does with code objects (cloudpickle
    # 3.1.3 renames every by-value function's file to "<dynamic-code>").
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    student = grading.load_student("ex00_all_reduce")
    stub = _first_stub(student)
    n_args = stub.__code__.co_argcount

    def call_stub():
        import torch

        return stub(*[torch.ones(4)] * n_args)

    with pytest.raises(RankError) as err:
        run_on_ranks(call_stub, world_size=2, timeout_s=60)
    text = err.value.failures[0]
    assert re.search(r'File "[^"]*exercises/ex00_all_reduce/student\.py", line \d+, in ', text), text
    lines = _plain(grading.failure_lines(err.value, err.tb))
    where = [line for line in lines if line.startswith("  raised in ")]
    assert where and where[0].startswith("  raised in exercises/ex00_all_reduce/student.py, line "), lines
    # The line it names is the line that raised in the file on disk.
    line_no = int(re.search(r"line (\d+)", where[0]).group(1))
    source = (grading.exercises_dir("ex00_all_reduce") / "ex00_all_reduce" / "student.py").read_text().splitlines()
    assert "raise" in source[line_no - 1]


def test_a_reloaded_module_reaches_the_ranks_in_its_new_version(tmp_path):
    import importlib.util
    import sys

    from course_lib.runtime.modules import share_with_ranks

    path = tmp_path / "student.py"
    results = []
    for version in (1, 2):
        path.write_text(f"def answer():\n    return {version}\n")
        spec = importlib.util.spec_from_file_location("course_test_shared_module", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        share_with_ranks(module)
        results.append(run_on_ranks(module.answer, world_size=2, timeout_s=60))
    assert results == [[1, 1], [2, 2]]


def test_sharing_a_module_that_is_not_registered_is_refused():
    import types

    from course_lib.runtime.modules import share_with_ranks

    with pytest.raises(ValueError, match="'floating'.*sys.modules"):
        share_with_ranks(types.ModuleType("floating"))
