"""The suite re-executes the notebooks on another CPU code path than the one that stored their
outputs (Makefile: PORTABLE), so that an output depending on the CPU fails here rather than on
a learner's machine. These tests check that the switch exists and changes low-precision results
on this machine, i.e. that it would catch such a cell."""

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


def _portable_env() -> dict:
    text = (ROOT / "Makefile").read_text()
    line = re.search(r"^PORTABLE := (.*)$", text, re.M)
    assert line, "the Makefile must define PORTABLE, the CPU path the suite re-executes notebooks on"
    assert "$(PORTABLE)" in re.search(r"^test:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    return dict(item.split("=", 1) for item in line.group(1).split())


def test_make_test_runs_on_another_cpu_path():
    env = _portable_env()
    assert env.get("ATEN_CPU_CAPABILITY") and env.get("OMP_NUM_THREADS")


def test_the_switch_changes_low_precision_results_here():
    cpu = pathlib.Path("/proc/cpuinfo")
    if not cpu.exists() or "avx512" not in cpu.read_text():
        pytest.skip("this CPU has no AVX-512 path to compare the AVX2 one with")
    portable = _portable_env()
    assert _probe({"ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": portable["OMP_NUM_THREADS"]}) != _probe(portable)
