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
