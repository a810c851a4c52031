"""What CPU ranks cannot show, on one CUDA GPU: the course's NCCL path at world size 1, CUDA
memory against the estimator, and a GPT training step's MFU against the GPU's spec peak.

    python benchmarks/gpu_check.py [--out results.json]

1. NCCL at world size 1: run_hybrid(ParallelDims(), ..., backend="nccl") (run_on_ranks' default
   is gloo) puts the rank on its own GPU (course_lib.runtime.device); its losses must equal the
   single process's on the CPU within course_lib.tolerances.adamw_loss_atol (fp32 on both: only the order of sums
   and the kernels differ), in fp32 and with recomputation.
2. CUDA memory: one AdamW step of a GPT on the GPU; torch.cuda.memory_allocated() after the step,
   less what was allocated before the model (cuBLAS's workspace: it comes from the same
   allocator), is parameters + gradients + AdamW moments (the batch freed) against the estimator's fp32 model
   state (course_lib.estimate.per_gpu_memory): equal up to the allocator's 512-byte rounding
   per tensor.
3. MFU: steady-state bf16-autocast training steps of a GPT large enough to keep the GPU busy;
   model FLOPs (course_lib.estimate.flops_per_token, notebook 01) per second over the spec
   peak of course_lib.estimate.calculator.GPUS; and a bare 8192^3 bf16 matmul for scale.
4. FP8 matmuls (notebook 04): torch._scaled_mm on e4m3 inputs with one scale per tensor and
   one per row/column, bf16 out, against bf16 matmuls of the same n x n x n shapes.

Exits 2 without CUDA (this check is for a GPU machine; CI has none).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course_lib.capstone.report import gpu_peak_flops  # noqa: E402
from course_lib.data import CharDataset  # noqa: E402
from course_lib.dims import ParallelDims  # noqa: E402
from course_lib.estimate import flops_per_token, per_gpu_memory  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.parallel.hybrid import run_hybrid, train_single  # noqa: E402
from course_lib.tolerances import adamw_loss_atol  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402


def nccl_world_one() -> dict:
    seq = 32
    cfg = GPTConfig(vocab_size=CharDataset("train", seq).vocab_size, block_size=seq, n_layer=2, n_head=2, d_model=32)
    train = TrainConfig(steps=4, batch_size=8, lr=1e-2, progress=False)
    out = {}
    for recompute in ("none", "full"):
        ranks = run_hybrid(ParallelDims(recompute=recompute), cfg, train, timeout_s=300, backend="nccl")
        single = train_single(cfg, train, recompute=recompute).train_losses
        gpu = ranks[0].train_losses
        worst = max(abs(a - b) for a, b in zip(gpu, single))
        out[f"recompute={recompute}"] = {"gpu_losses": gpu, "cpu_losses": single, "max_abs_diff": worst,
                                         "tolerance": adamw_loss_atol(train.lr),
                                         "equal": worst <= adamw_loss_atol(train.lr)}
    return out


def cuda_memory() -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, block_size=256, n_layer=4, n_head=8, d_model=512)
    dev = torch.device("cuda")
    # cuBLAS takes its workspace from the same allocator on first use: take it before the baseline
    w = torch.randn(512, 512, device=dev, requires_grad=True)
    (w @ w).sum().backward()
    del w
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = GPT(cfg, seed=0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), device=dev)
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    del x, loss
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - base
    est = per_gpu_memory(cfg, 4, cfg.block_size, "fp32")
    state = est["params"] + est["grads"] + est["optimizer"]
    tensors = 4 * sum(1 for _ in model.parameters())  # each parameter: itself, .grad, exp_avg, exp_avg_sq
    return {"allocated_bytes": allocated, "estimated_state_bytes": state, "tensors": tensors,
            "difference": allocated - state, "allocator_rounding_bound": 512 * tensors,
            "within_rounding": 0 <= allocated - state <= 512 * tensors + 4096}  # + AdamW's step counters


def timed(fn, warmup=3, reps=10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def mfu() -> dict:
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    matmul_s = timed(lambda: a @ b)
    del a, b
    cfg = GPTConfig(vocab_size=32768, block_size=2048, n_layer=12, n_head=16, d_model=2048, attn_impl="fused",
                    bias=False)
    model = GPT(cfg, seed=0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = 8
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        opt.step()

    step_s = timed(step, warmup=3, reps=10)
    tokens = batch * cfg.block_size
    model_flops = flops_per_token(cfg, cfg.block_size, causal=True) * tokens
    peak = gpu_peak_flops("bf16")
    return {"gpu": torch.cuda.get_device_name(), "spec_peak_bf16": peak,
            "matmul_8192_bf16_tflops": 2 * 8192**3 / matmul_s / 1e12,
            "gpt": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "seq": cfg.block_size, "batch": batch,
                    "params": model.num_params() if hasattr(model, "num_params") else None,
                    "step_s": step_s, "tokens_per_s": tokens / step_s,
                    "model_tflops": model_flops / step_s / 1e12,
                    "mfu": model_flops / step_s / peak if peak else None},
            "torch": torch.__version__}


def fp8_matmul() -> dict:
    """TFLOP/s of bf16 and of scaled e4m3 matmuls (2 n^3 FLOPs each), n x n x n."""
    dev, out = torch.device("cuda"), {}
    for n in (4096, 8192, 16384):
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        row = {"bf16": 2 * n**3 / timed(lambda: a @ b) / 1e12}
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # _scaled_mm wants the second operand column-major
        one = torch.tensor(1.0, device=dev)
        scales = {"tensorwise": (one, one),
                  "rowwise": (torch.ones(n, 1, device=dev), torch.ones(1, n, device=dev))}
        for name, (sa, sb) in scales.items():
            try:
                row[f"fp8_{name}"] = 2 * n**3 / timed(
                    lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)) / 1e12
            except (RuntimeError, TypeError) as err:  # not every torch/GPU pair has every scaling
                row[f"fp8_{name}"] = f"unsupported: {str(err).splitlines()[0][:200]}"
        out[str(n)] = row
        del a, b, a8, b8
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this check runs on a GPU machine", file=sys.stderr)
        sys.exit(2)
    result = {}
    for name, fn in (("fp8_matmul", fp8_matmul), ("mfu", mfu), ("cuda_memory", cuda_memory),
                     ("nccl_world_size_1", nccl_world_one)):
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as err:  # report and go on: each part is independent
            result[name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
        torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
