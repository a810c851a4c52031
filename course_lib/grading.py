"""Graded exercises: load the learner's module and check it, printing a stable verdict.

Layout of an exercise `exNN_name`:

    exercises/exNN_name.ipynb             the notebook the learner works in (committed executed
                                          with the reference solution: its stored outputs are
                                          what correct code prints)
    exercises/exNN_name/student.py        the stubs the learner fills in
    exercises/solutions/exNN_name.py      the reference solution, kept apart from the stubs

The notebook calls `load_student("exNN_name")`, which imports the learner's `student.py`, or
the reference solution when COURSE_GRADE_WITH=solutions (how CI proves the graders pass on
correct code). nbval then compares every check cell's output with the stored one: a wrong
answer raises in the cell (or prints something else), and the notebook fails.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import cloudpickle
import torch

EXERCISES_DIR = pathlib.Path(os.environ.get("COURSE_EXERCISES_DIR", pathlib.Path(__file__).resolve().parent.parent / "exercises"))
GRADE_WITH_ENV = "COURSE_GRADE_WITH"


def load_student(exercise: str):
    """Import the module the learner writes for `exercise` (see module docstring)."""
    if os.environ.get(GRADE_WITH_ENV) == "solutions":
        path = EXERCISES_DIR / "solutions" / f"{exercise}.py"
    else:
        path = EXERCISES_DIR / exercise / "student.py"
    if not path.exists():
        raise FileNotFoundError(f"no module for exercise {exercise!r} at {path}")
    spec = importlib.util.spec_from_file_location(f"course_exercise_{exercise}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # re-loading replaces the learner's previous version
    spec.loader.exec_module(module)
    # Ranks cannot import a module loaded from a file path: send its functions by value.
    cloudpickle.register_pickle_by_value(module)
    return module


class CheckFailed(AssertionError):
    """A graded check did not pass."""


def _as_tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def check_close(label: str, got, expected, rtol: float = 1e-5, atol: float = 1e-6):
    """Pass when `got` matches `expected` elementwise (tensors, numbers or nested lists)."""
    g, e = _as_tensor(got), _as_tensor(expected)
    if g.shape != e.shape:
        raise CheckFailed(f"{label}: got shape {tuple(g.shape)}, expected {tuple(e.shape)}")
    if not torch.allclose(g.to(torch.float64), e.to(torch.float64), rtol=rtol, atol=atol):
        worst = (g.to(torch.float64) - e.to(torch.float64)).abs().max().item()
        raise CheckFailed(f"{label}: values differ (largest difference {worst:.3g})\n got:      {got}\n expected: {expected}")
    print(f"PASS  {label}")


def check_equal(label: str, got, expected):
    """Pass when `got == expected` exactly (plain Python values)."""
    if got != expected:
        raise CheckFailed(f"{label}:\n got:      {got!r}\n expected: {expected!r}")
    print(f"PASS  {label}")
