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
from course_lib.train import TrainConfig

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
            out[name] = hook(0, grad(rank).clone(), None).wait()
        out[name + "_comm"] = tr.summary()
    for ef in (True, False):  # 20 steps of top-5% on fresh gradients
        hook, sent = TopKHook(0.05, error_feedback=ef), torch.zeros(N_ELEMS)
        for step in range(20):
            sent += hook(0, grad(rank, step).clone(), None).wait()
        out[f"sent_ef={ef}"] = sent
        out[f"residual_ef={ef}"] = hook.residuals.get(0, torch.zeros(N_ELEMS))
    return out


def test_compression_hooks():
    res = run_on_ranks(_hooks, world_size=WORLD, timeout_s=60)
    exact = grad(0) + grad(1)
    k = topk_count(N_ELEMS, 0.05)
    for r in res:
        torch.testing.assert_close(r["bf16"], exact, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r["fp16"], exact, rtol=2e-3, atol=2e-3)
        assert not torch.equal(r["bf16"], exact)  # it is lossy
        assert r["bf16_comm"]["all_reduce"]["bytes_sent"] == 2 * N_ELEMS  # half of fp32's 4 bytes
        assert r["fp16_comm"]["all_reduce"]["bytes_sent"] == 2 * N_ELEMS
        torch.testing.assert_close(r["top1"], exact)  # keeping everything is exact
        torch.testing.assert_close(r["top5"], topk_dense(grad(0), k) + topk_dense(grad(1), k))
        gathered = r["top5_comm"]["all_gather_single"]
        assert gathered["calls"] == 2  # values and indices
        assert gathered["bytes_sent"] == 8 * k and gathered["bytes_recv"] == 8 * k * WORLD
        # Error feedback loses nothing: everything sent + what every rank still holds back
        # = the sum of all gradients. Without it the dropped part is gone for good.
        total = sum(grad(rr, s) for rr in range(WORLD) for s in range(20))
        all_residuals = res[0]["residual_ef=True"] + res[1]["residual_ef=True"]
        torch.testing.assert_close(r["sent_ef=True"] + all_residuals, total, rtol=1e-4, atol=1e-4)
        assert (r["sent_ef=False"] - total).abs().max() > 1.0


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
    # bf16 changes the gradients a little, top-1% a lot; neither is the fp32 result.
    d_bf16 = (res[0]["bf16"].final_params - res[0]["fp32"].final_params).abs().max()
    d_topk = (res[0]["topk"].final_params - res[0]["fp32"].final_params).abs().max()
    assert 0 < d_bf16 < d_topk
