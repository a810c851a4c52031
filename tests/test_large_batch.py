"""Large-batch training helpers (course_lib.parallel.dp.large_batch): learning-rate scaling,
warm-up, the gradient-noise scale estimators and the fixed-token-budget trainer."""

import math

import pytest
import torch

from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.dp.large_batch import (gradient_noise_scale, micro_batch_gradients,
                                                noise_scale_from_two_batches, scale_lr, train_at_token_budget,
                                                warmup_factor)
from course_lib.train import TrainConfig, train_reference

torch.set_num_threads(1)


def test_scale_lr_rules():
    assert scale_lr(1e-3, 4, 16, "none") == 1e-3
    # float64 formulas: 1e-3 * 16 / 4 and 4e-3 may round apart by an ulp (approx's default 1e-6)
    assert scale_lr(1e-3, 4, 16, "linear") == pytest.approx(4e-3)
    assert scale_lr(1e-3, 4, 16, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(1e-3, 16, 4, "sqrt") == pytest.approx(5e-4)  # smaller batches scale down
    with pytest.raises(ValueError, match="rule='cubic'"):
        scale_lr(1e-3, 4, 16, "cubic")
    with pytest.raises(ValueError, match="batch=0"):
        scale_lr(1e-3, 4, 0, "linear")


def test_warmup_factor():
    assert [warmup_factor(t, 4) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        warmup_factor(0, -1)


def synthetic_micro_grads(k, b, n=200, seed=0):
    """Rows g_i = G + noise with per-example covariance diag(sigma^2): Cov(g_i) = Sigma / b."""
    gen = torch.Generator().manual_seed(seed)
    G = torch.randn(n, generator=gen, dtype=torch.float64) * 0.1
    sigma = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
    rows = G + torch.randn(k, n, generator=gen, dtype=torch.float64) * sigma / math.sqrt(b)
    return rows, (G @ G).item(), (sigma**2).sum().item()


def test_gradient_noise_scale_recovers_known_statistics():
    # Statistical tolerances on seeded float64 data (the same numbers on every CPU: randn in float64
    # is the scalar path): the estimators' sampling errors, measured -0.4 % (trace), -1.4 % (B_simple),
    # -2.8 % and -0.01 % (the k = 4 averages), are each a few standard errors; the bounds sit above
    # them, and below a biased estimator's ~4x.
    rows, grad_sq, trace = synthetic_micro_grads(k=4000, b=8)
    est = gradient_noise_scale(rows, micro_batch=8)
    assert est.trace_cov == pytest.approx(trace, rel=0.02)
    assert est.b_simple == pytest.approx(trace / grad_sq, rel=0.06)
    # Unbiased with only k = 4 micro-batches: |g_mean|^2 alone would be ~ 4x too large here.
    rows, grad_sq, trace = synthetic_micro_grads(k=4 * 2000, b=8, seed=1)
    small = [gradient_noise_scale(r, micro_batch=8) for r in rows.view(2000, 4, -1)]
    assert sum(e.grad_sq for e in small) / len(small) == pytest.approx(grad_sq, rel=0.1)
    assert sum(e.trace_cov for e in small) / len(small) == pytest.approx(trace, rel=0.03)
    with pytest.raises(ValueError, match="k >= 2"):
        gradient_noise_scale(rows[:1], 8)


def test_two_batch_estimate_inverts_the_expectation():
    """E|G_B|^2 = |G|^2 + tr(Sigma)/B: feeding the exact expectations gives back G and Sigma."""
    grad_sq, trace = 0.7, 30.0
    est = noise_scale_from_two_batches(grad_sq + trace / 4, grad_sq + trace / 32, 4, 32)
    # exact expectations in, float64 formulas out: rounding only (approx's default 1e-6)
    assert est.grad_sq == pytest.approx(grad_sq) and est.trace_cov == pytest.approx(trace)
    assert est.b_simple == pytest.approx(trace / grad_sq)
    with pytest.raises(ValueError, match="b_small"):
        noise_scale_from_two_batches(1.0, 0.5, 8, 8)


def test_micro_batch_gradients_are_the_batches_gradients():
    ds = CharDataset("train")
    model = GPT(GPTConfig.tiny(ds.vocab_size))
    rows = micro_batch_gradients(model, ds, 2, 3, torch.Generator().manual_seed(5))
    assert rows.shape == (3, model.num_params())
    gen = torch.Generator().manual_seed(5)
    for row in rows:  # same generator -> same batches, in order
        x, y = get_batch(ds, 2, gen)
        model.zero_grad()
        model(x, y)[1].backward()
        assert torch.equal(row, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # the same arithmetic


def test_token_budget_run_is_the_reference_loop():
    """No scaling, no warm-up: the reference trainer's losses, step for step."""
    ds = CharDataset("train")
    cfg = GPTConfig.tiny(ds.vocab_size)
    res = train_at_token_budget(cfg, 4, 4 * 64 * 5, 2e-3, 4, eval_batches=1)
    ref = train_reference(cfg, TrainConfig(steps=5, batch_size=4, lr=2e-3, eval_every=10**6, eval_batches=1,
                                           progress=False))
    assert res.train_losses == ref.train_losses
    assert res.val_losses[0][0] == 5
    scaled = train_at_token_budget(cfg, 16, 16 * 64 * 2, 2e-3, 4, rule="linear", warmup_steps=2, eval_batches=1)
    assert len(scaled.train_losses) == 2
    with pytest.raises(ValueError, match="tokens=10"):
        train_at_token_budget(cfg, 4, 10, 1e-3, 4)
