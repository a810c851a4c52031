"""Dynamic loss scaling and fp32 master weights (course_lib.techniques.amp)."""

import pytest
import torch

from course_lib.techniques.amp import DynamicLossScaler, MixedPrecisionOptimizer, found_inf, update_scale
from course_lib.observe.memory import measured_state_bytes
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, make_optimizer

# growth every 3 good steps; infs injected at steps 5, 9, 10 (and a nan at 14)
FLAGS = [False] * 5 + [True] + [False] * 3 + [True, True] + [False] * 3 + ["nan"] + [False] * 7


def _grad(scale, flag):
    g = torch.full((6,), 1e-3) * scale
    if flag == "nan":
        g[2] = float("nan")
    elif flag:
        g[4] = float("inf")
    return g


def test_update_rule_by_hand():
    s, n = 8.0, 0
    s, n = update_scale(s, n, False, 2.0, 0.5, 2)
    assert (s, n) == (8.0, 1)
    s, n = update_scale(s, n, False, 2.0, 0.5, 2)
    assert (s, n) == (16.0, 0)  # growth after growth_interval good steps, counter reset
    s, n = update_scale(s, 1, True, 2.0, 0.5, 2)
    assert (s, n) == (8.0, 0)  # overflow halves and resets the counter


def test_same_trajectory_and_skips_as_torch_gradscaler():
    if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler (device-generic, works on CPU) needs torch >= 2.3")
    try:
        ref = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    except Exception as exc:  # pragma: no cover - old torch without a CPU GradScaler
        pytest.skip(f"no CPU GradScaler in this torch: {exc}")
    mine = DynamicLossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(6))
    q = torch.nn.Parameter(torch.ones(6))
    opt_ref, opt_mine = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
    ref_traj, ref_skips, mine_skips = [], [], []
    for flag in FLAGS:
        ref.scale(torch.tensor(1.0))  # GradScaler creates its scale tensor lazily here
        ref_traj.append(ref.get_scale())
        before = p.detach().clone()
        p.grad = _grad(ref.get_scale(), flag)
        ref.step(opt_ref)
        ref.update()
        ref_skips.append(torch.equal(before, p.detach()))
        q.grad = _grad(mine.scale, flag)
        mine_skips.append(not mine.step(opt_mine))
    assert [s for s, _ in mine.history] == ref_traj
    assert mine_skips == ref_skips == [bool(f) for f in FLAGS]
    assert mine.scale == ref.get_scale()
    assert torch.equal(p, q)  # the steps taken are the same steps
    assert len(set(ref_traj)) > 2  # the sequence both grows and shrinks the scale


def test_unscale_and_found_inf():
    s = DynamicLossScaler(init_scale=1024.0)
    g = torch.tensor([1024.0, -2048.0])
    assert s.unscale_([g]) is False and g.tolist() == [1.0, -2.0]
    assert found_inf([torch.tensor([1.0, float("nan")])]) and not found_inf([torch.zeros(3), None])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 0},
        {"init_scale": float("inf")},
        {"growth_factor": 1.0},
        {"growth_factor": 0.5},
        {"backoff_factor": 1.0},
        {"backoff_factor": 0.0},
        {"growth_interval": 0},
        {"growth_interval": 2.5},
    ],
)
def test_invalid_scaler_arguments(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)


def _batch(vocab=40, batch=2, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def test_master_weights_keep_small_updates_that_bf16_loses():
    cfg = GPTConfig.tiny(40, n_layer=1, d_model=16, n_head=2)
    model = GPT(cfg)
    tc = TrainConfig(lr=1e-3, weight_decay=0.0)
    mp = MixedPrecisionOptimizer(model, lambda m: make_optimizer(m, tc), dtype=torch.bfloat16)
    x, y = _batch()
    w0 = mp.masters[0].detach().clone()
    for _ in range(3):
        mp.backward(model(x, y)[1])
        assert mp.step()
    # AdamW moves an element by ~lr per step where |g| >> 1e-8, in the gradient's direction, which
    # the same batch keeps: the largest move is ~3 * lr = 3e-3 (not a float tolerance: > 2e-3
    # fails only if the master did not take the three updates); the bf16 model is the rounded master
    assert (mp.masters[0] - w0).abs().max() > 2e-3
    for p, m in zip(model.parameters(), mp.masters):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))


