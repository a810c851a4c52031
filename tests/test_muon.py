"""course_lib.techniques.muon: Newton-Schulz, Muon equal to torch.optim.Muon, the AdamW split."""

import pytest
import torch

from course_lib.model import GPT, GPTConfig
from course_lib.techniques.muon import Muon, MuonAdamW, muon_split, newton_schulz


def _run(optimizer_class, shapes, steps, seed=0, **kw):
    """Parameters after `steps` steps of optimizer_class on seeded random gradients."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = optimizer_class(params, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params] + [opt.state[p]["momentum_buffer"].clone() for p in params]


SHAPES = [(8, 8), (12, 5), (5, 12), (64, 256), (1, 7)]  # square, tall, wide, MLP-like, a single row


@pytest.mark.parametrize("kw", [
    {},
    dict(lr=0.02, weight_decay=0.01, momentum=0.9, nesterov=False),
    dict(lr=0.05, adjust_lr_fn="match_rms_adamw", ns_steps=3, eps=1e-6),
    dict(lr=0.02, adjust_lr_fn="original", ns_coefficients=(2.0, -1.5, 0.5)),
])
def test_equals_torch_muon_bitwise(kw):
    # exact: the same element-wise operations and the same bf16 matmuls in the same order, in one process
    ours, theirs = _run(Muon, SHAPES, 4, **kw), _run(torch.optim.Muon, SHAPES, 4, **kw)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_differs_from_torch_when_an_argument_differs():
    ours, theirs = _run(Muon, SHAPES, 2, nesterov=False), _run(torch.optim.Muon, SHAPES, 2, nesterov=True)
    assert not all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_newton_schulz_orthogonalises():
    G = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    O = newton_schulz(G).float()
    assert O.shape == G.shape and newton_schulz(G.T).shape == G.T.shape
    s = torch.linalg.svdvals(O)
    # Jordan et al. 2024: five quintic steps leave singular values roughly in (0.5, 1.5), not at 1
    assert 0.5 < s.min() and s.max() < 1.5, s
    # same singular vectors as G: O = U diag(s') V^T, so U^T O V is diagonal up to bf16 rounding
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    D = U.T @ O @ Vh.T
    off = D - torch.diag(torch.diagonal(D))
    assert off.abs().max() < 0.05  # bf16 (2^-8 relative) over 5 steps of two 32-deep matmuls: ~1e-2


def test_newton_schulz_refuses():
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.ones(3))
    with pytest.raises(ValueError, match="steps=100"):
        newton_schulz(torch.ones(3, 3), steps=100)


def test_muon_refuses_one_d_and_bad_args():
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        Muon([torch.nn.Parameter(torch.ones(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn='x'"):
        Muon([torch.nn.Parameter(torch.ones(4, 4))], adjust_lr_fn="x")
    with pytest.raises(ValueError, match="lr=-1"):
        Muon([torch.nn.Parameter(torch.ones(4, 4))], lr=-1)


def test_split_on_the_course_gpt():
    for tie in (True, False):
        model = GPT(GPTConfig(tie_weights=tie), seed=0)
        muon, adamw = muon_split(model)
        names = {id(p): n for n, p in model.named_parameters()}
        assert sorted(names[id(p)] for p in muon) == sorted(
            n for n, p in model.named_parameters() if p.dim() == 2 and "emb" not in n and not n.startswith("head"))
        adamw_names = {names[id(p)] for p in adamw}
        assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "blocks.0.attn.qkv.bias"} <= adamw_names
        assert ("head.weight" in {names[id(p)] for p in adamw}) == (not tie)  # tied: the embedding's tensor
        assert len(muon) + len(adamw) == len(list(model.parameters()))
        assert all(p.dim() == 2 for p in muon) and len(muon) == 4 * model.config.n_layer


def test_muon_adamw_steps_both_like_two_optimizers():
    def run(combined):
        torch.manual_seed(0)
        model = GPT(GPTConfig(), seed=0)
        x = torch.randint(0, 97, (4, 16))
        if combined:
            opt = MuonAdamW(model, lr=0.02, adamw_lr=1e-3, muon_class=torch.optim.Muon)
        else:
            m, a = muon_split(model)
            opts = [torch.optim.Muon(m, lr=0.02, weight_decay=0.0), torch.optim.AdamW(a, lr=1e-3, weight_decay=0.0)]
        for _ in range(3):
            loss = model(x, x)[1]
            loss.backward()
            for o in ([opt] if combined else opts):
                o.step()
                o.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    # exact: the same optimizers on the same parameters in the same order
    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))
