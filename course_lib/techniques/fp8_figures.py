"""Pictures and measurements for the FP8 section of notebook 04 (course_lib.techniques.fp8).

    format_values(fmt)                every finite value >= 0 of e4m3 or e5m2, from its 128 bit patterns
    number_lines()                    the two formats as number lines on a log2 axis
    outlier_errors(x, mask, ...)      mean relative error of each granularity on the entries `mask` selects
    plot_outlier_errors(rows)         those errors as bars
    gpu_measurement()                 the stored bf16-vs-FP8 matmul speeds of one H200 (assets/gpu_h200.json)
    format_gpu_table(measured)        that measurement as a table
"""

from __future__ import annotations

import json
import pathlib

import matplotlib.pyplot as plt
import torch

from course_lib.techniques.fp8 import FORMATS, GRANULARITIES, dequantize, quantize


def format_values(fmt: str) -> torch.Tensor:
    """Sorted finite values >= 0 of the format: the bit patterns 0x00..0x7F read as that dtype."""
    v = torch.arange(128, dtype=torch.uint8).view(FORMATS[fmt]).float()
    return v[torch.isfinite(v)].unique()  # e4m3: 0x7F is NaN; e5m2: 0x7C is inf, 0x7D-0x7F NaN


def number_lines():
    """One line per format: a tick at every positive value (log2 axis), subnormals in orange."""
    fig, ax = plt.subplots(figsize=(11, 2.6))
    for row, fmt in enumerate(("e5m2", "e4m3")):
        v = format_values(fmt)[1:]  # leave out 0: no place on a log axis
        fi = torch.finfo(FORMATS[fmt])
        sub = v < fi.smallest_normal
        ax.vlines(torch.log2(v[~sub]), row - 0.3, row + 0.3, color="tab:blue", lw=0.8)
        ax.vlines(torch.log2(v[sub]), row - 0.3, row + 0.3, color="tab:orange", lw=0.8)
        ax.text(torch.log2(v[-1]).item() + 0.4, row, f"max {fi.max:g}", va="center", fontsize=8)
        ax.text(torch.log2(v[0]).item() - 0.4, row, f"{len(v)} values > 0", va="center", ha="right", fontsize=8)
    ax.vlines([], 0, 0, color="tab:orange", label="subnormal")
    ax.vlines([], 0, 0, color="tab:blue", label="normal")
    ax.set_yticks([0, 1], ["e5m2", "e4m3"])
    ax.set_xlim(-22, 20)
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlabel("log2 value (each tick one representable number; 8 ticks per power of two in e4m3, 4 in e5m2)")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.set_title("FP8: e4m3 trades range for one more mantissa bit")
    fig.tight_layout()
    return fig


def outlier_errors(x: torch.Tensor, mask: torch.Tensor, fmt: str = "e4m3", granularities=GRANULARITIES) -> dict:
    """{granularity: (mean relative error |dq - x| / |x| over the nonzero entries mask selects, fraction
    of them flushed to 0)} for a quantize-dequantize round trip of the whole of x. The mean of
    per-entry errors weighs small entries as much as large ones: what a coarse scale destroys."""
    out, sel = {}, mask & (x != 0)
    for g in granularities:
        dq = dequantize(*quantize(x, "mxfp8" if g == "mx32" and fmt == "e4m3" else fmt, g), g)
        out[g] = (((dq - x).abs() / x.abs())[sel].mean().item(), (dq == 0)[sel].float().mean().item())
    return out


def plot_outlier_errors(rows: dict[str, dict]):
    """Grouped bars: one group per outlier kind (rows' keys), one bar per granularity."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    kinds = list(rows)
    grans = list(next(iter(rows.values())))
    width = 0.8 / len(grans)
    for j, g in enumerate(grans):
        ax.bar([i + j * width for i in range(len(kinds))], [rows[k][g][0] for k in kinds], width, label=g)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))], kinds)
    ax.set_yscale("log")
    ax.set_ylabel("mean relative error of\nthe ordinary entries (e4m3)")
    ax.legend(fontsize=8, ncol=len(grans))
    ax.set_title("where the scale comes from decides what an outlier costs")
    fig.tight_layout()
    return fig


GPU_MEASUREMENT = pathlib.Path(__file__).resolve().parents[1] / "assets" / "gpu_h200.json"


def gpu_measurement() -> dict:
    """What benchmarks/gpu_fp8_matmul.py measured on one H200 (stored: this machine has no FP8
    multiplier): {"measured" (date), "fp8_matmul": {"device", "torch", "cuda", "sizes": [...]}, ...}."""
    return json.loads(GPU_MEASUREMENT.read_text())


def format_gpu_table(measured: dict) -> str:
    """TFLOP/s of n x n x n matmuls, bf16 and FP8 (e4m3 with one scale per tensor / per row),
    and FP8's speed-up over bf16 in the same run."""
    m = measured["fp8_matmul"]
    lines = [f"{m['device']}, torch {m['torch']}, CUDA {m['cuda']}, {measured['measured']} "
             f"(median of {m['iters']} timed calls)",
             f"{'n':>6} {'bf16':>8} {'FP8/tensor':>11} {'FP8/row':>9}   FP8/tensor over bf16"]
    for r in m["sizes"]:
        lines.append(f"{r['n']:>6} {r['bf16_tflops']:>8.0f} {r['fp8_tensorwise_tflops']:>11.0f} "
                     f"{r['fp8_rowwise_tflops']:>9.0f}   {r['fp8_tensorwise_over_bf16']:.2f}x")
    return "\n".join(lines) + "\n(TFLOP/s; spec-sheet dense peaks: 989 bf16, 1,979 FP8)"
