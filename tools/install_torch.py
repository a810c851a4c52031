"""Install the build of torch that fits this machine: `make setup` (and so `make lab`, `make test`) runs it.

    python tools/install_torch.py --torch auto --version 2.13.0 [--cuda-constraints constraints-cuda.txt] \\
        [--dry-run] -- .venv/bin/python -m pip install --quiet ... -c constraints.txt

Everything after `--` is the pip command to run (the Makefile's $(PIP): its flags and constraints);
this tool appends what selects the build. Standard library only: it runs before anything is installed.

--torch (the Makefile's TORCH):
    auto  (default) the CPU build on a machine without an NVIDIA GPU, the CUDA build on one with a GPU
    cpu   the CPU build: from PyTorch's CPU wheel index on Linux, where the default index (PyPI) holds the
          CUDA build (the torch wheel plus about 2 GiB of NVIDIA wheels, none of which a CPU uses)
    cuda  the CUDA build: the default index's wheel on Linux

On macOS and Windows the default index's wheel is already a CPU build (macOS: with Apple's MPS), so
`auto` and `cpu` install it from there; `cuda` is refused (PyTorch ships no CUDA wheel to PyPI for them).

The CPU build is installed in two pip runs: torch alone (--no-deps) from the CPU index, then torch's
pure-Python dependencies from the default index (or a mirror the user configured), so that the
versions pinned in constraints.txt come from where they are published. Where the CPU index cannot be
reached (probed with a GET and a short timeout), torch==VERSION is installed from the default index
instead (PyPI's Linux wheel: the CUDA build; a VERSION+cpu wheel in a mirror or --find-links folder
pip is configured with wins over it), and one line says so, what was installed and how large it is
on disk.

Pins: the version comes from one place, the Makefile's TORCH_VERSION (tools/lock.py writes it into
constraints.txt too). The CPU build is asked for as VERSION+cpu, the CUDA build as ===VERSION (arbitrary
equality: VERSION alone would also match an installed VERSION+cpu, and pip would keep it). The CUDA
build's own extra wheels (nvidia-*, cuda-*, triton) are pinned by --cuda-constraints
(constraints-cuda.txt, written by tools/lock_cuda.py), whenever the default index's Linux wheel may be
installed.

How a GPU is detected (nvidia_gpu): `nvidia-smi -L` on PATH that succeeds and lists a GPU. Not
/proc/driver/nvidia alone: /proc is the host kernel's, so a container on a GPU host sees the driver
even when no GPU was passed into it, and there the CUDA build could not use one. nvidia-smi needs
the driver's user-space library and the device nodes, which are exactly what CUDA needs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 5  # a reachable index answers in well under a second; an offline DNS lookup fails at once

# What the installed torch is, asked of the target Python after the install (no import of torch:
# its version and its extra wheels' sizes from the installed distributions' file lists).
_REPORT = r"""
import importlib.metadata as md, os
def size(dist):
    return sum(os.path.getsize(f.locate()) for f in (dist.files or ()) if os.path.isfile(f.locate()))
torch = md.distribution("torch")
extra = [d for d in md.distributions() if (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("nvidia-", "cuda-", "triton"))]
print(torch.version, size(torch), sum(size(d) for d in extra), len(extra))
"""


def nvidia_gpu() -> bool:
    """True where `nvidia-smi -L` runs and lists at least one GPU (see the module docstring: why this)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and any(line.startswith("GPU ") for line in done.stdout.splitlines())


