"""The torchrun instructor path, and the set-up files agreeing with each other."""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from course_lib import run_on_ranks
from course_lib.demos.allreduce import allreduce_bandwidth, hello_allreduce
from _demo_cli import run_main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_allreduce_demo_under_torchrun_with_gloo():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.allreduce", "--sizes-mb", "0.25", "--iters", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every rank holds 3 = 1 + ... + 2" in proc.stdout
    assert re.search(r"0\.25 MiB .* ms .* GB/s .* GB/s", proc.stdout), proc.stdout


def test_allreduce_demo_rejects_bad_arguments():
    code, err = run_main("course_lib.demos.allreduce", ["--iters", "0"])
    assert code != 0 and "--iters=0 must be >= 1" in err


def test_demo_functions_run_from_a_notebook_too():
    assert run_on_ranks(hello_allreduce, world_size=3) == [6.0] * 3
    rows = run_on_ranks(allreduce_bandwidth, sizes_mb=(0.125,), iters=1, world_size=2)
    assert [r[0]["size_mb"] for r in rows] == [0.125, 0.125]
    assert all(r[0]["busbw_GBps"] == pytest.approx(r[0]["algbw_GBps"] * 2 * 1 / 2) for r in rows)


def _normalise(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_normalise(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env_text = (ROOT / "environment.yml").read_text()
    pip_section = env_text.split("- pip:", 1)[1]
    listed = {_normalise(line.strip()[2:]) for line in pip_section.splitlines() if line.strip().startswith("- ")}
    listed -= {"-e", "-c"}
    assert "python=3.11" in env_text
    assert wanted <= listed, f"environment.yml is missing {sorted(wanted - listed)}"
    assert listed - {"course-lib"} <= wanted | {"."}, f"environment.yml lists extra {sorted(listed - wanted)}"


def _constraints() -> dict[str, list[tuple[str, str]]]:
    """{name: [(version, marker)]} from constraints.txt."""
    pins: dict[str, list[tuple[str, str]]] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req, _, marker = line.partition(";")
        name, sep, version = req.strip().partition("==")
        assert sep, f"constraints.txt pins exact versions only, got {line!r}"
        pins.setdefault(_normalise(name), []).append((version, marker.strip()))
    return pins


def _applies(marker: str, python: str) -> bool:
    if not marker:
        return True
    op, version = re.fullmatch(r'python_version (==|<=|>=) "([\d.]+)"', marker).groups()
    key = lambda v: tuple(map(int, v.split(".")))  # noqa: E731
    return {"==": key(python) == key(version), "<=": key(python) <= key(version),
            ">=": key(python) >= key(version)}[op]


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_every_dependency_is_pinned_once_for_every_supported_python(python):
    # make lab, make test and environment.yml install through constraints.txt, so what a fresh
    # clone gets is what the suite passed with (a new release upstream cannot turn it red).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_normalise(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted |= {_normalise(r) for r in extra}
    if python != "3.10":
        wanted.discard("tomli")  # only needed below 3.11 (tomllib)
    pins = _constraints()
    for name in sorted(wanted):
        applying = [v for v, marker in pins.get(name, []) if _applies(marker, python)]
        assert len(applying) == 1, f"constraints.txt pins {name} {len(applying)} times for Python {python}"


def test_every_install_goes_through_the_constraints_and_torch_is_pinned_alike():
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = "torch==" + re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", makefile, re.M).group(1)
    assert _constraints()["torch"] == [(torch_pin.split("==")[1], "")]
    assert re.search(r"^CONSTRAINTS \?= constraints.txt$", makefile, re.M)
    installs = [line for line in makefile.splitlines() if "pip install" in line or line.strip().startswith("$(PIP)")]
    assert installs and all("$(PIP)" in line or "-c $(CONSTRAINTS)" in line for line in installs), installs
    env = (ROOT / "environment.yml").read_text()
    assert "- -c constraints.txt" in env and f"- {torch_pin}" in env
