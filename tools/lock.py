"""Write constraints.txt: the exact versions the suite last passed with, for every supported Python.

`make lab`, `make test` and `environment.yml` install through `-c constraints.txt`, so a learner
who clones the course next year gets the versions it was tested with, not whatever was released
since (a new cloudpickle once turned a green suite red without a change here). `make test-latest`
runs the suite against the newest releases instead; when it is green, take its versions:

    make test-latest                  # the newest releases, in .venv-latest
    python tools/lock.py              # re-resolve for every Python found, write constraints.txt

How: the interpreter running this script (the one the suite ran on) and each other Python found
(3.10 to 3.13: the pyenv versions, or python3.X on PATH) resolves pyproject.toml's dependencies, its `dev`, `browser` and `site` extras and torch's own
dependencies with `pip install --dry-run --report` (nothing is installed); the other Pythons
keep the tested versions wherever those install there. Versions every
interpreter agrees on are written plainly; the others get a `python_version` marker per Python.
torch itself is pinned to the Makefile's TORCH_VERSION (the build is chosen by tools/install_torch.py;
the CUDA build's own wheels are pinned in constraints-cuda.txt by tools/lock_cuda.py).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# torch's run-time dependencies (a CPU build's; CUDA builds add nvidia-* wheels, left free).
TORCH_DEPS = ("filelock", "fsspec", "jinja2", "networkx", "sympy", "typing-extensions", "setuptools")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [r for r in project["dependencies"] if normalise(re.split(r"[<>=!~ ;\[]", r)[0]) != "torch"]
    for extra in ("dev", "browser", "site"):
        reqs += project["optional-dependencies"][extra]
    return reqs + list(TORCH_DEPS)


def torch_pin() -> str:
    line = re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    return f"torch=={line.group(1)}"


def find_interpreters() -> dict[str, str]:
    found = {}
    for version in PYTHONS:
        candidates = [shutil.which(f"python{version}")]
        candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
        for exe in candidates:
            if exe and subprocess.run([exe, "-m", "pip", "--version"], capture_output=True).returncode == 0:
                found[version] = exe
                break
    return found


def resolve(exe: str, reqs: list[str], prefer: dict[str, str] | None = None) -> dict[str, dict]:
    """{normalised name: (version, requires_python)} that `exe`'s pip would install for `reqs`
    into an empty place; with `prefer` ({name: version}) as constraints, or None if they conflict."""
    with tempfile.TemporaryDirectory() as tmp:
        req_file, report, cons = (pathlib.Path(tmp, n) for n in ("req.txt", "report.json", "c.txt"))
        req_file.write_text("\n".join(reqs) + "\n")
        cons.write_text("".join(f"{n}=={v}\n" for n, v in (prefer or {}).items()))
        done = subprocess.run([exe, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--dry-run",
                               "--ignore-installed", "--report", str(report), "-r", str(req_file), "-c", str(cons)],
                              stderr=subprocess.DEVNULL)
        if done.returncode != 0:
            if prefer:
                return None
            raise RuntimeError(f"{exe} could not resolve {reqs}")
        items = json.loads(report.read_text())["install"]
    return {normalise(i["metadata"]["name"]): (i["metadata"]["version"], i["metadata"].get("requires_python") or "")
            for i in items}


def tested_versions_for(version: str, tested: dict[str, tuple]) -> dict[str, str]:
    """The tested interpreter's pins whose own Requires-Python admits `version`."""
    from packaging.specifiers import SpecifierSet

    return {n: v for n, (v, requires) in tested.items() if version in SpecifierSet(requires)}


def _marker(these: list[str], pythons: list[str]) -> str:
    """The python_version marker that selects `these` among the locked `pythons` (sorted)."""
    start, end = pythons.index(these[0]), pythons.index(these[-1])
    if pythons[start:end + 1] == these:  # a contiguous run of versions
        if end == len(pythons) - 1:
            return f'python_version >= "{these[0]}"'
        if start == 0:
            return f'python_version <= "{these[-1]}"'
    return " or ".join(f'python_version == "{py}"' for py in these)


def render(per_python: dict[str, dict[str, str]]) -> str:
    pythons = sorted(per_python, key=lambda v: tuple(map(int, v.split("."))))
    names = sorted({n for pins in per_python.values() for n in pins} - {"torch"})
    lines = [
        "# The versions the suite last passed with (make test, make test-portability, make test-browser).",
        "# Written by tools/lock.py; used by the Makefile (pip -c) and environment.yml. Do not edit by hand.",
        f"# Resolved for Python {', '.join(pythons)} on {datetime.date.today().isoformat()}.",
        torch_pin(),
    ]
    for name in names:
        versions = {py: per_python[py].get(name) for py in pythons}
        if len(set(versions.values())) == 1:
            lines.append(f"{name}=={versions[pythons[0]]}")
            continue
        for version in sorted({v for v in versions.values() if v is not None}):
            lines.append(f"{name}=={version}; {_marker([py for py in pythons if versions[py] == version], pythons)}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "constraints.txt"))
    args = parser.parse_args(argv)
    interpreters = find_interpreters()
    if not interpreters:
        print(f"no Python {'/'.join(PYTHONS)} with pip found", file=sys.stderr)
        return 1
    reqs = requirements()
    # The interpreter running this script is the one the suite was tested with: the others keep
    # its versions wherever those install there, and take the newest that do elsewhere.
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    tested = resolve(sys.executable, reqs)
    per_python = {here: {n: v for n, (v, _) in tested.items()}}
    for version, exe in interpreters.items():
        if version == here:
            continue
        print(f"resolving for Python {version} ({exe})", file=sys.stderr)
        pins = resolve(exe, reqs, prefer=tested_versions_for(version, tested)) or resolve(exe, reqs)
        per_python[version] = {n: v for n, (v, _) in pins.items()}
    pathlib.Path(args.out).write_text(render(per_python))
    print(f"wrote {args.out} for Python {', '.join(sorted(per_python, key=lambda v: tuple(map(int, v.split('.')))))}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