def test_fp16_with_scaler_tracks_fp32_training_and_skips_overflow():
    cfg = GPTConfig.tiny(40, n_layer=1, d_model=16, n_head=2)
    ref = GPT(cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)  # SGD: the update is the gradient itself
    model = GPT(cfg)
    scaler = DynamicLossScaler(init_scale=2.0**24, growth_interval=100)  # too large: must back off
    mp = MixedPrecisionOptimizer(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.5), dtype=torch.float16, loss_scaler=scaler)
    x, y = _batch()
    w0 = [m.detach().clone() for m in mp.masters]
    stepped = []
    for _ in range(12):
        opt.zero_grad()
        ref(x, y)[1].backward()
        mp.backward(model(x, y)[1])
        stepped.append(mp.step())
        if len(stepped) == 1:
            assert all(torch.equal(a, b) for a, b in zip(w0, mp.masters))  # skipped: untouched
        if stepped[-1]:
            opt.step()
    assert stepped[0] is False and stepped[-1] is True  # overflow first, then a safe scale
    assert scaler.scale < 2.0**24
    moved = max((p - w).abs().max().item() for p, w in zip(ref.parameters(), w0))
    worst = max((p - m).abs().max().item() for p, m in zip(ref.parameters(), mp.masters))
    # fp16 rounds each activation and gradient to 2^-11 relative; through a forward, a backward and
    # ~11 SGD steps the update drifts by ~0.2 % of how far training moved (measured 0.002);
    # 0.05 ~ 100 * 2^-11. A skipped step taken, or a step lost, moves it by ~10 %.
    assert worst < 0.05 * moved


def _measured_state(recipe):
    """Build the real objects of a recipe, run two steps, measure (gradients present)."""
    model = GPT(GPTConfig.tiny(40, n_layer=1))
    x, y = _batch()
    if recipe == "fp32":
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(x, y)[1].backward()
            opt.step()
        return model, measured_state_bytes(model, opt)
    dtype = torch.float16 if recipe == "fp16_mixed" else torch.bfloat16
    scaler = DynamicLossScaler(init_scale=1.0) if recipe == "fp16_mixed" else None
    mp = MixedPrecisionOptimizer(model, lambda m: torch.optim.AdamW(m.parameters()), dtype=dtype,
                                 loss_scaler=scaler, fp32_grad_accum=recipe == "bf16_fp32_accum")
    mp.backward(model(x, y)[1])
    mp.step()
    mp.backward(model(x, y)[1])
    got = measured_state_bytes(model, mp)
    fp32_buffers = sum(g.untyped_storage().nbytes() for g in mp.fp32_grads)
    got["grads"] += fp32_buffers  # the fp32 accumulation buffers are gradient memory
    got["total"] += fp32_buffers
    return model, got


@pytest.mark.parametrize("recipe", ["fp32", "bf16_mixed", "fp16_mixed", "bf16_fp32_accum"])
def test_bytes_per_parameter_equal_notebook_01_formula(recipe):
    estimate = pytest.importorskip("course_lib.estimate")
    model, got = _measured_state(recipe)
    assert got == estimate.model_state_bytes(model.num_params(), recipe)


def test_fp32_grad_accum_sums_micro_batches_in_fp32():
    cfg = GPTConfig.tiny(40, n_layer=1, d_model=16, n_head=2)
    ref = GPT(cfg)
    model = GPT(cfg)
    twin = GPT(cfg).to(torch.bfloat16)  # the same bf16 model, without the optimizer's hooks
    mp = MixedPrecisionOptimizer(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.0), dtype=torch.bfloat16, fp32_grad_accum=True)
    (x1, y1), (x2, y2) = _batch(seed=1), _batch(seed=2)
    mp.backward(model(x1, y1)[1])
    mp.backward(model(x2, y2)[1])
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())  # 16-bit grads zeroed after adding
    # Each micro-batch's bf16 gradient is the twin's (the same arithmetic), and the buffer holds
    # their sum taken in fp32: bit for bit. Summed in bf16 it would lose the low bits.
    micro = []
    for x, y in ((x1, y1), (x2, y2)):
        twin.zero_grad(set_to_none=True)
        twin(x, y)[1].backward()
        micro.append([p.grad.to(torch.float32) for p in twin.parameters()])
    for m, g1, g2 in zip(mp.masters, *micro):
        assert torch.equal(m.grad, g1 + g2)
    # and that sum is the gradient of the summed loss, to bf16 precision: activations and
    # gradients rounded to 2^-8 relative along the way (measured <= 0.6 % of the norm over the
    # whole model, <= 1.5 % for the smallest tensors); 8 * 2^-8 = 3 % of the whole model's norm
    (ref(x1, y1)[1] + ref(x2, y2)[1]).backward()
    got, want = (torch.cat([t.grad.reshape(-1) for t in ps]) for ps in (mp.masters, list(ref.parameters())))
    assert ((got - want).norm() / want.norm()).item() < 8 * 2.0**-8
    mp.step()
    assert all(m.grad.abs().sum() == 0 for m in mp.masters)  # buffers zeroed for the next step


def test_mixed_precision_rejects_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        MixedPrecisionOptimizer(GPT(GPTConfig.tiny(40)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), dtype=torch.float32)
    half = GPT(GPTConfig.tiny(40)).half()
    with pytest.raises(ValueError, match="fp32"):
        MixedPrecisionOptimizer(half, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
