"""Load a piece of source as the learner's student.py, as an exercise notebook does."""

from course_lib import grading


def load_as_student(tmp_path, monkeypatch, exercise: str, source: str | None = None, refuse=()):
    """`grading.load_student(exercise, refuse)` on `source` written as the learner's student.py
    under `tmp_path` (None: the repository's own stub)."""
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    if source is not None:
        (tmp_path / exercise).mkdir(exist_ok=True)
        (tmp_path / exercise / "student.py").write_text(source)
        monkeypatch.setattr(grading, "EXERCISES_DIR", tmp_path)
    return grading.load_student(exercise, refuse=refuse)


def mutated(solution: str, replacements) -> str:
    """The reference solution with each (old, new) replacement made: one plausible wrong answer.
    Every `old` must occur, so a mutant cannot silently become the solution."""
    source = solution
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


def assert_rejected(tmp_path, monkeypatch, capsys, exercise, source, check, phrase, refuse=()):
    """`check` fails on `source` as the learner's student.py with a CheckFailed matching `phrase`,
    and the learner is told which file it graded (the message or the check's first line)."""
    import pytest

    wrong = load_as_student(tmp_path, monkeypatch, exercise, source, refuse=refuse)
    with pytest.raises(grading.CheckFailed, match=phrase) as failure:
        check(wrong)
    out = capsys.readouterr().out.splitlines()
    assert "student.py" in str(failure.value) or (out and out[0].endswith(f"{exercise}/student.py"))
