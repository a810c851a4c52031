"""Write constraints-cuda.txt: the exact versions of the wheels torch's CUDA build adds (nvidia-*, cuda-*, triton).

    python tools/lock_cuda.py            # after a change of the Makefile's TORCH_VERSION

constraints.txt pins what every install gets (tools/lock.py, from a CPU build); the CUDA build from
PyPI (Linux, tools/install_torch.py) also pulls about 2 GiB of NVIDIA wheels, some of them by ranges
(`cuda-bindings<14,>=13.0.3`) or through extras (`cuda-toolkit[cublas,...]`), so a fresh clone next
year would get whatever was released since. This resolves them for Linux x86_64 and Python
3.10-3.13 without downloading any large file: PyPI's simple index (JSON) lists the wheels, and
each wheel's METADATA is read out of the zip with HTTP range requests (the central directory at
the end, then that one member), so pip's `--dry-run` (which downloads whole wheels where the index
serves no separate metadata) is not needed. Versions every Python agrees on are written plainly,
the others with a python_version marker. Needs `packaging` (in .venv).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import pathlib
import re
import sys
import urllib.request
import zipfile

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = pathlib.Path(__file__).resolve().parent.parent
INDEX = "https://pypi.org/simple"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
EXTRA_WHEELS = re.compile(r"^(nvidia-|cuda-|triton$)")  # what the CUDA build adds to a CPU build's dependencies


class RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests: zipfile only reads the parts it needs."""

    def __init__(self, url: str):
        self.url, self.pos = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=30) as answer:
            self.size = int(answer.headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buffer):
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            data = answer.read()
        if answer.status != 206 and len(data) != n:
            raise OSError(f"{self.url}: the server ignored the range request")
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def wheels(name: str) -> list[dict]:
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)["files"]


_metadata_cache: dict[str, list[str]] = {}


def requires_dist(url: str) -> list[str]:
    if url not in _metadata_cache:
        archive = zipfile.ZipFile(io.BufferedReader(RangeFile(url), 1 << 18))
        member = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(member).decode().splitlines()
        _metadata_cache[url] = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    return _metadata_cache[url]


def fits(tag, python: str) -> bool:
    cp = "cp" + python.replace(".", "")
    return (tag.interpreter in (cp, "py3") and tag.abi in (cp, "abi3", "none")
            and (tag.platform == "any" or (tag.platform.startswith("manylinux") and tag.platform.endswith("x86_64"))))


def environment(python: str, extra: str) -> dict[str, str]:
    return {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64", "os_name": "posix",
            "python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": extra}


class _Restart(Exception):
    pass


def resolve(top: str, python: str) -> dict[str, tuple[str, int]]:
    """{name: (version, wheel bytes)}: the newest wheels for Linux x86_64 and `python` that satisfy
    every requirement of the closure of `top` (restarting with the tighter range on a conflict)."""
    narrowed: dict[str, SpecifierSet] = {}
    while True:
        try:
            return _resolve_once(top, python, narrowed)
        except _Restart:
            continue


def _resolve_once(top, python, narrowed):
    chosen: dict[str, tuple] = {}  # name -> (version, extras, bytes)
    todo = [(Requirement(top), ("",))]
    while todo:
        req, parent_extras = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker and not any(req.marker.evaluate(environment(python, e)) for e in parent_extras):
            continue
        if name in chosen:
            if not req.specifier.contains(chosen[name][0], prereleases=True):
                narrowed[name] = narrowed.get(name, SpecifierSet()) & req.specifier
                raise _Restart
            if set(req.extras) <= chosen[name][1]:
                continue
        candidates = []
        for f in wheels(name):
            if not f["filename"].endswith(".whl") or f.get("yanked"):
                continue
            _, version, _, tags = parse_wheel_filename(f["filename"])
            if version.is_prerelease or version not in req.specifier or version not in narrowed.get(name, SpecifierSet()):
                continue
            if any(fits(t, python) for t in tags):
                candidates.append((version, f["url"], f["size"]))
        if not candidates:
            raise RuntimeError(f"no wheel of {req} for Linux x86_64, Python {python}")
        version, url, size = max(candidates)
        extras = set(req.extras) | (chosen[name][1] if name in chosen else set())
        chosen[name] = (version, extras, size)
        todo += [(Requirement(r), tuple(extras) or ("",)) for r in requires_dist(url)]
    return {n: (str(v), size) for n, (v, _, size) in chosen.items()}


def render(version: str, per_python: dict[str, dict[str, tuple[str, int]]]) -> str:
    names = sorted({n for pins in per_python.values() for n in pins if EXTRA_WHEELS.match(n)})
    sizes = {py: sum(s for n, (_, s) in pins.items() if EXTRA_WHEELS.match(n) or n == "torch")
             for py, pins in per_python.items()}
    lines = [
        f"# The wheels torch {version}'s CUDA build (PyPI, Linux) adds to a CPU build's dependencies, pinned.",
        "# Written by tools/lock_cuda.py; used by tools/install_torch.py with constraints.txt. Do not edit by hand.",
        f"# Resolved for Linux x86_64, Python {', '.join(per_python)} on {datetime.date.today().isoformat()};",
        f"# the download with torch itself: {' to '.join(sorted({f'{b / 2**30:.1f}' for b in sizes.values()}))} GiB.",
    ]
    for name in names:
        versions = {py: per_python[py].get(name, (None,))[0] for py in per_python}
        if len(set(versions.values())) == 1:
            lines.append(f"{name}=={versions[PYTHONS[0]]}")
        else:
            lines += [f'{name}=={v}; python_version == "{py}"' for py, v in versions.items() if v]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "constraints-cuda.txt"))
    args = parser.parse_args(argv)
    version = re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    per_python = {}
    for python in PYTHONS:
        print(f"resolving torch=={version} for Python {python}", file=sys.stderr)
        per_python[python] = resolve(f"torch=={version}", python)
    pathlib.Path(args.out).write_text(render(version, per_python))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
