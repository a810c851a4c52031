"""Graded exercises: load the learner's module and check it, printing a stable verdict.

Layout of an exercise `exNN_name`:

    exercises/exNN_name.ipynb             the notebook the learner works in (committed executed
                                          with the reference solution: its stored outputs are
                                          what correct code prints)
    exercises/exNN_name/student.py        the stubs the learner fills in
    exercises/solutions/exNN_name.py      the reference solution, kept apart from the stubs
    course_lib/grading/exNN_name.py       the exercise's checkers, where they need more than
                                          check_equal / check_close (one module per exercise)

The notebook calls `load_student("exNN_name")`, which imports the `student.py` beside the
notebook that runs it (found from the notebook's folder, not from where course_lib is installed:
two clones sharing one environment each grade their own), or the reference solution in its
place when COURSE_GRADE_WITH=solutions (how CI proves the graders pass on correct code). The
first line of every check cell's output names the file graded, relative to the course root
(`grading exercises/ex03_ddp/student.py`). nbval then compares every check cell's output with the stored one: a wrong
answer raises in the cell (or prints something else), and the notebook fails.

An exercise whose answer the library already holds (the planner, the mesh bookkeeping, the
step-time model ...) names where it lives, once, in its checker module, and passes it to
`load_student(..., refuse=...)`: a student module that imports one of them, or reaches one by a
re-export, a sibling module or a helper that wraps it (course_lib/grading/refusal.py derives
those), is refused with `CheckFailed` before any check runs, so a check can only pass on the
learner's own code. A cohort is graded by `python -m course_lib.grading.grade` (grade.py).
(Over 300 lines: the loader, the checks and their display are what every exercise notebook
imports; refusal.py and grade.py hold the rest.)
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import sys

import torch

from course_lib.grading import refusal
from course_lib.runtime.modules import share_with_ranks
from course_lib.runtime.pool import RankError, RankTimeout

# The folder that holds exNN_name/student.py: COURSE_EXERCISES_DIR when set, else found from the
# notebook that runs the check (see exercises_dir). Never the imported course_lib's own location:
# two clones sharing one virtual environment import the same course_lib, and each must grade its
# own student.py.
EXERCISES_DIR = pathlib.Path(os.environ["COURSE_EXERCISES_DIR"]) if os.environ.get("COURSE_EXERCISES_DIR") else None
GRADE_WITH_ENV = "COURSE_GRADE_WITH"
_GRADED = {"path": None, "shown_in": None, "root": None}  # the file the last load_student graded, as printed


def _notebook_dir() -> pathlib.Path:
    """The running notebook's folder: Jupyter's server names the notebook a kernel serves in
    JPY_SESSION_NAME (an absolute path in recent versions); otherwise (nbval, an older server,
    a script) the working directory, which Jupyter and nbval set to the notebook's folder."""
    session = os.environ.get("JPY_SESSION_NAME", "")
    if session.endswith(".ipynb") and os.path.isabs(session) and os.path.exists(session):
        return pathlib.Path(session).resolve().parent
    return pathlib.Path.cwd().resolve()


def exercises_dir(exercise: str) -> pathlib.Path:
    """The folder holding `exercise`/student.py (or solutions/`exercise`.py when grading the
    solutions): EXERCISES_DIR if set, else the notebook's folder, its exercises/ subfolder (a
    script run from the course root), or the nearest folder above with one."""
    if EXERCISES_DIR is not None:
        return pathlib.Path(EXERCISES_DIR)
    start = _notebook_dir()
    for folder in (start, start / "exercises", *(p / "exercises" for p in start.parents)):
        if (folder / exercise / "student.py").exists() or (folder / "solutions" / f"{exercise}.py").exists():
            return folder
    raise FileNotFoundError(f"no module for exercise {exercise!r}: no {exercise}/student.py in {start} "
                            f"or an exercises/ folder above it (open the exercise notebook from the course's "
                            f"exercises/ folder)")


