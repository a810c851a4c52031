"""The mixture-of-experts layer (course_lib/model/moe.py) against a naive per-token loop, its
auxiliary losses, capacity and counts, the MoE GPT's parameter count, and the dense GPT untouched."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.estimate import MoEConfig, param_count
from course_lib.model import GPT, GPTConfig, expected_num_params
from course_lib.model.moe import (MoELayer, expert_capacity, load_balancing_loss, moe_layers, route, router_z_loss,
                                  routing_stats)

from _tolerances import assert_close_fp32_sums

V = 97


def small(**kw):
    return GPTConfig.tiny(V, n_layer=1, d_model=16, n_head=2, d_ff=24, block_size=16, **kw)


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """One token and one choice at a time: every first choice (tokens in order), then every
    second choice; an expert that has taken C assignments takes no more."""
    probs = F.softmax(layer.router(x).float(), dim=-1)
    n_tokens, n_experts = probs.shape
    k = layer.top_k
    capacity = expert_capacity(n_tokens, n_experts, k, layer.capacity_factor)
    taken = [0] * n_experts
    rows = [torch.zeros_like(x[0]) for _ in range(n_tokens)]
    for slot in range(k):
        for n in range(n_tokens):
            top, idx = probs[n].topk(k)
            e = int(idx[slot])
            gate = top[slot] / top.sum() if k > 1 else top[slot]
            if capacity is not None and taken[e] >= capacity:
                continue
            taken[e] += 1
            rows[n] = rows[n] + gate * layer.experts.mlps[e](x[n:n + 1])[0]
    return torch.stack(rows)


def grads(module, x):
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (1, 0.75), (2, 1.0), (3, 0.5)])
def test_layer_equals_naive_loop_outputs_and_gradients(top_k, capacity_factor):
    cfg = small(n_experts=4, top_k=top_k, capacity_factor=capacity_factor)
    layer = GPT(cfg, seed=1).blocks[0].mlp
    with torch.no_grad():  # a router strong enough that the experts get unequal loads
        layer.router.weight.mul_(40)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, cfg.d_model, generator=gen)
    w = torch.randn(40, cfg.d_model, generator=gen)

    x1 = x.clone().requires_grad_()
    y1 = layer(x1[None])[0]
    (y1 * w).sum().backward()
    got = grads(layer, x1)
    layer.zero_grad()
    x2 = x.clone().requires_grad_()
    y2 = naive_moe(layer, x2)
    (y2 * w).sum().backward()
    want = grads(layer, x2)

    # Batched gathers and matmuls vs one token at a time: the same sums in another order (fp32,
    # tests/_tolerances: 1e-4 relative and of the largest element; measured <= 4.5e-7 of the
    # largest on AVX-512 and the scalar path, where atol 1e-6 alone was within 2x). A wrong gate
    # or a wrongly dropped token is off by > 1e-1.
    assert_close_fp32_sums(y1, y2)
    for g1, g2 in zip(got, want):
        assert_close_fp32_sums(g1, g2)
    stats = layer.last_stats
    assert int(stats.routed.sum()) == top_k * 40
    if capacity_factor is not None:
        assert stats.capacity == math.ceil(capacity_factor * top_k * 40 / 4)
        assert int(stats.kept.max()) <= stats.capacity and int(stats.dropped.sum()) > 0
    else:
        assert torch.equal(stats.kept, stats.routed) and stats.drop_fraction == 0


def test_router_gets_gradient_from_the_gates():
    for k in (1, 2):
        layer = GPT(small(n_experts=4, top_k=k, aux_loss_coef=0.0, z_loss_coef=0.0), seed=0).blocks[0].mlp
        layer(torch.randn(1, 8, 16)).square().sum().backward()
        assert layer.router.weight.grad.abs().sum() > 0


def test_route_gates_order_and_capacity():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.1, 0.2, 0.7], [0.7, 0.2, 0.1]])
    r = route(probs, top_k=2, capacity=None)
    assert r.counts == [3, 3, 2] and r.expert.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    # gates renormalised over the two choices: token 0 -> 0.5/0.8 to expert 0, 0.3/0.8 to expert 1
    # fp32 probabilities (each 6e-8 relative from its decimal), their sum and ratio: <= ~3e-7
    # relative; approx's default 1e-6 (also for the raw probabilities below)
    g = {(int(t), int(e)): float(v) for t, e, v in zip(r.token, r.expert, r.gate)}
    assert g[(0, 0)] == pytest.approx(0.625) and g[(0, 1)] == pytest.approx(0.375)
    # capacity 2: expert 0's first choices are tokens 0, 1, 3 -> token 3 is dropped; first
    # choices queue before second ones, so expert 1 keeps tokens 0 and 2 and drops token 3
    # (all three chose it second), and expert 2 keeps token 2 (first) and token 1 (second)
    r = route(probs, top_k=2, capacity=2)
    kept = sorted((int(e), int(t)) for t, e in zip(r.token, r.expert))
    assert kept == [(0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (2, 2)]
    assert r.stats.routed.tolist() == [3, 3, 2] and r.stats.dropped.tolist() == [1, 1, 0]
    assert r.stats.drop_fraction == 2 / 8  # a ratio of counts: exact
    top1 = route(probs, top_k=1, capacity=None)
    assert sorted(top1.gate.tolist()) == pytest.approx([0.5, 0.6, 0.7, 0.7])  # top-1: the raw probability


def test_dropped_tokens_pass_through_the_residual():
    cfg = small(n_experts=2, top_k=1, capacity_factor=0.5)
    layer = GPT(cfg, seed=0).blocks[0].mlp
    x = torch.randn(1, 16, 16)
    y = layer(x)[0]
    r = route(F.softmax(layer.router(x[0]), -1), 1, layer.last_stats.capacity)
    dropped = sorted(set(range(16)) - set(r.token.tolist()))
    assert len(dropped) == int(layer.last_stats.dropped.sum()) > 0
    assert torch.all(y[dropped] == 0) and torch.all(y[r.token].abs().sum(-1) > 0)


def test_expert_capacity_formula():
    assert expert_capacity(100, 8, 2, 1.25) == math.ceil(1.25 * 2 * 100 / 8) == 32
    assert expert_capacity(100, 8, 2, None) is None


def test_auxiliary_losses():
    E, N = 4, 12  # fp32 sums of <= 48 terms vs float64 formulas: a few ulps (approx's default 1e-6)
    uniform = torch.full((N, E), 1 / E)
    assert float(load_balancing_loss(uniform, torch.full((E,), N // E), 1)) == pytest.approx(1.0)
    collapsed = F.one_hot(torch.zeros(N, dtype=torch.long), E).float()
    assert float(load_balancing_loss(collapsed, torch.tensor([N, 0, 0, 0]), 1)) == pytest.approx(E)
    logits = torch.randn(N, E)
    assert float(router_z_loss(logits)) == pytest.approx(float((torch.logsumexp(logits, 1) ** 2).mean()))


def test_gpt_loss_adds_the_auxiliary_losses():
    cfg = GPTConfig.tiny(V, n_experts=4, top_k=2, aux_loss_coef=0.02, z_loss_coef=0.003)
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    ce = F.cross_entropy(logits.view(-1, V), idx.view(-1))
    layers = moe_layers(model)
    assert len(layers) == cfg.n_layer and len(routing_stats(model)) == cfg.n_layer
    aux = sum(0.02 * m.balance_loss + 0.003 * m.z_loss for m in layers)
    # the model may add the layers' terms in another order: a few ulps of the ~4 loss (rel 1e-6 is
    # ~10 ulps). Each balance loss is >= ~1 (1 for a uniform router) and the z-losses are >= 0.
    assert loss.item() == pytest.approx((ce + aux).item(), rel=1e-6) and aux.item() > 0.02 * cfg.n_layer * 0.99


def test_moe_parameter_count_matches_the_estimate_formulas():
    dense = GPTConfig.tiny(V)
    for E, k in ((4, 1), (8, 2)):
        cfg = GPTConfig.tiny(V, n_experts=E, top_k=k)
        model = GPT(cfg, seed=0)
        total = model.num_params()
        assert total == expected_num_params(cfg) == param_count(MoEConfig(dense, E, k))
        one_expert = sum(p.numel() for p in model.blocks[0].mlp.experts.mlps[0].parameters())
        active = total - cfg.n_layer * (E - k) * one_expert  # what one token's forward touches
        assert active == param_count(MoEConfig(dense, E, k), active=True)


def test_expert_projections_get_the_residual_init():
    model = GPT(GPTConfig.tiny(V, n_experts=4, n_layer=4), seed=0)
    proj = model.blocks[0].mlp.experts.mlps[3].proj.weight
    fc = model.blocks[0].mlp.experts.mlps[3].fc.weight
    # sample std of 16,384 seeded normals: relative standard error 1/sqrt(2N) = 0.55 %; 5 % is ~9 of them
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert fc.std().item() == pytest.approx(0.02, rel=0.05)


def test_dense_model_is_untouched_by_the_moe_fields():
    plain = GPTConfig.tiny(V)
    assert "n_experts" not in repr(plain) and "n_experts=4" in repr(GPTConfig.tiny(V, n_experts=4))
    odd = GPTConfig.tiny(V, top_k=3, capacity_factor=2.0, aux_loss_coef=0.5)  # ignored when dense
    a, b = GPT(plain, seed=3), GPT(odd, seed=3)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert not any("router" in n or "experts" in n for n, _ in a.named_parameters())
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    la, lb = a(idx, idx)[1], b(idx, idx)[1]
    assert torch.equal(la, lb) and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.num_params() == expected_num_params(plain)


@pytest.mark.parametrize("kw,msg", [
    (dict(n_experts=-1), "n_experts=-1 must be an int >= 0"),
    (dict(n_experts=2, top_k=3), "top_k=3 must satisfy 1 <= top_k <= n_experts=2"),
    (dict(n_experts=4, top_k=0), "top_k=0 must satisfy"),
    (dict(n_experts=4, capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(n_experts=4, capacity_factor=-1), "capacity_factor=-1 must be > 0"),
    (dict(n_experts=4, aux_loss_coef=-0.1), "aux_loss_coef=-0.1 must be >= 0"),
])
def test_bad_moe_config_is_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("+", r"\+")):
        GPTConfig.tiny(V, **kw)
