"""`make release DEST=dir` (tools/release.py): a learner's copy without the instructor's files."""

import os
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import release  # noqa: E402


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    dest = tmp_path_factory.mktemp("release") / "course"
    subprocess.run([sys.executable, str(ROOT / "tools" / "release.py"), str(dest)], check=True, timeout=300)
    return dest


def test_the_copy_holds_the_tracked_files_but_no_solutions_or_hidden_cases(copy):
    files = {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()}
    assert not (copy / "exercises" / "solutions").exists()
    assert not (copy / "exercises" / "hidden").exists()
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    assert any(f.startswith("exercises/solutions/") for f in tracked)  # there was something to leave out
    assert files == {f for f in tracked if not f.startswith(release.INSTRUCTOR_ONLY) and (ROOT / f).is_file()}
    for src in (ROOT / "exercises" / "src").glob("ex*.py"):  # every exercise: notebook, stub, source
        assert (copy / "exercises" / f"{src.stem}.ipynb").exists() and (copy / "exercises" / src.stem / "student.py").exists()


def test_the_copys_notebooks_open_and_its_stubs_fail_with_the_normal_message(copy):
    for path in (copy / "exercises").glob("ex*.ipynb"):
        nbformat.validate(nbformat.read(path, as_version=4))
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_GRADE_WITH", "COURSE_EXERCISES_DIR")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--nbval",
                           "--nbval-sanitize-with", "tools/nbval_sanitize.cfg", "exercises/ex00_all_reduce.ipynb"],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # the message's colours
    assert proc.returncode == 1, out[-3000:]
    assert "NotImplementedError on rank 0 (and 1 other rank): exercise 00" in out, out[-3000:]
    assert "This function in exercises/ex00_all_reduce/student.py is still a stub" in out, out[-3000:]


def test_a_folder_that_is_not_empty_is_refused(tmp_path):
    (tmp_path / "something").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        release.release(tmp_path)
