"""Write a learner's copy of the course: the repository's tracked files, less what only an
instructor holds (the reference solutions and the hidden grading cases).

    python tools/release.py DEST          (make release DEST=dir)

DEST must not exist or be empty. The copy keeps the exercise notebooks (their stored outputs are
what correct code prints), the stubs and the checks; its learners grade their own student.py.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INSTRUCTOR_ONLY = ("exercises/solutions/", "exercises/hidden/")


def learner_files(root: pathlib.Path = ROOT) -> list[str]:
    """The tracked files of `root` a learner's copy holds (paths relative to root)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    files = [f for f in out.decode().split("\0") if f]
    return [f for f in files if not f.startswith(INSTRUCTOR_ONLY) and (root / f).is_file()]


def release(dest: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Copy the learner's files of `root` into `dest`; returns them."""
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} is not empty: give a new folder")
    files = learner_files(root)
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)
    return files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=pathlib.Path)
    args = parser.parse_args(argv)
    files = release(args.dest)
    print(f"wrote {len(files)} files to {args.dest} (left out: {', '.join(INSTRUCTOR_ONLY)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
