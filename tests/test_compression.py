"""Tests for course_lib.parallel.dp.compression: low-precision and top-k (+ error feedback) hooks."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import CommTracer, run_on_ranks
from course_lib.data import CharDataset
from course_lib.model import GPTConfig
from course_lib.parallel import LowPrecisionHook, TopKHook
from course_lib.parallel.dp.compression import topk_count
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.runtime.device import rank_device
from course_lib.train import TrainConfig

from _tolerances import FP32_EPS, rms

cloudpickle.register_pickle_by_value(sys.modules[__name__])
torch.set_num_threads(1)

N_ELEMS, WORLD = 1000, 2


def grad(rank, step=0):
    """The gradient rank `rank` contributes at `step` (already divided by N), reproducible anywhere."""
    return torch.randn(N_ELEMS, generator=torch.Generator().manual_seed(100 * step + rank)) / WORLD


def topk_dense(x, k):
    out = torch.zeros_like(x)
    idx = x.abs().topk(k).indices
    out[idx] = x[idx]
    return out


def _hooks():
    rank, out = dist.get_rank(), {}
    for name, hook in [("bf16", LowPrecisionHook()), ("fp16", LowPrecisionHook(torch.float16)),
                       ("top1", TopKHook(1.0, error_feedback=False)), ("top5", TopKHook(0.05, error_feedback=False))]:
        with CommTracer() as tr:
            out[name] = hook(0, grad(rank).clone().to(rank_device()), None).wait()  # NCCL: on the rank's device
        out[name + "_comm"] = tr.summary()
    for ef in (True, False):  # 20 steps of top-5% on fresh gradients
        hook, sent = TopKHook(0.05, error_feedback=ef), torch.zeros(N_ELEMS)
        for step in range(20):
            sent += hook(0, grad(rank, step).clone().to(rank_device()), None).wait()
        out[f"sent_ef={ef}"] = sent
        out[f"residual_ef={ef}"] = hook.residuals.get(0, torch.zeros(N_ELEMS))
    return out


def test_compression_hooks():
    res = run_on_ranks(_hooks, world_size=WORLD, timeout_s=60)
    exact = grad(0) + grad(1)
    magnitude = grad(0).abs() + grad(1).abs()
    k = topk_count(N_ELEMS, 0.05)
    for r in res:
        # Each rank's gradient rounded to 16 bits (unit roundoff u), then their sum rounded again:
        # |error| <= u * (|a| + |b|) + u * |a + b| <= 2u (|a| + |b|), element by element, plus the
        # fp32 rounding of `exact` itself and, for fp16, half the subnormal spacing (2^-25) twice.
        for name, dtype, subnormal in (("bf16", torch.bfloat16, 0.0), ("fp16", torch.float16, 2.0**-24)):
            u = torch.finfo(dtype).eps / 2  # 2^-8 for bf16, 2^-11 for fp16
            bound = (2 * u * (1 + u) + FP32_EPS) * magnitude + subnormal
            assert ((r[name] - exact).abs() <= bound).all(), name
        assert not torch.equal(r["bf16"], exact)  # it is lossy
        assert r["bf16_comm"]["all_reduce"]["bytes_sent"] == 2 * N_ELEMS  # half of fp32's 4 bytes
        assert r["fp16_comm"]["all_reduce"]["bytes_sent"] == 2 * N_ELEMS
        # keeping everything (or the same top 5 %) is exact: a sum of two fp32 terms is the same
        # bits in either order
        assert torch.equal(r["top1"], exact)
        assert torch.equal(r["top5"], topk_dense(grad(0), k) + topk_dense(grad(1), k))
        gathered = r["top5_comm"]["all_gather_single"]
        assert gathered["calls"] == 2  # values and indices
        assert gathered["bytes_sent"] == 8 * k and gathered["bytes_recv"] == 8 * k * WORLD
        # Error feedback loses nothing: everything sent + what every rank still holds back
        # = the sum of all gradients. Without it the dropped part is gone for good.
        total = sum(grad(rr, s) for rr in range(WORLD) for s in range(20))
        all_residuals = res[0]["residual_ef=True"] + res[1]["residual_ef=True"]
        # the same 40 fp32 terms summed in two orders: each within (40 - 1) eps sum|terms| of the
        # exact sum (measured: < 1 eps sum|terms|)
        bound = 2 * 39 * FP32_EPS * sum(grad(rr, s).abs() for rr in range(WORLD) for s in range(20))
        assert ((r["sent_ef=True"] + all_residuals - total).abs() <= bound).all()
        assert (r["sent_ef=False"] - total).abs().max() > 1.0  # not a tolerance: the dropped part, ~N(0, 1)


def test_bad_compression_settings():
    for ratio in (0, -0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="ratio"):
            TopKHook(ratio)
    with pytest.raises(ValueError, match="dtype"):
        LowPrecisionHook(torch.float32)


def _short_runs(config, cfg):
    return {name: train_data_parallel(config, cfg, "ddp", 1, comm_hook=hook)
            for name, hook in [("fp32", None), ("bf16", LowPrecisionHook()), ("topk", TopKHook(0.01))]}


def test_ddp_with_compression_keeps_replicas_equal():
    config = GPTConfig.tiny(CharDataset("train").vocab_size)
    res = run_on_ranks(_short_runs, config, TrainConfig(steps=3, batch_size=8, progress=False), world_size=WORLD,
                       timeout_s=60)
    for name in ("fp32", "bf16", "topk"):
        assert torch.equal(res[0][name].final_params, res[1][name].final_params)  # every rank decoded the same sum
    # bf16 changes the gradients a little, top-1% a lot; neither is the fp32 result. In RMS over
    # the parameters, not the largest element: AdamW turns a gradient whose sign bf16 rounding
    # flipped into a move of ~2 lr, as large as a missing update (measured after 3 steps: largest
    # 1.0 lr vs 4.1 lr, RMS 0.02 lr vs 2.0 lr).
    d_bf16 = rms(res[0]["bf16"].final_params - res[0]["fp32"].final_params)
    d_topk = rms(res[0]["topk"].final_params - res[0]["fp32"].final_params)
    assert 0 < d_bf16 < d_topk
