"""Graded exercises: load the learner's module and check it, printing a stable verdict.

Layout of an exercise `exNN_name`:

    exercises/exNN_name.ipynb             the notebook the learner works in (committed executed
                                          with the reference solution: its stored outputs are
                                          what correct code prints)
    exercises/exNN_name/student.py        the stubs the learner fills in
    exercises/solutions/exNN_name.py      the reference solution, kept apart from the stubs
    course_lib/grading/exNN_name.py       the exercise's checkers, where they need more than
                                          check_equal / check_close (one module per exercise)

The notebook calls `load_student("exNN_name")`, which imports the learner's `student.py`, or
the reference solution when COURSE_GRADE_WITH=solutions (how CI proves the graders pass on
correct code). nbval then compares every check cell's output with the stored one: a wrong
answer raises in the cell (or prints something else), and the notebook fails.

An exercise whose answer the library already holds (the planner, the mesh bookkeeping, the
step-time model ...) names those modules or functions in `load_student(..., refuse=...)`: a
student module that imports or reaches for one of them is refused with `CheckFailed` before any
check runs, so a check can only pass on the learner's own code.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import sys

import torch

from course_lib.runtime.modules import share_with_ranks
from course_lib.runtime.pool import RankError, RankTimeout

EXERCISES_DIR = pathlib.Path(os.environ.get("COURSE_EXERCISES_DIR", pathlib.Path(__file__).resolve().parents[2] / "exercises"))
GRADE_WITH_ENV = "COURSE_GRADE_WITH"


def load_student(exercise: str, refuse: tuple[str, ...] = ()):
    """Import the module the learner writes for `exercise` (see module docstring).

    `refuse`: dotted names (`"course_lib.estimate.planner"`, `"course_lib.parallel.topology.groups"`)
    that hold this exercise's answer; a module that imports any of them, or anything below one,
    raises `CheckFailed` naming the line (see `refused_uses`).
    """
    if os.environ.get(GRADE_WITH_ENV) == "solutions":
        path = EXERCISES_DIR / "solutions" / f"{exercise}.py"
    else:
        path = EXERCISES_DIR / exercise / "student.py"
    if not path.exists():
        raise FileNotFoundError(f"no module for exercise {exercise!r} at {path}")
    show_failures_briefly()
    uses = refused_uses(path.read_text(), refuse)
    if uses:
        line, name = uses[0]
        raise CheckFailed(f"{path.name}, line {line} uses {name}, which already holds this exercise's "
                          f"answer: write it yourself, then compare with the library's")
    spec = importlib.util.spec_from_file_location(f"course_exercise_{exercise}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # re-loading replaces the learner's previous version
    spec.loader.exec_module(module)
    # Ranks cannot import a module loaded from a file path: they get its source and run it under
    # its real file name, so a rank's traceback still names student.py and the line.
    share_with_ranks(module)
    return module


def _dotted(node) -> str | None:
    """`a.b.c` for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def refused_uses(source: str, refuse: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, dotted name) for every place `source` reaches a name in `refuse`, in line order.

    Read from the syntax tree, not by running the code: `import m`, `from m import f` and
    `from pkg import m` are resolved to full dotted names, and so are attribute chains on an
    imported name (`course_lib.estimate.plan(...)`, `est.plan(...)` after `import ... as est`).
    `importlib.import_module("...")` and `__import__` with a refused literal are caught too.
    A name is refused when it equals an entry of `refuse` or lies below one; `from m import *`
    is refused when m or anything below it is.
    """
    if not refuse:
        return []

    def hit(name: str) -> bool:
        return any(name == r or name.startswith(r + ".") for r in refuse)

    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> dotted name it was imported as
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:  # import a.b as x: x is a.b
                    aliases[a.asname] = a.name
                else:  # import a.b: binds a
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
                if hit(a.name):
                    found.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if a.name == "*":  # brings in whatever the module exports: refused if anything below is
                    if hit(node.module) or any(r.startswith(node.module + ".") for r in refuse):
                        found.append((node.lineno, f"{node.module}.*"))
                    continue
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if hit(node.module) or hit(full):
                    found.append((node.lineno, full))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and _dotted(node.func) in (
                    "importlib.import_module", "import_module", "__import__"):
            if hit(node.args[0].value):
                found.append((node.lineno, node.args[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            if head in aliases:
                full = aliases[head] + ("." + rest if rest else "")
                if hit(full):
                    found.append((node.lineno, full))
    return sorted(set(found))


# ---------------------------------------------------------------- how a failing check looks
# A learner who runs a check on an unfinished stub should read one clear message, not a wall
# of tracebacks (a check that runs on 4 ranks would otherwise print 4 remote tracebacks plus
# the pool's own frames). In IPython, load_student registers a handler for the three ways a
# check fails; the cell still ends in an error (Run All stops there, nbval fails), with a
# short traceback that names the exception, the message and where in student.py it came from.
# `%tb` still prints the full traceback.

RED, BOLD, RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"
_STUDENT_FRAME = re.compile(r'File "([^"]*(?:student\.py|exercises/solutions/[^"]*))", line (\d+), in (\S+)')


def _where(frames: list[tuple[str, int, str]]) -> str | None:
    """'student.py, line 33, in ring_reduce_scatter' for the deepest frame in the learner's file."""
    if not frames:
        return None
    path, line, fn = frames[-1]
    try:
        path = str(pathlib.Path(path).resolve().relative_to(EXERCISES_DIR.resolve().parent))
    except ValueError:
        pass
    return f"{path}, line {line}, in {fn}"


