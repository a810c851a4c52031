"""The course in Google Colab: where it comes from, the set-up cell every notebook opens with, and
what that cell does once the course is there (torch-free; nothing here runs outside Colab).

REPOSITORY and REVISION are the one place that says which course a Colab notebook installs:
`tools/colab.py --apply` writes them into every notebook's "Open in Colab" link and set-up cell.
REVISION is a tag, so the notebook Colab opens (the link names the tag) and the course its cell
installs are the same commit; the release process creates the tag.

In Colab the set-up cell clones the repository at REVISION into COLAB_HOME, puts it first on
`sys.path` and calls `arrive`, which installs it (editable, no dependencies: Colab's own torch,
numpy, JAX, ... stay), installs any other requirement Colab lacks, moves into the notebook's
folder (notebooks/ or exercises/, where the capstone's configs/ and each exercise's student.py
are found as in a clone) and prints one line saying what differs from the tested set-up.
Outside Colab the cell does nothing and prints nothing.

Colab is recognised by the module its kernel runs on, `google.colab`, being imported: Colab's
environment variables (COLAB_RELEASE_TAG, COLAB_GPU) are also set in Kaggle's notebooks, whose
image is built from Colab's (Kaggle/kagglehub#230 changed its check for that reason).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

from course_lib.platform import usable_cores

REPOSITORY = "https://github.com/OWNER/distributed-training-from-first-principles"
REVISION = "v0.1.0"
COLAB_HOME = "/content/course"  # where the set-up cell clones the course in Colab
# Overrides (a fork, a local copy): the repository to clone and where to clone it.
REPOSITORY_ENV, HOME_ENV = "COURSE_COLAB_REPO", "COURSE_COLAB_HOME"

# The set-up cell's first line, by which tools/colab.py finds the cell again (never change it
# without changing every notebook: `tools/colab.py --apply` does both).
MARKER = "# Google Colab only (elsewhere this cell does nothing):"
# Never installed by the set-up: torch is Colab's own (a CUDA build, matched to its GPUs), and
# Colab is its own notebook front end (JupyterLab would replace Colab's Jupyter server packages).
NOT_INSTALLED = ("torch", "jupyterlab")


def in_colab() -> bool:
    return "google.colab" in sys.modules


def github_path() -> str:
    """'owner/name' of REPOSITORY, a GitHub address."""
    match = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(?:\.git)?/?", REPOSITORY)
    if not match:
        raise ValueError(f"REPOSITORY={REPOSITORY!r} must be https://github.com/OWNER/NAME (Colab opens GitHub files)")
    return match.group(1)


def colab_url(notebook: str) -> str:
    """Colab's address for the committed notebook at `notebook` (relative to the repository root)."""
    return f"https://colab.research.google.com/github/{github_path()}/blob/{REVISION}/{notebook}"


def badge(notebook: str) -> str:
    """The markdown of the link a notebook opens with. A text link, not Colab's badge image: the
    image would be fetched from Google on every opening, which fails offline."""
    return f"[**Open in Colab**]({colab_url(notebook)})"


def setup_cell(folder: str) -> str:
    """The set-up cell of a notebook in `folder` ("notebooks" or "exercises")."""
    return "\n".join([
        f"{MARKER} fetch the course at its pinned revision, set it up",
        "import os, subprocess, sys",
        'if "google.colab" in sys.modules:',
        f'    home = os.environ.get("{HOME_ENV}", "{COLAB_HOME}")',
        "    if not os.path.isdir(home):",
        f'        subprocess.run(["git", "clone", "-q", os.environ.get("{REPOSITORY_ENV}", "{REPOSITORY}"), home], check=True)',
        f'        subprocess.run(["git", "-C", home, "checkout", "-q", "{REVISION}"], check=True)',
        f'    sys.path.insert(0, home); from course_lib.colab import arrive; arrive(home, "{folder}")',
    ])


def is_setup_cell(source: str) -> bool:
    return source.startswith(MARKER)


# ------------------------------------------------------------------------------------ in Colab

def pinned_torch(home: pathlib.Path) -> str | None:
    """The torch version the course pins (constraints.txt's `torch==`), None if not found."""
    constraints = home / "constraints.txt"
    if constraints.is_file():
        for line in constraints.read_text().splitlines():
            if line.startswith("torch=="):
                return line.split("==", 1)[1].strip()
    return None


def missing_requirements(requirements: list[str], installed) -> list[str]:
    """The requirements (PEP 508 strings of course_lib's metadata, extras left out) that `installed(name)`
    (a version string, or None) does not satisfy, except NOT_INSTALLED."""
    from packaging.requirements import Requirement

    missing = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (dev, site, ...) or another Python's requirement
        if req.name in NOT_INSTALLED:
            continue
        version = installed(req.name)
        if version is None or not req.specifier.contains(version, prereleases=True):
            missing.append(text.split(";")[0].strip())
    return missing


def _installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def nvidia_gpus() -> int:
    """The NVIDIA GPUs `nvidia-smi -L` lists (a Colab GPU runtime has it; 0 without it), read
    without importing torch."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def describe(revision: str, commit: str, torch: str | None, pinned: str | None, cores: int, gpus: int,
             installed: list[str]) -> str:
    """The one line the set-up prints: what differs here from the set-up the course was tested on."""
    parts = [f"Colab: the course at {revision} ({commit[:7]})"]
    if torch is None:
        parts.append("torch is missing (the course needs torch >= 2.8: install it, then run this cell again)")
    elif pinned and torch.split("+")[0] != pinned:
        parts.append(f"torch {torch} is Colab's own (the course was tested with {pinned}: "
                     "a low-precision result may print other digits)")
    else:
        parts.append(f"torch {torch}, the version the course was tested with")
    parts.append(f"{cores} CPU core{'s' if cores != 1 else ''} (the course is tuned for 2)")
    if gpus:
        parts.append(f"{gpus} GPU{'s' if gpus != 1 else ''} present: the notebooks' ranks still run on the CPU (gloo)")
    if installed:
        parts.append("installed: " + ", ".join(installed))
    return "; ".join(parts)


def arrive(home, folder: str) -> str:
    """Called by the set-up cell in Colab once the course is cloned at `home`: install it, move into
    `folder`, print (and return) what differs."""
    home = pathlib.Path(home)
    marker = home / ".colab-installed"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-build-isolation", "-e", str(home)], check=True)
        marker.write_text(REVISION + "\n")
    from importlib import metadata

    missing = missing_requirements(metadata.requires("course_lib") or [], _installed)
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *missing], check=True)
    torch = _installed("torch")
    commit = subprocess.run(["git", "-C", str(home), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    os.chdir(home / folder)
    line = describe(REVISION, commit, torch, pinned_torch(home), usable_cores(), nvidia_gpus(), missing)
    if folder == "exercises":  # the notebook Colab opened is GitHub's: the learner's code lives in the clone
        line += f"; write your code in {home / folder}/<exercise>/student.py (Colab's Files panel)"
    print(line, flush=True)
    return line
