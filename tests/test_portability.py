"""`make test-portability` re-executes the notebooks on the CPU code paths that differ most from
the one that stored their outputs (Makefile: PORTABLE_PATHS), so that an output depending on the
CPU fails in CI rather than on a learner's machine. These tests check that the paths cover both
of PyTorch's kernel choices and both thread counts, that CI runs them, that `make test` itself
runs on the machine's own path, and that the switch changes low-precision results here, i.e.
that it would catch such a cell."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A low-precision forward and backward of the course GPT: its fp16 rounding depends on the
# vectorised kernels that run it (this is how notebook 04 once printed 3.19 on one CPU and 3.20
# on another).
PROBE = """
import torch
from course_lib.model import GPT, GPTConfig
m = GPT(GPTConfig.tiny(97, n_layer=1, d_model=32, block_size=16), seed=0)
g = torch.Generator().manual_seed(0)
x, y = torch.randint(0, 97, (8, 16), generator=g), torch.randint(0, 97, (8, 16), generator=g)
with torch.autocast("cpu", dtype=torch.float16):
    loss = m(x, y)[1]
loss.backward()
print(repr(loss.item()), repr(m.tok_emb.weight.grad.float().abs().sum().item()))
"""


def _probe(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _portable_paths() -> list[dict]:
    text = (ROOT / "Makefile").read_text()
    line = re.search(r"^PORTABLE_PATHS [:?]= (.*)$", text, re.M)
    assert line, "the Makefile must define PORTABLE_PATHS, the CPU paths test-portability re-executes notebooks on"
    paths = []
    for item in line.group(1).split():
        capability, threads = item.split(":")
        paths.append({"ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": threads})
    return paths


def _makefile() -> str:
    return (ROOT / "Makefile").read_text()


def _recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    return re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M).group(1)


def test_portability_covers_both_kernels_and_both_thread_counts():
    paths = _portable_paths()
    assert {p["ATEN_CPU_CAPABILITY"] for p in paths} == {"default", "avx2"}
    assert {p["OMP_NUM_THREADS"] for p in paths} == {"1", "2"}
    recipe = _recipe("test-portability")
    assert "$(PORTABLE_PATHS)" in recipe and "ATEN_CPU_CAPABILITY=" in recipe and "$(PORTABLE_DIRS)" in recipe
    assert re.search(r"^PORTABLE_DIRS \?= notebooks exercises$", (ROOT / "Makefile").read_text(), re.M)


def test_make_test_runs_on_the_machines_own_path_and_ci_on_it_and_a_portable_one():
    assert "ATEN_CPU_CAPABILITY" not in _recipe("test") and "OMP_NUM_THREADS" not in _recipe("test")
    assert re.search(r"^NOTEBOOK_PATH \?=\s*$", (ROOT / "Makefile").read_text(), re.M)  # the machine's own
    ci = (ROOT / ".ci" / "run").read_text()
    for target in ("test", "test-portability", "test-browser", "test-site"):
        assert re.search(rf"^timed make {target}\b", ci, re.M), f".ci/run must run make {target}"
    # the library's tests under NCCL's rules, the gloo_only ones after them without (conftest.py)
    assert "COURSE_NCCL_RULES=1" in _recipe("test") and "-m gloo_only" in _recipe("test")
    # the notebooks and the exercises on the machine's own path (what a learner's make test and
    # kernel run: an AVX-512 learner's failure must show in CI), every folder of them...
    assert re.search(r"make test( \|\||$)", ci, re.M) and "NOTEBOOK_PATH" not in ci and "NOTEBOOK_DIRS" not in ci
    assert re.search(r"^NOTEBOOK_DIRS \?= notebooks exercises$", _makefile(), re.M)
    # ...and again on the first portable path unlike it
    assert re.search(r"make test-portability PORTABLE_PATHS=\"\$path\"( |\|\||$)", ci, re.M)
    assert "make -s portable-paths" in ci and "make -s python-path" in ci
    assert re.search(r"^PORTABLE_DIRS \?= notebooks exercises$", _makefile(), re.M)


def test_the_switch_changes_low_precision_results_here():
    native = _probe({})
    # any() stops at the first path that differs: each probe is a process that imports torch
    assert any(_probe(p) != native for p in _portable_paths()), \
        "no portable path changes the fp16 probe on this CPU: test-portability would catch nothing"