def failure_lines(error: BaseException, tb=None) -> list[str]:
    """The short report of a failed check (see above): a headline and where it happened."""
    if isinstance(error, CheckFailed):
        return [f"{RED}{BOLD}✗ check failed{RESET}{RED}: {error}{RESET}",
                "Compare got with expected, fix student.py, then restart the kernel and run all."]
    if isinstance(error, RankTimeout):
        return [f"{RED}{BOLD}✗ RankTimeout{RESET}{RED}: {error}{RESET}",
                "A rank waited for a message nobody sent (or sent to the wrong peer): check who sends and "
                "who receives at every step."]
    if isinstance(error, RankError):
        rank, text = next(iter(error.failures.items()))
        last = [l for l in text.strip().splitlines() if l.strip()][-1] if text.strip() else "the rank died"
        others = len(error.failures) - 1
        head = f"{RED}{BOLD}✗ {last.split(':')[0]}{RESET}{RED} on rank {rank}"
        head += f" (and {others} other rank{'s' if others > 1 else ''})" if others else ""
        lines = [head + f": {last.partition(':')[2].strip() or last}{RESET}"]
        where = _where([(p, int(n), f) for p, n, f in _STUDENT_FRAME.findall(text)])
    else:
        import traceback

        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(tb)] if tb is not None else []
        lines = [f"{RED}{BOLD}✗ {type(error).__name__}{RESET}{RED}: {error}{RESET}"]
        where = _where([f for f in frames if _STUDENT_FRAME.search(f'File "{f[0]}", line {f[1]}, in {f[2]}')])
    if where:
        lines.append(f"  raised in {where}")
    if "NotImplementedError" in lines[0]:
        lines.append("This function is still a stub: write it, then restart the kernel and run all.")
    lines.append("(%tb prints the full traceback)")
    return lines


def _ipython_handler(shell, etype, value, tb, tb_offset=None):
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # for %tb
    stb = failure_lines(value, tb)
    shell._showtraceback(etype, value, stb)
    return stb


def show_failures_briefly() -> bool:
    """Register the short failure display in the running IPython kernel (False outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    shell = get_ipython()
    if shell is None:
        return False

    shell.set_custom_exc((CheckFailed, NotImplementedError, RankError, RankTimeout), _ipython_handler)
    return True


class CheckFailed(AssertionError):
    """A graded check did not pass."""


def _as_tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def check_close(label: str, got, expected, *, rtol: float, atol: float):
    """Pass when |got - expected| <= atol + rtol·|expected| elementwise (tensors, numbers or nested
    lists). No default tolerance: each check states the one its numerics justify, beside it."""
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
