"""bf16 against FP8 matmuls on one CUDA GPU: what FP8 buys in speed (notebook 04, §1.9).

    python benchmarks/gpu_fp8_matmul.py [--sizes 4096 8192 16384] [--iters 20]

For square sizes n: C = A @ B with A, B of n x n
  * bf16: torch.matmul on bf16 inputs (the baseline);
  * fp8 tensorwise: torch._scaled_mm on e4m3 inputs with one fp32 scale each, bf16 output;
  * fp8 rowwise: the same with one scale per row of A and per column of B (when this torch and
    GPU support it; the error is recorded otherwise).
TFLOP/s = 2 n^3 / time; the ratio is FP8's over bf16's measured in the same run. Each time is the
median of `iters` CUDA-event-timed calls after warm-up. Checks (not timed): each FP8 result
against the bf16 product of the same dequantized inputs (relative Frobenius error), and, when
course_lib is importable, FP8Linear's forward on the GPU (the torch._scaled_mm path) against its
CPU-equivalent path (fp32 matmul of the dequantized values).

Prints JSON; writes it to $OUT/fp8_matmul.json when OUT is set. Exits 2 without CUDA (CPU machines
have no FP8 matmul units: the course's CPU code emulates the numerics only). Nothing is asserted
on speed. Runs in well under 2 minutes on one H100/H200.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max (OCP FP8 spec)


def timed(fn, iters: int) -> float:
    """Median seconds of fn() over iters calls, CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def to_e4m3(x: torch.Tensor, dim: int | None):
    """(e4m3 tensor, fp32 dequantization scale): per tensor (dim None) or per slice along dim."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (amax.float() / E4M3_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def one_size(n: int, iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 2 * n**3
    row = {"n": n}
    t = timed(lambda: a @ b, iters)
    row["bf16_tflops"] = flops / t / 1e12
    variants = {
        # scales: a 0-d fp32 scale each
        "fp8_tensorwise": (to_e4m3(a, None), to_e4m3(b, None), lambda sa, sb: (sa.reshape(()), sb.reshape(()))),
        # scales: (n, 1) for the rows of A, (1, n) for the columns of B
        "fp8_rowwise": (to_e4m3(a, 1), to_e4m3(b, 0), lambda sa, sb: (sa.reshape(n, 1), sb.reshape(1, n))),
    }
    for name, ((qa, sa), (qb, sb), shape) in variants.items():
        qb_col = qb.t().contiguous().t()  # _scaled_mm wants B column-major
        sa2, sb2 = shape(sa, sb)
        try:
            mm = lambda: torch._scaled_mm(qa, qb_col, scale_a=sa2, scale_b=sb2, out_dtype=torch.bfloat16)  # noqa: E731
            out = mm()
            t = timed(mm, iters)
        except (RuntimeError, TypeError, NotImplementedError) as e:  # not supported on this torch/GPU
            row[name] = f"unsupported: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        ref = (qa.float() * sa2) @ (qb.float() * sb2)  # the dequantized inputs, multiplied in fp32
        row[f"{name}_tflops"] = flops / t / 1e12
        row[f"{name}_over_bf16"] = row[f"{name}_tflops"] / row["bf16_tflops"]
        row[f"{name}_rel_error_vs_dequantized"] = ((out.float() - ref).norm() / ref.norm()).item()
    return row


def fp8_linear_check() -> dict:
    """FP8Linear on the GPU (torch._scaled_mm forward) against the fp32 matmul of the same
    dequantized values; relative error limited by the bf16/fp32 output rounding and summation order."""
    try:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        from course_lib.techniques.fp8 import FP8Linear, dequantize, quantize
    except ImportError as e:
        return {"skipped": f"course_lib not importable: {e}"}
    out = {}
    for recipe, gran in (("tensorwise", "tensor"), ("rowwise", "row")):
        torch.manual_seed(0)
        lin = FP8Linear(1024, 512, recipe=recipe).cuda()
        x = torch.randn(256, 1024, device="cuda")
        try:
            y = lin(x)
            y.sum().backward()
        except (RuntimeError, TypeError) as e:
            out[recipe] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        qx, sx = quantize(x, "e4m3", gran)
        qw, sw = quantize(lin.weight, "e4m3", gran)
        ref = dequantize(qx, sx, gran) @ dequantize(qw, sw, gran).t() + lin.bias
        out[recipe] = {"rel_error_vs_dequantized": ((y - ref).norm() / ref.norm()).item(),
                       "grad_finite": bool(torch.isfinite(lin.weight.grad).all())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_fp8_matmul.py needs a CUDA GPU (FP8 matmul units); none is visible here.", file=sys.stderr)
        return 2
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        print(f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "torch": torch.__version__, "cuda": torch.version.cuda, "iters": args.iters,
              "sizes": [one_size(n, args.iters) for n in args.sizes], "fp8_linear": fp8_linear_check()}
    text = json.dumps(result, indent=1)
    print(text)
    if os.environ.get("OUT"):
        path = pathlib.Path(os.environ["OUT"]) / "fp8_matmul.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
