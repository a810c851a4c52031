"""Activation checkpointing of every k blocks (course_lib.techniques.activation_checkpointing)."""

import pytest
import torch

from course_lib.techniques.activation_checkpointing import (
    Chain,
    CheckpointedGPT,
    best_every_k,
    checkpoint_memory,
    checkpointed_forward,
    segments,
)
from course_lib.observe.memory import SavedActivations
from course_lib.model import GPT, GPTConfig

V = 40


def _batch(batch=2, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, seq), generator=g), torch.randint(0, V, (batch, seq), generator=g)


def _grads(model, fwd):
    model.zero_grad(set_to_none=True)
    logits, loss = fwd()
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("every_k", [1, 2, 3])
def test_gradients_identical_with_and_without_checkpointing(every_k):
    model = GPT(GPTConfig.tiny(V, n_layer=3, d_model=32))
    x, y = _batch()
    ref_logits, ref_loss, ref = _grads(model, lambda: model(x, y))
    logits, loss, got = _grads(model, lambda: checkpointed_forward(model, x, y, every_k))
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))  # recompute is the same arithmetic


def test_dropout_is_replayed_in_recompute():
    model = GPT(GPTConfig.tiny(V, n_layer=2, d_model=32, dropout=0.2))
    x, y = _batch()
    torch.manual_seed(5)
    _, _, ref = _grads(model, lambda: model(x, y))
    torch.manual_seed(5)
    _, _, got = _grads(model, lambda: CheckpointedGPT(model, 1)(x, y))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_saved_bytes_shrink_by_the_boundary_count():
    cfg = GPTConfig.tiny(V, n_layer=4, d_model=32)
    model = GPT(cfg)
    x, y = _batch(batch=2, seq=16)
    boundary = 2 * 16 * 32 * 4  # one (B, T, d) fp32 tensor per segment input
    with SavedActivations(model) as plain:
        model(x, y)
    saved = {}
    for k in (1, 2, 4):
        with SavedActivations(model) as s:
            checkpointed_forward(model, x, y, k)
        saved[k] = s.bytes
    assert saved[4] < saved[2] < saved[1] < plain.bytes / 4
    # going from k to 2k removes exactly half of the segment inputs
    assert saved[1] - saved[2] == 2 * boundary and saved[2] - saved[4] == boundary


def test_segments_and_memory_model():
    assert [list(r) for r in segments(5, 2)] == [[0, 1], [2, 3], [4]]
    m = checkpoint_memory(16, 4, per_layer_bytes=3.0, boundary_bytes=1.0)
    assert m == {"kept": 4.0, "recompute": 12.0, "peak": 16.0}
    assert best_every_k(16, 1.0, 1.0) == 4  # a ~ b: sqrt(L)
    assert best_every_k(16, 20.0, 1.0) == 1  # transformer-like a >> b: every block


def test_chain_memory_is_minimised_near_sqrt_L():
    L, width, batch = 16, 8, 4
    chain = Chain(L, width)
    x = torch.randn(batch, width)
    b = batch * width * 4
    peaks = {}
    for k in range(1, L + 1):
        with SavedActivations(chain) as kept:
            chain(x, every_k=k)
        segment = Chain(k, width)
        with SavedActivations(segment) as seg:
            segment(x)  # what recomputing one segment holds; its input is already counted
        peaks[k] = kept.bytes + seg.bytes - b
    assert min(peaks, key=peaks.get) == 4
    assert peaks[4] == 8 * b  # (L/k + k) * b


@pytest.mark.parametrize("bad", [0, -1, 5, 1.5, True, "2"])
def test_bad_every_k_is_rejected(bad):
    model = GPT(GPTConfig.tiny(V, n_layer=4, d_model=32))
    x, y = _batch()
    with pytest.raises(ValueError, match="every_k"):
        checkpointed_forward(model, x, y, bad)
    with pytest.raises(ValueError, match="every_k"):
        CheckpointedGPT(model, bad)


def test_checkpointing_wraps_blocks_and_restores_them():
    """GPT.forward runs (no copy of it): the blocks are swapped for checkpointed segments only
    during the call, also when the forward raises; the segments hold the same block objects."""
    from course_lib.techniques.activation_checkpointing import CheckpointedSegment, checkpointed_blocks

    model = GPT(GPTConfig.tiny(V, n_layer=3, d_model=32))
    original = model.blocks
    with checkpointed_blocks(model, 2) as m:
        assert [type(b) for b in m.blocks] == [CheckpointedSegment, CheckpointedSegment]
        assert [blk for seg in m.blocks for blk in seg.blocks] == list(original)
    assert model.blocks is original
    too_long = torch.zeros(1, model.config.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        checkpointed_forward(model, too_long, every_k=1)
    assert model.blocks is original
    names = [n for n, _ in model.named_parameters()]
    x, y = _batch()
    checkpointed_forward(model, x, y, every_k=3)[1].backward()
    assert [n for n, _ in model.named_parameters()] == names
