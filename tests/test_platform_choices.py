"""course_lib.platform holds the code's platform choices, and the modules take them from there."""

import importlib
import io
import os
import pathlib
import signal
import subprocess
import sys
import tokenize

import pytest

import course_lib.platform as plat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_start_method_prefers_forkserver_and_falls_back_to_spawn():
    assert plat.start_method(["fork", "spawn", "forkserver"]) == "forkserver"  # Linux
    assert plat.start_method(["spawn", "fork", "forkserver"]) == "forkserver"  # macOS lists spawn first
    assert plat.start_method(["spawn"]) == "spawn"  # Windows
    with pytest.raises(RuntimeError, match="no start method"):
        plat.start_method(["fork"])
    assert plat.start_method() == "forkserver"  # this Linux machine


def test_the_pool_starts_ranks_with_the_platform_start_method(monkeypatch):
    from course_lib.runtime import pool

    assert pool._mp_context().get_start_method() == "forkserver"
    monkeypatch.setattr(pool, "start_method", lambda: "spawn")
    assert pool._mp_context().get_start_method() == "spawn"


def test_usable_cores_is_the_affinity_else_every_core(monkeypatch):
    assert plat.usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")  # as on macOS and Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert plat.usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # "undetermined"
    assert plat.usable_cores() == 1


def test_cores_come_from_the_platform_module(monkeypatch):
    from course_lib.measure import calibrate
    from course_lib.runtime import device

    monkeypatch.setattr(device, "usable_cores", lambda: 8)
    assert [device.threads_per_rank(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setattr(calibrate, "usable_cores", lambda: 5)
    assert calibrate.cores_available() == 5


@pytest.fixture
def restore_platform_module():
    yield
    importlib.reload(plat)


def test_ru_maxrss_unit_per_platform(monkeypatch, restore_platform_module):
    assert plat.RU_MAXRSS_BYTES == 1024  # Linux: KiB
    monkeypatch.setattr(sys, "platform", "darwin")
    assert importlib.reload(plat).RU_MAXRSS_BYTES == 1  # macOS: bytes


def test_peak_rss_is_in_bytes():
    # A child touches 256 MiB; its peak must read between 256 MiB and 2 GiB. A wrong unit is off by
    # 1024x either way (256 KiB or 256 GiB), far outside; the upper bound leaves the interpreter room.
    code = ("import course_lib.platform as p\n"
            "b = bytearray(256 * 2**20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "print(p.peak_rss_bytes())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert 256 * 2**20 <= int(out.stdout) < 2 * 2**30


def test_peak_rss_without_resource_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` raises, as on Windows
    assert plat.peak_rss_bytes() is None


def test_hard_kill_is_sigkill_here_and_sigterm_without_it(monkeypatch, restore_platform_module):
    assert plat.HARD_KILL == signal.SIGKILL
    monkeypatch.delattr(signal, "SIGKILL")  # Windows' signal module has no SIGKILL
    assert importlib.reload(plat).HARD_KILL == signal.SIGTERM


def test_kill_self_hard_skips_every_clean_up():
    code = ("import atexit\n"
            "import course_lib.platform as p\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "try:\n    p.kill_self_hard()\nfinally:\n    print('finally ran', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == -signal.SIGKILL
    assert out.stdout == ""  # neither the atexit handler nor the finally block ran


# Where a platform choice would hide if made outside course_lib/platform.py: these names in code
# (comments and strings do not count). An exception says why it stays where it is.
CHOICES = {"sched_getaffinity", "ru_maxrss", "getrusage", "get_all_start_methods", "SIGKILL"}
EXCEPTIONS = {
    # the instructors' cohort grader kills a learner's whole process group (its own session), a
    # POSIX-only tool like `make`, not part of what a learner's notebooks run
    "course_lib/grading/grade.py": {"SIGKILL"},
}


def choices_in(path: pathlib.Path) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME and t.string in CHOICES}


def test_no_module_makes_a_platform_choice_of_its_own():
    found = {}
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        names = choices_in(path) - EXCEPTIONS.get(rel, set())
        if names and rel != "course_lib/platform.py":
            found[rel] = sorted(names)
    assert found == {}, f"platform choices outside course_lib/platform.py: {found}"


def test_the_scan_finds_a_choice(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os, signal\n# SIGKILL in a comment\nos.kill(1, signal.SIGKILL)\nn = os.sched_getaffinity(0)\n")
    assert choices_in(f) == {"SIGKILL", "sched_getaffinity"}
