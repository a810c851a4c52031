"""The model's seams for strategies that split the sequence (context parallelism):

* attention is a swappable submodule, `block.attn.attend` (a CausalAttention, q, k, v -> out):
  replacing it by another implementation of softmax(q k^T / sqrt(d) + causal mask) v changes
  neither the parameters nor (beyond rounding) the logits;
* positions are passed in: GPT.forward(idx, targets, pos) with pos = 0..T-1 by default, so a
  shard of a sequence embeds its own absolute positions;
* gpt.py, moe.py and layers.py import in one direction (gpt -> moe -> layers).
"""

import ast
import math
import pathlib

import pytest
import torch
import torch.nn as nn

from course_lib.data import VOCAB_SIZE
from course_lib.model import GPT, CausalAttention, GPTConfig
from course_lib.parallel.pp.stage import TokenAndPositionEmbedding
from course_lib.techniques.activation_checkpointing import CheckpointedGPT

ROOT = pathlib.Path(__file__).resolve().parent.parent


class LoopAttention(nn.Module):
    """The same formula computed another way: one query at a time, the softmax written out
    (exp of the shifted scores over their sum), only the keys 0..t visited (no mask at all)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, q, k, v):
        self.calls += 1
        T, d = q.shape[-2], q.shape[-1]
        rows = []
        for t in range(T):
            s = (q[..., t : t + 1, :] @ k[..., : t + 1, :].transpose(-2, -1)) / math.sqrt(d)  # (B, h, 1, t+1)
            w = torch.exp(s - s.amax(dim=-1, keepdim=True))
            rows.append((w / w.sum(dim=-1, keepdim=True)) @ v[..., : t + 1, :])
        return torch.cat(rows, dim=-2)


class NoMaskAttention(nn.Module):
    """A wrong replacement (every query sees every key): shows the comparison can fail."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _idx(T=40, seed=0):
    return torch.randint(0, VOCAB_SIZE, (3, T), generator=torch.Generator().manual_seed(seed))


def _swap(model, make):
    for block in model.blocks:
        block.attn.attend = make()
    return model


@pytest.mark.parametrize("attn_impl", ["naive", "fused"])
def test_swapping_the_attention_submodule_keeps_the_model(attn_impl):
    cfg = GPTConfig.tiny(attn_impl=attn_impl)
    plain = GPT(cfg, seed=0)
    assert all(isinstance(b.attn.attend, CausalAttention) for b in plain.blocks)
    assert not list(plain.blocks[0].attn.attend.parameters())  # no weights: nothing to re-key
    swapped = _swap(GPT(cfg, seed=0), LoopAttention)
    assert list(swapped.state_dict()) == list(plain.state_dict())
    idx = _idx()
    want, _ = plain(idx)
    got, _ = swapped(idx)
    assert [b.attn.attend.calls for b in swapped.blocks] == [1] * cfg.n_layer  # the swap is what ran
    # fp32, the same formula with its sums in another order (the loop's softmax, the kernel's
    # blocked online softmax): a few ulps on logits up to ~1.3 (ulp ~1.2e-7); 1e-5 is ~80 ulps,
    # while a masking error moves logits by ~1e-1 (the mutant below).
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    wrong, _ = _swap(GPT(cfg, seed=0), NoMaskAttention)(idx)
    assert (wrong - want).abs().max() > 1e-3


def test_causal_attention_states_its_formula_and_checks_impl():
    doc = CausalAttention.__doc__
    assert "softmax(q k^T / sqrt(d) + M) v" in doc and "-inf above the diagonal" in doc
    with pytest.raises(ValueError, match="impl='flash' must be one of"):
        CausalAttention("flash")


def _embedded(model, idx, pos=None):
    """What the first block receives: drop(tok_emb(idx) + pos_emb(pos)) (a hook on drop)."""
    seen = {}
    handle = model.drop.register_forward_hook(lambda m, args, out: seen.setdefault("x", out))
    try:
        logits, _ = model(idx, pos=pos)
    finally:
        handle.remove()
    return seen["x"], logits


def test_default_positions_are_arange_bit_for_bit():
    model = GPT(GPTConfig.tiny(dropout=0.0), seed=0)
    idx = _idx()
    plain, _ = model(idx)
    explicit, _ = model(idx, pos=torch.arange(idx.shape[1]))
    assert torch.equal(plain, explicit)  # the same lookups and the same ops: exact


def test_a_shard_embeds_its_own_positions():
    """The second half of a sequence, given its absolute positions T/2..T-1, enters the first
    block exactly as those rows of the whole sequence do. Its logits differ from the whole
    sequence's second half: a causal model needs the first half's keys, which a context-parallel
    attention supplies and plain attention on the shard does not (checked here, to be honest)."""
    model = GPT(GPTConfig.tiny(), seed=0)
    idx = _idx(T=32)
    half = idx.shape[1] // 2
    full_x, full_logits = _embedded(model, idx)
    shard_x, shard_logits = _embedded(model, idx[:, half:], pos=torch.arange(half, idx.shape[1]))
    assert torch.equal(shard_x, full_x[:, half:])
    default_x, _ = _embedded(model, idx[:, half:])  # without pos the shard would restart at 0
    assert not torch.equal(default_x, full_x[:, half:])
    assert (shard_logits - full_logits[:, half:]).abs().max() > 1e-3


def test_pipeline_first_stage_and_checkpointing_take_positions():
    model = GPT(GPTConfig.tiny(), seed=0)
    idx = _idx(T=32)
    pos = torch.arange(16, 48)
    want_x, want_logits = _embedded(model, idx, pos)
    embed = TokenAndPositionEmbedding(model.tok_emb, model.pos_emb, model.drop)
    assert torch.equal(embed(idx, pos), want_x)
    assert torch.equal(embed(idx), _embedded(model, idx)[0])
    got_logits, _ = CheckpointedGPT(model, every_k=1)(idx, pos=pos)
    assert torch.equal(got_logits, want_logits)  # checkpointing recomputes; the forward is the same


def test_bad_positions_are_rejected():
    model = GPT(GPTConfig.tiny(), seed=0)
    with pytest.raises(ValueError, match=r"pos of shape \(8,\) must be \(10,\)"):
        model(_idx(T=10), pos=torch.arange(8))
    with pytest.raises(ValueError, match="sequence length 65 exceeds block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def _course_lib_imports(path: pathlib.Path) -> set[str]:
    """Every course_lib module the file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("course_lib"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("course_lib")}
    return out


def test_model_modules_import_one_way():
    model_dir = ROOT / "course_lib" / "model"
    # config.py (GPTConfig, no torch) is the bottom: the estimator imports it without torch. Its one
    # course_lib import is the argument checks every module shares (_validate: no import at all)
    assert _course_lib_imports(model_dir / "config.py") == {"course_lib._validate"}
    assert _course_lib_imports(ROOT / "course_lib" / "_validate.py") == set()
    assert _course_lib_imports(model_dir / "layers.py") == {"course_lib.model.config"}
    assert _course_lib_imports(model_dir / "moe.py") == {"course_lib.model.layers"}
    assert _course_lib_imports(model_dir / "gpt.py") == {"course_lib.model.config", "course_lib.model.layers",
                                                         "course_lib.model.moe"}
