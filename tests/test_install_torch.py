"""tools/install_torch.py: which build of torch `make setup` installs, and with which pip commands.

The GPU detection and the CPU index probe are swapped out; the commands are compared exactly."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import install_torch  # noqa: E402

PIP = ["py", "-m", "pip", "install", "-q", "-c", "constraints.txt"]
CPU_STEPS = [PIP + ["--no-deps", "--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"],
             PIP + ["torch==2.13.0+cpu"]]
CUDA_STEP = [PIP + ["-c", "constraints-cuda.txt", "torch===2.13.0"]]
# The CPU index unreachable: ==, so a 2.13.0+cpu wheel pip's own sources hold still wins over PyPI's CUDA one
FALLBACK = [PIP + ["-c", "constraints-cuda.txt", "torch==2.13.0"]]


def never():
    raise AssertionError("called where the choice does not need it")


def plan(torch, *, gpu, probe, system="Linux"):
    return install_torch.plan(torch, "2.13.0", PIP, system=system, gpu=gpu, probe=probe,
                              cuda_constraints="constraints-cuda.txt")


@pytest.mark.parametrize("torch, gpu, probe, commands, said", [
    ("auto", lambda: False, lambda: None, CPU_STEPS, "the CPU build, from PyTorch's CPU index: no NVIDIA GPU"),
    ("auto", lambda: True, never, CUDA_STEP, "the CUDA build, from the default index: an NVIDIA GPU was found"),
    ("cpu", never, lambda: None, CPU_STEPS, "the CPU build, from PyTorch's CPU index: TORCH=cpu"),
    ("cuda", never, never, CUDA_STEP, "the CUDA build, from the default index: TORCH=cuda"),
    ("auto", lambda: False, lambda: "URLError: timed out", FALLBACK,
     "could not be reached (URLError: timed out), so torch==2.13.0 from the default index instead"),
    ("cpu", never, lambda: "HTTP 503", FALLBACK, "could not be reached (HTTP 503)"),
], ids=["no-gpu", "gpu", "forced-cpu", "forced-cuda", "index-unreachable", "forced-cpu-unreachable"])
def test_the_build_and_the_exact_pip_commands(torch, gpu, probe, commands, said):
    got, line = plan(torch, gpu=gpu, probe=probe)
    assert got == commands
    assert said in line


@pytest.mark.parametrize("system", ["Darwin", "Windows"])
def test_macos_and_windows_take_the_default_index_whose_wheel_is_a_cpu_build(system):
    for torch in ("auto", "cpu"):
        got, line = plan(torch, gpu=never, probe=never, system=system)
        assert got == [PIP + ["torch==2.13.0"]] and f"({system}: a CPU build)" in line
    with pytest.raises(ValueError, match="TORCH=cuda: PyPI's torch for .* is a CPU build"):
        plan("cuda", gpu=never, probe=never, system=system)


def test_without_constraints_no_cuda_pins_are_added():
    got, _ = install_torch.plan("cuda", "2.13.0", PIP, system="Linux", gpu=never, probe=never)
    assert got == [PIP + ["torch===2.13.0"]]


def test_bad_choice_is_refused():
    with pytest.raises(ValueError, match="TORCH='gpu' must be auto, cpu or cuda"):
        plan("gpu", gpu=never, probe=never)


def test_gpu_detection_reads_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert install_torch.nvidia_gpu() is False  # no nvidia-smi on PATH
    smi = tmp_path / "nvidia-smi"
    for body, found in [("echo 'GPU 0: NVIDIA H100 (UUID: GPU-1)'", True),
                        ("echo 'NVIDIA-SMI has failed because it could not communicate with the driver'; exit 9", False),
                        ("echo 'No devices found.'", False)]:
        smi.write_text(f"#!/bin/sh\n{body}\n")
        smi.chmod(0o755)
        assert install_torch.nvidia_gpu() is found, body


def test_an_unreachable_index_is_reported_not_raised():
    # A port nothing listens on: the probe says why in a phrase instead of raising.
    why = install_torch.cpu_index_reachable("http://127.0.0.1:9", timeout_s=2)
    assert why and "Error" in why


def test_dry_run_prints_the_commands_and_the_makefile_calls_the_tool():
    cmd = [sys.executable, "tools/install_torch.py", "--torch", "cpu", "--version", "2.13.0", "--dry-run",
           "--", "PY", "-m", "pip", "install"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    # cpu is forced, so only the probe decides: either both CPU steps or the fallback to the default index
    assert (out.startswith("+ PY -m pip install --no-deps --index-url https://download.pytorch.org/whl/cpu "
                           "torch==2.13.0+cpu\n+ PY -m pip install torch==2.13.0+cpu\n")
            or out.startswith("+ PY -m pip install torch==2.13.0\ntorch 2.13.0: PyTorch's CPU index")), out
    assert out.rstrip().endswith("(dry run)")
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(r"^\$\(STAMP\):.*?\n\n", makefile, re.M | re.S).group(0)
    assert ("$(PY) tools/install_torch.py --torch $(TORCH) --version $(TORCH_VERSION) "
            "$(if $(CONSTRAINTS),--cuda-constraints constraints-cuda.txt,) -- $(PIP)") in rule
    assert re.search(r"^TORCH\s*\?= auto$", makefile, re.M)


def test_cuda_constraints_pin_every_extra_wheel_torch_names():
    # torch 2.13.0's CUDA wheel's own Requires-Dist (read from PyPI by tools/lock_cuda.py): each
    # Linux-only requirement is pinned, and exactly once per Python.
    lines = [line for line in (ROOT / "constraints-cuda.txt").read_text().splitlines() if not line.startswith("#")]
    names = [re.match(r"([a-z0-9-]+)==", line).group(1) for line in lines]
    for wanted in ("cuda-toolkit", "cuda-bindings", "nvidia-cudnn-cu13", "nvidia-cusparselt-cu13",
                   "nvidia-nccl-cu13", "nvidia-nvshmem-cu13", "triton", "nvidia-cublas"):
        assert wanted in names
    plain = {n for n, line in zip(names, lines) if ";" not in line}
    assert len(plain) == len([line for line in lines if ";" not in line])  # no name pinned twice plainly
    for name in set(names) - plain:
        markers = [line.split(";")[1].strip() for n, line in zip(names, lines) if n == name]
        assert sorted(markers) == [f'python_version == "3.1{i}"' for i in range(4)], name
    versions = dict(line.split("==") for line in lines if ";" not in line)
    assert versions["nvidia-nccl-cu13"] == "2.29.7" and versions["triton"] == "3.7.1"


def test_the_report_of_what_is_installed_names_this_torch():
    import torch

    line = install_torch.installed(sys.executable)
    build = "the CUDA build" if torch.version.cuda else "the CPU build"
    assert re.fullmatch(rf"installed torch {re.escape(torch.__version__)}, {build}( with \d+ NVIDIA/CUDA/Triton wheels)?: "
                        r"\d+\.\d GiB on disk", line), line