def cpu_index_reachable(url: str = CPU_INDEX, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when PyTorch's CPU index answers for torch, else why not (one short phrase)."""
    try:
        with urllib.request.urlopen(f"{url}/torch/", timeout=timeout_s) as answer:
            return None if answer.status == 200 else f"HTTP {answer.status}"
    except Exception as exc:  # noqa: BLE001: any failure to get the page means "not reachable" here
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def plan(torch: str, version: str, pip: list[str], *, system: str, gpu, probe,
         cuda_constraints: str | None = None) -> tuple[list[list[str]], str]:
    """The pip commands to run, and the one line that says what they install and why.

    `gpu` and `probe` are callables (nvidia_gpu, cpu_index_reachable), called only when the choice
    needs them, so tests can swap them out."""
    if torch not in ("auto", "cpu", "cuda"):
        raise ValueError(f"TORCH={torch!r} must be auto, cpu or cuda")
    if not pip:
        raise ValueError("no pip command after --")
    default_wheel = pip + [f"torch==={version}"]
    if system != "Linux":
        if torch == "cuda":
            raise ValueError(f"TORCH=cuda: PyPI's torch for {system} is a CPU build; the CUDA build from the "
                             "default index is for Linux (on Windows, use WSL2)")
        return [pip + [f"torch=={version}"]], f"torch {version} from the default index ({system}: a CPU build)"
    if cuda_constraints:
        default_wheel = pip + ["-c", cuda_constraints, f"torch==={version}"]
    if torch == "cuda" or (torch == "auto" and gpu()):
        why = "TORCH=cuda" if torch == "cuda" else "an NVIDIA GPU was found (nvidia-smi -L)"
        return [default_wheel], f"torch {version}, the CUDA build, from the default index: {why}"
    why = "TORCH=cpu" if torch == "cpu" else "no NVIDIA GPU found (nvidia-smi -L)"
    unreachable = probe()
    if unreachable:
        # torch==VERSION, not ===: a VERSION+cpu wheel that pip's configured sources hold (a mirror,
        # --find-links) still wins over PyPI's CUDA wheel; the line printed after the install says
        # which one came.
        fallback = pip + (["-c", cuda_constraints] if cuda_constraints else []) + [f"torch=={version}"]
        return [fallback], (f"torch {version}: PyTorch's CPU index {CPU_INDEX} could not be reached "
                            f"({unreachable}), so torch=={version} from the default index instead (PyPI's "
                            f"Linux wheel is the CUDA build, with its NVIDIA wheels: it runs on the CPU all "
                            f"the same); {why}")
    return ([pip + ["--no-deps", "--index-url", CPU_INDEX, f"torch=={version}+cpu"],
             pip + [f"torch=={version}+cpu"]],
            f"torch {version}+cpu, the CPU build, from PyTorch's CPU index: {why}")


def python_of(pip: list[str]) -> str | None:
    """The interpreter of a `PYTHON -m pip ...` command (None for a bare `pip`)."""
    return pip[0] if len(pip) > 2 and pip[1:3] == ["-m", "pip"] else None


def installed(python: str) -> str:
    """What is installed now, in words: version, build and size on disk."""
    done = subprocess.run([python, "-c", _REPORT], capture_output=True, text=True)
    if done.returncode != 0:
        return "torch is not installed (the report failed: " + done.stderr.strip().splitlines()[-1] + ")"
    version, torch_bytes, extra_bytes, n_extra = done.stdout.split()
    gib = (int(torch_bytes) + int(extra_bytes)) / 2**30
    build = "the CPU build" if "+cpu" in version or int(n_extra) == 0 else "the CUDA build"
    with_extra = f" with {n_extra} NVIDIA/CUDA/Triton wheels" if int(n_extra) else ""
    return f"installed torch {version}, {build}{with_extra}: {gib:.1f} GiB on disk"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: install_torch.py [options] -- PIP INSTALL COMMAND (see --help)", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default=os.environ.get("TORCH", "auto"), help="auto (default), cpu or cuda")
    parser.add_argument("--version", required=True, help="torch's version, e.g. 2.13.0 (the Makefile's TORCH_VERSION)")
    parser.add_argument("--cuda-constraints", default=None, help="pins of the CUDA build's extra wheels")
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands, run nothing")
    args = parser.parse_args(argv[:split])
    pip = argv[split + 1:]
    try:
        commands, line = plan(args.torch, args.version, pip, system=platform.system(), gpu=nvidia_gpu,
                              probe=cpu_index_reachable, cuda_constraints=args.cuda_constraints)
    except ValueError as exc:
        print(f"install_torch: {exc}", file=sys.stderr)
        return 2
    for command in commands:
        print("+ " + " ".join(command), flush=True)
        if not args.dry_run:
            done = subprocess.run(command)
            if done.returncode != 0:
                return done.returncode
    python = python_of(pip)
    if args.dry_run or python is None:
        print(f"{line} (dry run)" if args.dry_run else line)
    else:
        print(f"{line}; {installed(python)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
