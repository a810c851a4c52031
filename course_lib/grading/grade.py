"""Grade a cohort's submissions: every check of every exercise, on real ranks, into one JSON file.

    python -m course_lib.grading.grade SUBMISSIONS_DIR --json out.json [--hidden FILE] [--seed N]

SUBMISSIONS_DIR holds one folder per learner, and in it one folder per exercise, named as in
exercises/, each holding that learner's student.py (and any module of theirs it imports):

    SUBMISSIONS_DIR/
        alice/
            ex00_all_reduce/student.py
            ex02_ring_all_reduce/student.py
        bob/
            ex00_all_reduce/student.py

Each (learner, exercise) is graded in a fresh Python process that runs the code cells of the
exercise's notebook source (exercises/src/exNN_name.py) in order, from the exercises/ folder,
with that learner's folder in exercises/'s place: the same checks the notebook runs, on the
same real ranks. A cell that fails is recorded and the next cell still runs. A learner's code
cannot stop the grader: a process that crashes or outlives `--timeout` seconds is recorded as
such, with the checks it finished before.

`--hidden FILE` adds an instructor's cases that the learner's copy does not hold (keep the file
outside it, as `make release` leaves exercises/hidden/ out): a Python file in percent format
whose cells are headed `# %% exNN_name`; each runs after that exercise's own cells, in the same
namespace (`student`, the check functions, and `HIDDEN_SEED`, the `--seed` value, for seeded
sizes). The JSON:

    {"seed": 0, "learners": {"alice": {"ex00_all_reduce": {
        "status": "graded" | "timeout" | "crashed" | "missing",
        "checks": [{"cell": 2, "check": "2 ranks: ...", "result": "PASS" | "FAIL",
                    "message": "...", "hidden": false}, ...],
        "passed": 3, "failed": 1}}}}
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile

from course_lib import grading

EXERCISES = pathlib.Path(__file__).resolve().parents[2] / "exercises"  # the instructor's checks
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def code_cells(text: str) -> list[str]:
    """The code cells of a percent-format source, in order (shell and magic lines dropped)."""
    cells, kind, lines = [], None, []
    for line in text.splitlines() + ["# %% [markdown]"]:
        if line.startswith("# %%"):
            if kind == "code" and "\n".join(lines).strip():
                cells.append("\n".join(l for l in lines if not l.lstrip().startswith(("%", "!"))))
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    return cells


def hidden_cells(text: str) -> dict[str, list[str]]:
    """{exercise: [code, ...]} from a hidden-cases file (cells headed `# %% exNN_name`)."""
    out: dict[str, list[str]] = {}
    name, lines = None, []
    for line in text.splitlines() + ["# %% end"]:
        if line.startswith("# %%"):
            if name and "\n".join(lines).strip():
                out.setdefault(name, []).append("\n".join(lines))
            name, lines = line[4:].strip() or None, []
        else:
            lines.append(line)
    return out


def run_one(exercise: str, learner_dir: pathlib.Path, out: pathlib.Path, hidden: list[str], seed: int) -> None:
    """In this process: grade `learner_dir`/`exercise`/student.py, writing the checks to `out`
    after every cell (so that a timeout keeps the checks finished before it)."""
    os.environ.pop(grading.GRADE_WITH_ENV, None)
    grading.EXERCISES_DIR = learner_dir
    os.chdir(EXERCISES)
    namespace = {"__name__": "__main__", "HIDDEN_SEED": seed}
    checks: list[dict] = []
    cells = [(c, False) for c in code_cells((EXERCISES / "src" / f"{exercise}.py").read_text())]
    cells += [(c, True) for c in hidden]
    for i, (code, is_hidden) in enumerate(cells):
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                exec(compile(code, f"<{exercise} cell {i}>", "exec"), namespace)
            error = None
        except BaseException as e:  # noqa: BLE001 - a learner's error is a failed check, never the grader's
            error = e
        for line in buffer.getvalue().splitlines():
            if line.startswith("PASS  "):
                checks.append({"cell": i, "check": line[6:], "result": "PASS", "message": "", "hidden": is_hidden})
        if error is not None:
            lines = [_ANSI.sub("", l) for l in grading.failure_lines(error, error.__traceback__)]
            checks.append({"cell": i, "check": lines[0].lstrip("✗ "), "result": "FAIL",
                           "message": "\n".join(lines[1:]), "hidden": is_hidden})
        out.write_text(json.dumps(checks))


def grade(submissions: pathlib.Path, hidden_file: pathlib.Path | None = None, seed: int = 0,
          timeout_s: float = 600) -> dict:
    """Grade every SUBMISSIONS/<learner>/<exercise>/student.py (see the module docstring)."""
    hidden = hidden_cells(hidden_file.read_text()) if hidden_file else {}
    known = {p.stem for p in (EXERCISES / "src").glob("ex*.py")}
    report: dict = {"seed": seed, "learners": {}}
    for learner in sorted(p for p in submissions.iterdir() if p.is_dir()):
        results = report["learners"].setdefault(learner.name, {})
        for folder in sorted(p for p in learner.iterdir() if p.is_dir() and p.name in known):
            if not (folder / "student.py").exists():
                results[folder.name] = {"status": "missing", "checks": [], "passed": 0, "failed": 0}
                continue
            results[folder.name] = _grade_in_child(folder.name, learner, hidden.get(folder.name, []), seed, timeout_s)
    return report


def _grade_in_child(exercise, learner, hidden, seed, timeout_s) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out, cells = pathlib.Path(tmp) / "checks.json", pathlib.Path(tmp) / "hidden.json"
        cells.write_text(json.dumps(hidden))
        env = {k: v for k, v in os.environ.items() if k not in ("COURSE_GRADE_WITH", "COURSE_EXERCISES_DIR")}
        cmd = [sys.executable, "-m", "course_lib.grading.grade", "--one", exercise, str(learner.resolve()),
               "--out", str(out), "--hidden-cells", str(cells), "--seed", str(seed)]
        # Its own session, output to a file: on a timeout the whole group goes (ranks included), and
        # no rank left holding a pipe can keep the grader waiting.
        with open(pathlib.Path(tmp) / "stderr.txt", "w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
                status = "graded" if proc.returncode == 0 else "crashed"
                err.seek(0)
                tail = err.read()[-2000:]
            except subprocess.TimeoutExpired:
                status, tail = "timeout", f"still running after {timeout_s:g} s"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        checks = json.loads(out.read_text()) if out.exists() else []
    if status != "graded":
        checks.append({"cell": None, "check": status, "result": "FAIL", "message": tail, "hidden": False})
    return {"status": status, "checks": checks, "passed": sum(c["result"] == "PASS" for c in checks),
            "failed": sum(c["result"] == "FAIL" for c in checks)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("submissions", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path, help="where to write the report")
    parser.add_argument("--hidden", type=pathlib.Path, help="the instructor's hidden cases")
    parser.add_argument("--seed", type=int, default=0, help="HIDDEN_SEED for the hidden cases")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per learner and exercise")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one exercise
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--hidden-cells", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        run_one(args.one, args.submissions, args.out, json.loads(args.hidden_cells.read_text()), args.seed)
        return 0
    report = grade(args.submissions, args.hidden, args.seed, args.timeout)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text)
    for learner, exercises in report["learners"].items():
        for exercise, r in exercises.items():
            print(f"{learner:20s} {exercise:28s} {r['status']:8s} {r['passed']:3d} passed {r['failed']:3d} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
