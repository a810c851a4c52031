"""Gradient accumulation (course_lib.techniques.accumulation)."""

import pytest
import torch

from course_lib.techniques.accumulation import accumulate_gradients, split_micro_batches
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, make_optimizer, train_step

from _tolerances import (FP32_EPS, adamw_loss_atol, assert_adamw_params_close, assert_close_fp32_sums,
                         assert_grads_close_after_adamw, fp32_sum_atol)

V = 40
CFG = GPTConfig.tiny(V, n_layer=2, d_model=32)


def _batch(batch=8, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, seq), generator=g), torch.randint(0, V, (batch, seq), generator=g)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_k_micro_batches_equal_one_big_batch(k):
    x, y = _batch()
    ref = GPT(CFG)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    model = GPT(CFG)
    res = accumulate_gradients(model, x, y, k)
    # fp32: k means of 128/k token losses, averaged, vs one mean of 128 (and matmuls blocked by
    # another batch size): a few ulps; 1e-5 is ~80 ulps. A loss not divided by k is k times off.
    assert res.loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_fp32_sums(p.grad, q.grad)  # the token sums in another grouping: fp32 rounding
    # one SGD step at lr 1: p - g moves by the gradients' difference (bounded just above) plus
    # the subtraction's own rounding (half an ulp of p: 2 * eps relative covers it)
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=1.0).step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2 * FP32_EPS, atol=fp32_sum_atol(q.grad))


def test_accumulated_train_step_matches_train_step_with_adamw_and_clipping():
    x, y = _batch()
    cfg = TrainConfig(lr=1e-3)
    ref, model = GPT(CFG), GPT(CFG)
    ref_opt, opt = make_optimizer(ref, cfg), make_optimizer(model, cfg)
    for step in range(2):
        l_ref = train_step(ref, ref_opt, x, y, grad_clip=1.0)
        l_acc = train_step(model, opt, x, y, grad_clip=1.0, accum_steps=4)
        # train_step leaves this step's clipped gradients (taken before its optimizer step) in .grad
        got, want = (torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (model, ref))
        if step == 0:  # the same parameters: fp32 sums in another grouping only
            assert l_acc == pytest.approx(l_ref, rel=1e-5)  # ~80 ulps, as in the test above
            assert_close_fp32_sums(got, want)
        else:  # after an AdamW step, which magnifies rounding near g = 0 (see _tolerances)
            assert l_acc == pytest.approx(l_ref, abs=adamw_loss_atol(cfg.lr))
            assert_grads_close_after_adamw(got, want)
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (model, ref)]
    assert_adamw_params_close(*flat, lr=cfg.lr, steps=2, betas=cfg.betas)


def test_activation_memory_is_flat_as_accumulation_grows():
    micro = 2
    per_micro, totals = [], []
    for k in (1, 2, 4):
        x, y = _batch(batch=micro * k)  # effective batch grows with k
        res = accumulate_gradients(GPT(CFG), x, y, k, measure=True)
        assert len(res.micro_batch_saved_bytes) == k
        per_micro.append(max(res.micro_batch_saved_bytes))
        totals.append(sum(res.micro_batch_saved_bytes))
    assert per_micro[0] == per_micro[1] == per_micro[2]
    assert totals[2] == 4 * totals[0]  # what one big batch would have held at once


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_accum_steps_rejected(bad):
    x, y = _batch()
    with pytest.raises(ValueError, match="accum_steps"):
        accumulate_gradients(GPT(CFG), x, y, bad)


def test_indivisible_batch_rejected_before_any_work():
    x, y = _batch(batch=6)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="divisible"):
        train_step(model, opt, x, y, accum_steps=4)
    assert all(p.grad is None for p in model.parameters())
    assert len(split_micro_batches(x, y, 3)) == 3
