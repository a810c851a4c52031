"""FP8's hardware path: when FP8Linear's forward may call torch._scaled_mm, and the fallback.

FP8 tensor-core matmuls exist from NVIDIA's compute capability 8.9 (Ada) and 9.0 (Hopper) on;
torch._scaled_mm refuses older GPUs ("only supported on CUDA devices with compute capability >=
9.0 or 8.9, or ROCm MI300+", PyTorch PR #118881, 2024). An A100 (sm_80) runs FP8Linear anyway:
the forward falls back to the emulation the course runs on CPU (fp32 matmul on the exact
dequantized values, course_lib/techniques/fp8.py), and says so once per device with a
RuntimeWarning naming the device and the reason: the numbers are the emulation's, the speed is
not FP8's.

    fp8_matmul_supported(device) -> (bool, reason)    the one check (CPU: False, the emulation)
    scaled_mm_forward(qx, sx, qw, sw, recipe)         torch._scaled_mm's output, or None: emulate

Besides the device, the kernel takes per-tensor or row-wise scales only, with both dims of the
contraction multiple of 16: other recipes (tile and block scales, MX and NV blocks) are emulated
on any device, without a warning (a property of the recipe, not of the machine). Should
torch._scaled_mm still refuse a call the check let through (a ROCm GPU older than MI300, a
row-wise call a torch build lacks), the forward falls back too and the warning quotes its error.
"""

from __future__ import annotations

import warnings

import torch

MIN_CAPABILITY = (8, 9)  # Ada; Hopper is (9, 0), Blackwell (10, 0) and (12, 0)
_WARNED: set[str] = set()  # devices already warned about (once each per process)


def fp8_matmul_supported(device) -> tuple[bool, str]:
    """(whether torch._scaled_mm can run FP8 matmuls on `device`, the reason in words)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, (f"device {device.type}: no FP8 matmul kernel; the course emulates it (fp32 matmul "
                       f"on the exact dequantized values)")
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    if not torch.cuda.is_available():
        return False, "CUDA is not available in this process"
    if getattr(torch.version, "hip", None):
        return True, "ROCm: torch._scaled_mm needs an MI300 or newer (tried; refused calls fall back)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return False, (f"compute capability sm_{major}{minor} < sm_89: FP8 matmuls (torch._scaled_mm) need "
                       f"an Ada (sm_89), Hopper (sm_90) or newer GPU")
    return True, f"compute capability sm_{major}{minor} >= sm_89: torch._scaled_mm"


def warn_once(device, reason: str) -> None:
    """One RuntimeWarning per device per process: FP8Linear emulates its matmuls there, and why."""
    key = str(torch.device(device))
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"FP8Linear on {key}: {reason}; falling back to the emulation (fp32 matmul on the "
                  f"dequantized FP8 values: the same numbers as FP8's, not its speed)", RuntimeWarning, stacklevel=3)


def _recipe_fits(qx, qw, recipe) -> bool:
    return (recipe.activation == recipe.weight and recipe.activation in ("tensor", "row")
            and qx.shape[1] % 16 == 0 and qw.shape[0] % 16 == 0)


def scaled_mm_forward(qx, sx, qw, sw, recipe):
    """x W^T through torch._scaled_mm in fp32, or None where the caller emulates it (module docstring)."""
    if not qx.is_cuda or not _recipe_fits(qx, qw, recipe):
        return None  # the CPU, or a recipe the kernel does not take: the emulation, silently
    ok, reason = fp8_matmul_supported(qx.device)
    if not ok:
        warn_once(qx.device, reason)
        return None
    try:
        if recipe.activation == "tensor":
            return torch._scaled_mm(qx, qw.t(), scale_a=sx.reshape(()), scale_b=sw.reshape(()),
                                    out_dtype=torch.float32)
        out = torch._scaled_mm(qx, qw.t(), scale_a=sx.reshape(-1, 1), scale_b=sw.reshape(1, -1),
                               out_dtype=torch.bfloat16)
    except RuntimeError as e:  # refused after all: the emulation, and the kernel's own words
        warn_once(qx.device, f"torch._scaled_mm refused the call ({str(e).splitlines()[0]})")
        return None
    return out.float()  # row-wise _scaled_mm accumulates in fp32 but writes bf16
