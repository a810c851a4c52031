"""Tests for course_lib.train: the reference trainer everything else is checked against."""

import math

import pytest
import torch

from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT, GPTConfig
from course_lib.train import (
    TrainConfig,
    evaluate,
    make_optimizer,
    plot_losses,
    smooth,
    train_reference,
    train_step,
)


def test_optimizer_groups_decay_only_matrices(vocab_size):
    model = GPT(GPTConfig.tiny(vocab_size))
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert any(p is model.tok_emb.weight for p in decay["params"])
    # Every parameter exactly once (the tied head/embedding is not duplicated).
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == model.num_params()


def test_train_step_clips_and_updates(vocab_size):
    model = GPT(GPTConfig.tiny(vocab_size), seed=0)
    opt = make_optimizer(model, TrainConfig())
    x, y = get_batch(CharDataset("train"), 4, torch.Generator().manual_seed(0))
    before = model.blocks[0].mlp.fc.weight.clone()
    loss = train_step(model, opt, x, y, grad_clip=1e-3)
    assert isinstance(loss, float) and loss > 0
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    # gradients were clipped to the limit: clip_grad_norm_ scales by max_norm / (norm + 1e-6), so the
    # new norm is short by 1e-6 / norm relative (norm ~1 here), plus the fp32 rounding of the norms
    assert norm.item() == pytest.approx(1e-3, rel=1e-4)
    assert not torch.equal(before, model.blocks[0].mlp.fc.weight)


def test_training_reduces_val_loss(vocab_size):
    cfg = TrainConfig(steps=150, batch_size=16, eval_every=75, eval_batches=4, progress=False)
    result = train_reference(GPTConfig.tiny(vocab_size), cfg)
    assert len(result.train_losses) == 150
    assert [s for s, _ in result.val_losses] == [0, 75, 150]
    first, last = result.val_losses[0][1], result.val_losses[-1][1]
    assert last < 0.85 * first  # learning, not rounding: 150 steps take the val loss far below 0.85x
    # measured wall time: only its type and finiteness, >= 0 (a monotonic-clock duration)
    assert isinstance(result.seconds, float) and math.isfinite(result.seconds) and result.seconds >= 0


def test_same_seed_same_losses(vocab_size):
    cfg = TrainConfig(steps=6, batch_size=8, eval_every=3, eval_batches=2, progress=False)
    a = train_reference(GPTConfig.tiny(vocab_size), cfg)
    b = train_reference(GPTConfig.tiny(vocab_size), cfg)
    assert a.train_losses == b.train_losses  # bit-identical, not just close
    assert a.val_losses == b.val_losses
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    c = train_reference(GPTConfig.tiny(vocab_size), TrainConfig(**{**cfg.__dict__, "seed": 1}))
    assert c.train_losses != a.train_losses


def test_evaluate_deterministic_and_restores_mode(vocab_size):
    model = GPT(GPTConfig.tiny(vocab_size, dropout=0.1))
    ds = CharDataset("val")
    model.train()
    a = evaluate(model, ds, 2, 4, torch.Generator().manual_seed(0))
    b = evaluate(model, ds, 2, 4, torch.Generator().manual_seed(0))
    assert a == b and model.training  # dropout off during eval, mode restored after


def test_vocab_mismatch_is_reported():
    with pytest.raises(ValueError, match="vocab_size"):
        train_reference(GPTConfig.tiny(vocab_size=10), TrainConfig(steps=1, progress=False))


def test_smooth_and_plot():
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected (float64 rounding only)
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.train import TrainResult

    result = TrainResult(model=None, train_losses=[3.0, 2.5, 2.0], val_losses=[(0, 3.1), (3, 2.1)])
    ax = plot_losses(result, label="ref")
    assert len(ax.lines) == 3 and ax.get_xlabel() == "step"


def test_train_step_hooks_run_in_order(vocab_size):
    """The shared step: micro-batches under no_sync but the last, then sync, clip, step."""
    import contextlib

    model = GPT(GPTConfig.tiny(vocab_size, n_layer=1), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = get_batch(CharDataset("train"), 4, torch.Generator().manual_seed(0))
    calls = []

    @contextlib.contextmanager
    def no_sync():
        calls.append("no_sync")
        yield

    def loss_fn(m, xb, yb):
        calls.append(f"loss{len(xb)}")
        return m(xb, yb)[1]

    loss = train_step(model, opt, x, y, 1.0, accum_steps=2, loss_fn=loss_fn, no_sync=no_sync,
                      sync_gradients=lambda: calls.append("sync"),
                      clip_grad_norm=lambda c: calls.append(f"clip{c}"))
    assert calls == ["no_sync", "loss2", "loss2", "sync", "clip1.0"]
    assert isinstance(loss, float)
    calls.clear()
    train_step(model, opt, x, y, None, forward_backward=lambda m, xb, yb: calls.append("fb") or 1.5)
    assert calls == ["fb"]
