"""The frontier MoE options (course_lib.model.moe_config): fine-grained and shared experts, sigmoid
routing, auxiliary-loss-free bias balancing, device-limited routing; their counts in the estimator;
every variant under expert parallelism equal to its single process (one launch of 2 ranks); a
rank that receives no tokens; the DeepSeek-V3 case; bad input; the demo's new flags."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import CommTracer, run_on_ranks
from course_lib.estimate import MoEConfig, param_count
from course_lib.estimate.compute import flops_per_token
from course_lib.estimate.params import LlamaLikeConfig, mla_attention_params, moe_flops_per_token
from course_lib.model import GPT, GPTConfig
from course_lib.model.moe import route, routing_stats
from course_lib.model.moe_config import MoEGPTConfig, fine_grained
from course_lib.parallel.ep.imbalance import collapse_router, timed_moe_layer
from course_lib.parallel.ep import (apply_expert_parallel, check_expert_parallel, full_flat, reduce_gradients,
                                    train_expert_parallel, train_moe_reference)
from course_lib.train import TrainConfig, flat_grads

from _tolerances import (adamw_loss_atol, assert_adamw_params_close, assert_close_fp32_sums,
                         assert_grads_close_after_adamw, by_name)
from _demo_cli import run_main

V = 97
COARSE = GPTConfig.tiny(V, n_layer=2, d_model=32, n_head=2, block_size=16, n_experts=4, top_k=2)
TC = TrainConfig(steps=3, batch_size=8, lr=1e-2, progress=False)


def frontier(**kw):
    return MoEGPTConfig.from_config(COARSE, **kw)


# the variants run under EP on 2 ranks, each against train_moe_reference(shares=2)
VARIANTS = {
    "fine-grained + 2 shared": fine_grained(COARSE, 2, n_shared=2),  # 6 routed, top-2, 2 shared, d_ff 64
    "sigmoid + bias": frontier(router="sigmoid", balance="bias", bias_rate=0.01),
    "device-limited M=1": frontier(n_experts=8, top_k=4, expert_groups=2, max_groups_per_token=1),
}


def test_fine_grained_keeps_active_and_total_expert_matmuls():
    fine = fine_grained(COARSE, 4, n_shared=1)
    assert (fine.n_experts, fine.top_k, fine.ff_dim, fine.n_shared_experts) == (15, 7, 32, 1)
    d = COARSE.d_model
    weights = lambda c, n: n * 2 * d * c.ff_dim  # expert matmul weights (fc and proj)
    assert weights(fine, fine.top_k + 1) == weights(COARSE, COARSE.top_k)  # active per token
    assert weights(fine, fine.n_experts + 1) == weights(COARSE, COARSE.n_experts)  # total
    # the counts: the model's tensors, the closed form with the shared experts
    assert GPT(fine).num_params() == param_count(fine)
    # FLOPs: moe_flops_per_token is compute.flops_per_token on a plain MoE; fine-grained adds
    # only the larger router (d * (15 - 4) weights per layer, 2 FLOPs each, x3 for training)
    dense = GPTConfig.tiny(V, n_layer=2, d_model=32, n_head=2, block_size=16)
    plain = MoEConfig(dense, 4, 2)
    assert moe_flops_per_token(plain) == flops_per_token(plain)
    split = MoEConfig(dense, 15, 7, n_shared_experts=1, d_expert=32)
    assert moe_flops_per_token(split) - moe_flops_per_token(plain) == 3 * 2 * 2 * d * (15 - 4)


def test_route_bias_sigmoid_and_device_limit_rules():
    probs = torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.1, 0.3, 0.6, 0.5]])
    # the bias moves the choice, not the gate: token 0 now picks experts 0 and 3
    r = route(probs, 2, None, bias=torch.tensor([0.0, -0.75, 0.0, 0.0]))
    got = {(int(t), int(e)): float(g) for t, e, g in zip(r.token, r.expert, r.gate)}
    assert set(got) == {(0, 0), (0, 3), (1, 2), (1, 3)}
    # gates are the unbiased scores renormalised over the chosen (fp32 ratios: approx's 1e-6)
    assert got[(0, 0)] == pytest.approx(0.9 / 1.1) and got[(0, 3)] == pytest.approx(0.2 / 1.1)
    # device limit: groups {0,1} {2,3}; group score = sum of its ceil(k/M) best. k=2, M=1: token 1's
    # groups score 0.4 and 1.1, so both its experts come from group 1; token 0's from group 0
    r = route(probs, 2, None, groups=2, max_groups=1)
    assert sorted((int(t), int(e)) for t, e in zip(r.token, r.expert)) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    # V3's rule is the SUM of the best k/M, not the max: [0.5,0.45 | 0.6,0.0] picks group 0 with k=2, M=1
    r = route(torch.tensor([[0.5, 0.45, 0.6, 0.0]]), 2, None, groups=2, max_groups=1)
    assert sorted(r.expert.tolist()) == [0, 1]


def test_bias_update_follows_the_sign_rule():
    model = GPT(frontier(balance="bias", bias_rate=0.25), seed=0)
    layer = model.blocks[0].mlp
    layer.load_since_update.copy_(torch.tensor([10, 2, 2, 2]))  # mean 4: expert 0 overloaded
    layer.update_bias()
    assert layer.expert_bias.tolist() == [-0.25, 0.25, 0.25, 0.25] and layer.load_since_update.sum() == 0
    layer.load_since_update.copy_(torch.tensor([4, 4, 4, 4]))  # balanced: sign(0) = 0, no move
    layer.update_bias()
    assert layer.expert_bias.tolist() == [-0.25, 0.25, 0.25, 0.25]
    # the Switch loss is left out of the model's loss under balance="bias"
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    z = sum(0.001 * m.z_loss for m in (b.mlp for b in model.blocks))
    # the same fp32 terms summed in another order: a few ulps of the ~4.6 loss
    assert loss.item() == pytest.approx((F.cross_entropy(logits.view(-1, V), idx.view(-1)) + z).item(), rel=1e-6)


def test_deepseek_v3_case():
    # DeepSeek-AI 2024 (V3 report §4.2): 61 layers, d 7168, 128 heads of 128, MLA ranks 1536 (q) and
    # 512 (kv), rotary 64; first 3 layers dense (d_ff 18432); 1 shared + 256 routed experts of 2048, top-8
    base = LlamaLikeConfig(vocab_size=129280, n_layer=61, d_model=7168, n_head=128, n_kv_head=128, d_ff=18432)
    mla = mla_attention_params(7168, 128, 128, 1536, 512, 64)
    v3 = MoEConfig(base, 256, 8, n_shared_experts=1, d_expert=2048, first_dense_layers=3, attention_params=mla)
    # 671.0e9 and 37.55e9 by these formulas; the report gives 671B total and 37B active
    assert round(param_count(v3) / 1e9) == 671 and round(param_count(v3, active=True) / 1e9, 1) == 37.6


@pytest.mark.parametrize("make,msg", [
    (lambda: frontier(top_k=5), "top_k=5 must satisfy 1 <= top_k <= n_experts=4"),
    (lambda: frontier(expert_groups=2, max_groups_per_token=3), r"max_groups_per_token=3 must be an int in \[1, expert_groups=2\]"),
    (lambda: frontier(top_k=3, expert_groups=2, max_groups_per_token=1), "hold fewer than top_k=3"),
    (lambda: frontier(router="relu"), "router='relu' must be one of"),
    (lambda: frontier(balance="loss"), "balance='loss' must be one of"),
    (lambda: frontier(n_shared_experts=-1), "n_shared_experts=-1 must be an int >= 0"),
    (lambda: fine_grained(COARSE, 3), "m=3 must be a positive int dividing the expert hidden size 128"),
    (lambda: check_expert_parallel(frontier(n_experts=8, expert_groups=4, max_groups_per_token=2), 2),
     "expert_groups=4 must equal ep=2"),
])
def test_bad_input_is_rejected_before_any_rank(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def _share(rank, world):
    idx = torch.randint(0, V, (4, 16), generator=torch.Generator().manual_seed(3))
    return idx.chunk(world)[rank]


def _on_ranks(variants, ks):
    out = {name: train_expert_parallel(cfg, TC) for name, cfg in variants.items()}
    out["once per rank"] = train_expert_parallel(VARIANTS["device-limited M=1"], TC, once_per_rank=True)
    # collapsed router: one forward/backward, the gradients and what each rank received
    model = apply_expert_parallel(collapse_router(GPT(COARSE, seed=0)))
    x = _share(dist.get_rank(), dist.get_world_size())
    model(x, x)[1].backward()
    reduce_gradients(model)
    out["collapsed"] = (full_flat(model, grads=True), [s.kept for s in routing_stats(model)])
    # all-to-all bytes against top_k: one traced forward/backward of fine-grained models
    for k in ks:
        model = apply_expert_parallel(GPT(fine_grained(COARSE, k // COARSE.top_k), seed=0))
        with CommTracer() as tracer:
            model(x, x)[1].backward()
        out[f"k={k}"] = tracer.summary()["all_to_all_single"]
    # the deduplicating dispatch under M = 1: each token crosses once, to its one rank
    model = apply_expert_parallel(GPT(VARIANTS["device-limited M=1"], seed=0), once_per_rank=True)
    with CommTracer() as tracer:
        model(x, x)[1].backward()
    out["once bytes"] = [(r.bytes_sent, r.dtype) for r in tracer.records if r.op == "all_to_all_single"]
    return out


def test_variants_under_expert_parallelism_equal_the_single_process():
    ks = (2, 4, 8)
    out = run_on_ranks(_on_ranks, VARIANTS, ks, world_size=2, timeout_s=180)
    for name, cfg in [*VARIANTS.items(), ("once per rank", VARIANTS["device-limited M=1"])]:
        ref = train_moe_reference(cfg, TC, shares=2)
        mean = [sum(o[name].train_losses[i] for o in out) / 2 for i in range(TC.steps)]
        # losses and parameters after AdamW steps, as tests/test_expert_parallel.py (tests/_tolerances)
        assert mean == pytest.approx(ref.train_losses, abs=adamw_loss_atol(TC.lr)), name
        for o in out:
            assert_grads_close_after_adamw(by_name(o[name].final_grads, GPT(cfg)), by_name(ref.final_grads, GPT(cfg)), name)
            assert_adamw_params_close(o[name].final_params, ref.final_params, TC.lr, TC.steps, TC.betas, msg=name)
    # collapse: rank 1 received nothing, yet both ranks return, with the single process's gradients
    for o in out:  # each rank's 2 x 16 tokens, top-2, all to experts 0 and 1 in every layer
        kept = o["collapsed"][1]
        assert all(int(k[2:].sum()) == 0 for k in kept) and all(int(k[:2].sum()) == 2 * 16 * 2 for k in kept)
    ref = collapse_router(GPT(COARSE, seed=0))
    for r in range(2):
        x = _share(r, 2)
        (ref(x, x)[1] / 2).backward()
    for o in out:
        assert_close_fp32_sums(o["collapsed"][0], flat_grads(ref))  # the same fp32 sums, another order
    # all-to-all bytes grow with k: per layer counts E*8 plus dispatch, combine and their backward,
    # 4 * k * N rows of d fp32 on each rank (no capacity: every assignment travels), E = 2k experts
    N, d, L = 2 * 16, COARSE.d_model, COARSE.n_layer
    for k in ks:
        expected = L * (2 * k * 8 + 4 * k * N * d * 4)
        assert out[0][f"k={k}"]["bytes_sent"] + out[1][f"k={k}"]["bytes_sent"] == 2 * expected
    # once per rank, M = 1, top-4 of 8: each token's 4 experts sit on one rank, so it crosses once.
    # Summed over the 2 ranks (what one sends, another receives): rows of d fp32 per layer, the
    # dispatch N each (not 4N) forward and backward, the combine 4N each way: 2 x (N + 4N + 4N + N),
    # against 2 x 16N per assignment; int64: counts 8 x 8 B, distinct counts 2 x 8 B, indices 4N x 8 B
    def total(dtype):
        return sum(b for o in out for b, t in o["once bytes"] if t == dtype)
    assert total("float32") == L * 2 * 10 * N * d * 4 < L * 2 * 16 * N * d * 4
    assert total("int64") == L * 2 * (64 + 16 + 4 * N * 8)


def test_timed_moe_layer_rows_rounds_and_timeline():
    # rows are exact: balanced (skew 0) they sum to every assignment, collapsed (skew 10 on rank 0's
    # experts, 2 of 4) all of them land on rank 0; times are only checked for type and count
    tokens, rounds = 24, 3
    out = run_on_ranks(timed_moe_layer, COARSE, (0.0, 10.0), tokens, rounds=rounds, world_size=2, timeout_s=120)
    (bal0, col0), (bal1, col1) = out
    assert bal0[0] + bal1[0] == 2 * tokens * COARSE.top_k and min(bal0[0], bal1[0]) > 0
    assert (col0[0], col1[0]) == (2 * tokens * COARSE.top_k, 0)
    for rows, seconds, events in (bal0, col0, bal1, col1):
        assert len(seconds) == rounds and all(math.isfinite(t) and t >= 0 for t in seconds)
        names = [e[0] for e in events]  # the last round's: one experts span between the all-to-alls
        assert names.count("experts") == 1 and "all_to_all_single" in names


def test_demo_rejects_bad_flags_before_any_rank():
    # M larger than the expert-parallel group (here 2 ranks): refused in the parser, no rank started
    code, err = run_main("course_lib.demos.expert_parallel", ["--max-ranks-per-token", "3"], env={"WORLD_SIZE": "2"})
    assert code == 2 and "max_groups_per_token=3 must be an int in [1, expert_groups=2]" in err