def _shown(path: pathlib.Path, root: pathlib.Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def load_student(exercise: str, refuse: tuple[str, ...] = ()):
    """Import the module the learner writes for `exercise` (see module docstring), found from the
    notebook's own folder (exercises_dir); every check after it first prints
    `grading exercises/exNN_name/student.py` (relative to the course root).

    `refuse`: where this exercise's answer lives, dotted names of library modules and functions
    (`"course_lib.estimate.planner"`, `"course_lib.dims.groups"`). A module that imports one of
    them is refused with `CheckFailed` before it runs (`refused_uses`, naming the line); one that
    reaches one by another route (a re-export, a sibling module, a helper that wraps it) is
    refused after loading, before any check runs (`refusal.reached_answers`).
    """
    folder = exercises_dir(exercise)
    student_path = folder / exercise / "student.py"
    if os.environ.get(GRADE_WITH_ENV) == "solutions":
        # the reference solution graded in student.py's place: the line printed is the learner's
        path = folder / "solutions" / f"{exercise}.py"
    else:
        path = student_path
    if not path.exists():
        raise FileNotFoundError(f"no module for exercise {exercise!r} at {path}")
    _GRADED.update(path=_shown(student_path, folder.parent), shown_in=None, root=folder.parent)
    show_failures_briefly()
    source = path.read_text()
    uses = refused_uses(source, refuse)
    if uses:
        line, name = uses[0]
        raise CheckFailed(_refusal(path, line, name))
    spec = importlib.util.spec_from_file_location(f"course_exercise_{exercise}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # re-loading replaces the learner's previous version
    spec.loader.exec_module(module)
    reached = refusal.reached_answers(module, source, refuse)
    if reached:
        del sys.modules[spec.name]
        raise CheckFailed(_refusal(path, *reached[0]))
    # Ranks cannot import a module loaded from a file path: they get its source and run it under
    # its real file name, so a rank's traceback still names student.py and the line.
    share_with_ranks(module)
    return module


def _refusal(path: pathlib.Path, line: int, name: str) -> str:
    where = f"{path.name}, line {line}" if line else path.name
    return (f"{where} uses {name}, which already holds this exercise's answer: write it yourself, "
            f"then compare with the library's")


_CELLS = [0]  # cells IPython started since load_student registered _new_cell


def _new_cell(*_):
    _CELLS[0] += 1


def _cell() -> object:
    """Which cell is running (counted by IPython's pre_run_cell event: the execution count does
    not move when a front end runs cells without history), or "script" outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return "script"
    return "script" if get_ipython() is None else _CELLS[0]


def announce() -> None:
    """Print `grading <file>` unless this cell (or this script) already printed it: the first line
    of every check says which file it graded."""
    if _GRADED["path"] is None:
        return
    cell = _cell()
    if _GRADED["shown_in"] != cell:
        _GRADED["shown_in"] = cell
        print(f"grading {_GRADED['path']}")


def passed(label: str) -> None:
    """A check passed: `PASS  label`, after the line naming the graded file."""
    announce()
    print(f"PASS  {label}")


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
        path = str(pathlib.Path(path).resolve().relative_to(pathlib.Path(_GRADED["root"]).resolve()))
    except (ValueError, TypeError):
        pass
    return f"{path}, line {line}, in {fn}"


def failure_lines(error: BaseException, tb=None) -> list[str]:
    """The short report of a failed check (see above): a headline and where it happened."""
    if isinstance(error, CheckFailed):
        return [f"{RED}{BOLD}✗ check failed{RESET}{RED}: {error}{RESET}",
                f"Read what the check says about your result, fix {_GRADED['path'] or 'student.py'}, then restart the kernel and run all."]
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
        lines.append(f"This function in {_GRADED['path'] or 'student.py'} is still a stub: write it, then restart "
                     f"the kernel and run all.")
    lines.append("(%tb prints the full traceback)")
    return lines


def _ipython_handler(shell, etype, value, tb, tb_offset=None):
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # for %tb
    announce()  # a cell that failed before any check printed still names the file it graded
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
    if _new_cell not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _new_cell)
    return True


class CheckFailed(AssertionError):
    """A graded check did not pass."""


def _as_tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def check_close(label: str, got, expected, *, rtol: float, atol: float):
    """Pass when |got - expected| <= atol + rtol·|expected| elementwise (tensors, numbers or nested
    lists). No default tolerance: each check states the one its numerics justify, beside it. A
    failure shows the learner's values and the largest difference, never the expected values."""
    announce()
    g, e = _as_tensor(got), _as_tensor(expected)
    if g.shape != e.shape:
        raise CheckFailed(f"{label}: got shape {tuple(g.shape)}, expected {tuple(e.shape)}")
    if not torch.allclose(g.to(torch.float64), e.to(torch.float64), rtol=rtol, atol=atol):
        worst = (g.to(torch.float64) - e.to(torch.float64)).abs().max().item()
        # the expected values are not shown: they would be the answer, printed on a wrong attempt
        raise CheckFailed(f"{label}: values differ (largest difference {worst:.3g}, allowed {atol:.3g} + {rtol:.3g}·|x|)"
                          f"\n got: {got}")
    passed(label)


def check_equal(label: str, got, expected):
    """Pass when `got == expected` exactly (plain Python values)."""
    announce()
    if got != expected:
        raise CheckFailed(f"{label}:\n got:      {got!r}\n expected: {expected!r}")
    passed(label)
