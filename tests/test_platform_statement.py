"""The README's "Where it runs" section points at the code that makes each platform choice: every
file it names exists and holds the names it quotes, and those still make the choice it states."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Where it runs\n", 1)[1].split("\n## ", 1)[0]


def defined(path: pathlib.Path) -> dict[str, str]:
    """Top-level function names of a module -> their source."""
    text = path.read_text()
    tree = ast.parse(text)
    return {n.name: ast.get_source_segment(text, n) for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_named_place_exists():
    text = section()
    paths = re.findall(r"`((?:course_lib|tools)/[\w/]+\.py)`", text)
    assert "course_lib/platform.py" in paths and len(paths) >= 5  # the one place, and where its choices are used
    for p in paths:
        assert (ROOT / p).is_file(), p
    for path, names in re.findall(r"`(course_lib/[\w/]+\.py)` \(([^)]*)\)", text):
        for name in re.findall(r"`(\w+)`:", names):
            assert name in defined(ROOT / path), f"{path} has no function {name}"


def test_the_stated_choices_are_the_code_s():
    text = section()
    platform = (ROOT / "course_lib/platform.py").read_text()
    choices = defined(ROOT / "course_lib/platform.py")
    assert 'PREFERRED_START_METHODS = ("forkserver", "spawn")' in platform and "forkserver where the platform has it" in text
    assert "start_method()" in defined(ROOT / "course_lib/runtime/pool.py")["_mp_context"]
    assert "sched_getaffinity" in choices["usable_cores"] and "usable_cores()" in defined(
        ROOT / "course_lib/runtime/device.py")["threads_per_rank"]
    backend = defined(ROOT / "course_lib/runtime/device.py")["resolve_backend"]
    assert '"nccl" if n_gpus >= local_world_size else "gloo"' in backend and "NCCL when every local rank has a CUDA GPU" in text
    # ru_maxrss in the platform's unit: KiB on Linux, bytes on macOS
    assert 'RU_MAXRSS_BYTES = 1 if sys.platform == "darwin" else 1024' in platform
    assert "as KiB on Linux and as bytes on macOS" in text and "peak_rss_bytes()" in (ROOT / "course_lib/capstone/run.py").read_text()
    # the killed ranks: SIGKILL, else (Windows) TerminateProcess through os.kill
    assert 'HARD_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)' in platform and "TerminateProcess" in text
    for path in ("course_lib/demos/capstone.py", "course_lib/checkpoint/training.py"):
        code = (ROOT / path).read_text()
        assert "kill_self_hard()" in code and "signal.SIGKILL" not in code, path
