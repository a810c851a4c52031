"""The dev container (.devcontainer/devcontainer.json, GitHub Codespaces): it parses, its commands are
Makefile targets, and it asks for the machine the course is tuned for and forwards JupyterLab's port."""

import json
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = ROOT / ".devcontainer" / "devcontainer.json"
JUPYTER_DEFAULT_PORT = 8888  # jupyter_server's ServerApp.port default, used by `make lab` (it sets no port)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9_.\- $()]+?)\s*:(?!=)", line)  # "a b: deps" (not "A := value")
        if match and not line.startswith("\t"):
            targets |= set(match.group(1).split())
    return targets


def commands(spec: dict) -> list[str]:
    """Every lifecycle command (onCreate/postCreate/postStart/... Command): a string, a list of
    arguments, or an object of named commands."""
    out = []
    for key, value in spec.items():
        if not key.endswith("Command"):
            continue
        for one in (value.values() if isinstance(value, dict) else [value]):
            out.append(one if isinstance(one, str) else shlex.join(one))
    return out


def test_the_spec_is_strict_json_with_the_course_machine():
    spec = json.loads(SPEC.read_text())  # plain JSON (no comments): any tool can read it
    assert spec["hostRequirements"]["cpus"] == 2  # the 2-core machine the notebooks' time budget is set on
    assert re.fullmatch(r"python:3\.11-(bookworm|slim-bookworm)", spec["image"])  # CI's Python, Debian
    assert spec["forwardPorts"] == [JUPYTER_DEFAULT_PORT]
    assert str(JUPYTER_DEFAULT_PORT) in spec["portsAttributes"]


def test_its_commands_are_make_targets_that_exist():
    spec = json.loads(SPEC.read_text())
    targets = makefile_targets()
    assert {"setup", "lab", "test"} <= targets and "PIP" not in targets  # the parser reads rules, not variables
    found = []
    for command in commands(spec):
        for part in re.split(r"&&|;|\|\|", command):
            words = shlex.split(part)
            if words and words[0] == "make":
                goals = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
                assert goals, f"{command!r}: name the target"
                found += goals
            else:
                assert not words, f"{command!r}: only make targets, so the container sets up as `make` does"
    assert found == ["setup"]  # postCreate: `make setup`, what `make lab` and `make test` run first
    assert set(found) <= targets


def test_make_lab_serves_on_the_forwarded_port():
    lab = re.search(r"^lab:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    port = re.search(r"(?:--port[= ]|ServerApp\.port=)(\d+)", lab)
    assert (int(port.group(1)) if port else JUPYTER_DEFAULT_PORT) == JUPYTER_DEFAULT_PORT
