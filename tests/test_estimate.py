"""Tests for course_lib.estimate (formulas held against measurements) and course_lib.estimate.calculator."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib import estimate as E
from course_lib.observe.memory import SavedActivations, measured_state_bytes
from course_lib.model import GPT, GPTConfig, expected_num_params

torch.set_num_threads(1)


# ---------------------------------------------------------------- parameter counts


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_param_count_course_gpt_exact(tie, bias):
    cfg = GPTConfig(vocab_size=37, block_size=24, n_layer=3, n_head=2, d_model=16, d_ff=40, bias=bias, tie_weights=tie)
    real = sum(p.numel() for p in GPT(cfg).parameters())
    assert E.param_count(cfg) == real
    p = E.param_breakdown(cfg)  # the parts must add up to the same total
    per_layer = p["attention"] + p["mlp"] + p["norms"]
    assert p["embedding"] + p["position"] + p["final_norm"] + p["head"] + cfg.n_layer * per_layer == real


def test_param_count_reuses_model_formula():
    cfg = GPTConfig.tiny(tie_weights=False)
    assert E.param_count(cfg) == expected_num_params(cfg)


@pytest.mark.parametrize("config, published", [
    (E.GPT3_175B, 175e9), (E.LLAMA3_8B, 8.0e9), (E.LLAMA3_70B, 70.6e9), (E.LLAMA3_405B, 405.8e9),
])
def test_published_param_counts(config, published):
    # published sizes are rounded to 2-4 significant digits ("175B", "8B"): within 1 % (here <= 0.4 %)
    assert E.param_count(config) == pytest.approx(published, rel=0.01)


def test_moe_param_count():
    base = E.LLAMA3_8B
    moe = E.MoEConfig(base, n_experts=8, top_k=2)
    p = E.param_breakdown(base)
    router = base.d_model * 8
    assert E.param_count(moe) - E.param_count(base) == base.n_layer * (7 * p["mlp"] + router)
    assert E.param_count(moe, active=True) - E.param_count(base) == base.n_layer * (p["mlp"] + router)


# ---------------------------------------------------------------- model state


@pytest.mark.parametrize("recipe, per_param", [("fp32", 16), ("bf16_mixed", 16), ("fp16_mixed", 16),
                                               ("bf16_fp32_accum", 20), ("bf16_autocast", 16)])
def test_recipe_bytes_per_param(recipe, per_param):
    out = E.model_state_bytes(1000, recipe)
    assert out["total"] == per_param * 1000
    assert out["total"] == out["params"] + out["grads"] + out["optimizer"]


@pytest.mark.parametrize("recipe", sorted(E.RECIPES))
@pytest.mark.parametrize("dp", [1, 3, 8])
def test_zero_stages_divide_the_right_parts(recipe, dp):
    n = 1001
    r = E.RECIPES[recipe]
    shard = math.ceil(n / dp)
    z = [E.model_state_bytes(n, recipe, stage, dp) for stage in range(4)]
    assert z[0] == E.model_state_bytes(n, recipe)
    assert z[1]["optimizer"] == r.optimizer * shard and z[1]["grads"] == r.grad * n
    assert z[2]["grads"] == r.grad * shard and z[2]["params"] == r.param * n
    assert z[3]["params"] == r.param * shard and z[3]["total"] == r.total * shard
    assert [s["total"] for s in z] == sorted((s["total"] for s in z), reverse=True)


def test_counts_accept_integral_floats_only():
    """7.5e9 is what people type for 7.5 billion parameters: it must work like the int."""
    assert E.model_state_bytes(7.5e9, "bf16_mixed", 3, 8.0) == E.model_state_bytes(7_500_000_000, "bf16_mixed", 3, 8)
    assert E.per_gpu_memory(E.GPT3_175B, 1.0, 2048, tp=8.0, dp=4.0) == E.per_gpu_memory(E.GPT3_175B, 1, 2048, tp=8, dp=4)
    for bad in (7.5, -1, True, "7e9", float("nan")):
        with pytest.raises(ValueError, match="n_params="):
            E.model_state_bytes(bad)
    with pytest.raises(ValueError, match="n_tokens=0"):
        E.training_flops(7e9, 0)


def test_units_are_iec_and_spec_sheets_convert_explicitly():
    from course_lib import units

    assert units.fmt_bytes(80e9) == "74.5 GiB" and E.fmt_bytes is units.fmt_bytes
    assert units.fmt_bytes(3 * 2**20) == "3.0 MiB" and units.fmt_bytes(1023) == "1023 B"
    assert units.fmt_bytes(2**40) == "1.0 TiB" and units.fmt_bytes(1536) == "1.5 KiB"
    assert units.from_spec_gb(80) == 80 * 10**9
    # the expected values are written rounded to their last digit (80e9 / 2^30 = 74.5058...)
    assert units.spec_gb_to_gib(80) == pytest.approx(74.506, abs=1e-3)
    assert units.spec_gb_to_gib(141) == pytest.approx(131.32, abs=1e-2)
    assert units.fmt_rate(25e9) == "25.0 GB/s"
    with pytest.raises(ValueError, match="gb=0"):
        units.from_spec_gb(0)


def test_autocast_keeps_fp32_state():
    """torch.autocast runs matmuls in bf16 but leaves parameters, gradients and AdamW's state
    in fp32: 4 + 4 + 8 bytes per parameter, the bf16_autocast recipe (not bf16_mixed's 2 + 2 + 12)."""
    model = GPT(GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(x, x)
    assert logits.dtype == torch.bfloat16  # the compute really ran in bf16
    loss.backward()
    opt.step()
    assert E.model_state_bytes(model.num_params(), "bf16_autocast") == measured_state_bytes(model, opt)


def _one_step(model, optimizer):
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    model(x, x)[1].float().backward()


@pytest.mark.parametrize("tie", [True, False])
def test_fp32_state_matches_measurement(tie):
    model = GPT(GPTConfig.tiny(tie_weights=tie))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    _one_step(model, opt)
    opt.step()
    assert E.model_state_bytes(model.num_params(), "fp32") == measured_state_bytes(model, opt)


def test_bf16_mixed_state_matches_measurement():
    model = GPT(GPTConfig.tiny()).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, foreach=False)
    _one_step(model, opt)
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    for m in master:
        m.grad = None
    measured = measured_state_bytes(model, opt)  # bf16 params and grads, fp32 m and v
    measured["optimizer"] += sum(m.numel() * m.element_size() for m in master)  # + fp32 master copy
    est = E.model_state_bytes(model.num_params(), "bf16_mixed")
    assert {k: measured[k] for k in ("params", "grads", "optimizer")} == {k: est[k] for k in ("params", "grads", "optimizer")}


# ---------------------------------------------------------------- activations

ACT_CONFIGS = [
    dict(n_layer=1, n_head=4, d_model=64, block_size=32),
    dict(n_layer=2, n_head=4, d_model=64, block_size=32, attn_impl="fused"),
    dict(n_layer=1, n_head=4, d_model=64, block_size=32, dropout=0.1),
    dict(n_layer=3, n_head=6, d_model=96, block_size=48, d_ff=200, bias=False, tie_weights=False),
]


def _measure_saved(cfg, batch, seq):
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen) for _ in range(2))
    with SavedActivations(model) as saved:
        model(x, y)
    return saved.bytes


@pytest.mark.parametrize("kw", ACT_CONFIGS)
def test_activation_formula_matches_saved_tensors(kw):
    cfg = GPTConfig(vocab_size=50, **kw)
    batch, seq = 3, cfg.block_size
    measured = _measure_saved(cfg, batch, seq)
    # On the CPU dropout keeps a mask of the input's dtype (fp32: 4 bytes).
    est = E.activation_bytes(cfg, batch, seq, dtype_bytes=4, mask_bytes=4)
    assert measured == est["total"] + 4  # bytes, exactly: the formula leaves out only the 4-byte scalar loss


@pytest.mark.parametrize("impl", ["naive", "fused"])
def test_activation_per_layer_is_the_layer_slope(impl):
    one, two = (GPTConfig(vocab_size=50, n_layer=L, n_head=4, d_model=32, block_size=16, attn_impl=impl) for L in (1, 2))
    slope = _measure_saved(two, 2, 16) - _measure_saved(one, 2, 16)
    assert E.activation_bytes(one, 2, 16)["per_layer"] == slope  # bytes, exactly


def test_korthikanti_forms():
    s, b, h, a = 2048, 1, 12288, 96
    kw = dict(dtype_bytes=2, attention="naive", dropout=True)

    def per_layer(**extra):
        return E.activation_bytes(E.GPT3_175B, b, s, **kw, **extra)["per_layer"]

    # Korthikanti et al.'s closed forms plus the two small terms they leave out: LayerNorm
    # statistics (2 norms x fp32 mean and rstd: 16 bytes per token) and the course model's
    # bool causal mask (s^2 bytes per layer, built on every rank).
    stats, mask = 16 * s * b, s * s
    # float64 closed forms in another order: ~1e-16 relative apart; 1e-12 is far below a wrong term
    assert per_layer() == pytest.approx(s * b * h * (34 + 5 * a * s / h) + stats + mask, rel=1e-12)
    assert per_layer(tp=8) == pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)) + stats + mask, rel=1e-12)
    assert per_layer(tp=8, sequence_parallel=True) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h) / 8 + stats / 8 + mask, rel=1e-12)
    assert per_layer(recompute="selective") == pytest.approx(34 * s * b * h + stats, rel=1e-12)
    full = E.activation_bytes(E.GPT3_175B, b, s, recompute="full", **kw)
    assert full["per_layer"] == 2 * s * b * h
    assert full["recompute_buffer"] == E.activation_bytes(E.GPT3_175B, b, s, **kw)["per_layer"]


def test_fused_attention_drops_the_quadratic_term():
    short, long = (E.activation_bytes(E.LLAMA3_8B, 1, s, 2)["per_layer"] for s in (1024, 4096))
    assert long == 4 * short  # linear in s: integer bytes, exactly
    naive_short, naive_long = (E.activation_bytes(E.LLAMA3_8B, 1, s, 2, attention="naive")["per_layer"]
                               for s in (1024, 4096))
    assert naive_long > 5 * naive_short  # the s^2 scores dominate


# ---------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("kw", [dict(), dict(n_layer=3, d_model=96, n_head=6, d_ff=200, tie_weights=False),
                                dict(block_size=128, n_layer=1)])
def test_flops_match_flop_counter(kw):
    cfg = GPTConfig(vocab_size=50, **{**dict(n_layer=2, n_head=4, d_model=64, block_size=32), **kw})
    batch, seq = 2, cfg.block_size
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    counter = FlopCounterMode(display=False)
    with counter:
        model(x, x)[1].backward()
    # FLOPs are counted (the same matmuls), not measured: exact
    assert E.flops_per_token(cfg, seq) * batch * seq == counter.get_total_flops()


def test_flops_rules():
    assert E.training_flops(175e9, 300e9) == pytest.approx(3.15e23)  # 6PD in float64: rounding only (default 1e-6)
    exact = E.flops_per_token(E.GPT3_175B) * 300e9
    assert exact == pytest.approx(3.15e23, rel=0.05)  # 6PD is within a few % for GPT-3
    assert E.flops_per_token(E.GPT3_175B, causal=True) < E.flops_per_token(E.GPT3_175B)
    assert E.flops_per_token(E.GPT3_175B, training=False) * 3 == E.flops_per_token(E.GPT3_175B)
    years = E.training_time(3.15e23, 1, 312e12, mfu=1.0) / (365.25 * 86400)
    assert 31 < years < 33  # a formula on fixed inputs: 31.99 years (not a measurement)
    n = E.gpus_needed(3.15e23, 30 * 86400, 312e12, 0.5)
    assert E.training_time(3.15e23, n, 312e12, 0.5) <= 30 * 86400 < E.training_time(3.15e23, n - 1, 312e12, 0.5)


# ---------------------------------------------------------------- per-GPU memory


def test_per_gpu_memory_parallel_degrees():
    cfg = E.GPT3_175B
    one = E.per_gpu_memory(cfg, 1, 2048)
    assert one["params_on_gpu"] == E.param_count(cfg)
    assert one["params"] == 2 * E.param_count(cfg)
    tp = E.per_gpu_memory(cfg, 1, 2048, tp=8)
    # tp splits the matrices; the LayerNorms and row-parallel biases stay whole on every GPU (+0.13 %)
    assert tp["params_on_gpu"] == pytest.approx(E.param_count(cfg) / 8, rel=0.01)
    pp = E.per_gpu_memory(cfg, 1, 2048, pp=8)
    p = E.param_breakdown(cfg)
    layers = cfg.n_layer * (p["attention"] + p["mlp"] + p["norms"])
    assert pp["stage"] == 0 and pp["params_on_gpu"] == layers // 8 + p["embedding"] + p["position"]
    # 1F1B: the first stage holds as many activations as one micro-batch through every layer, up
    # to the terms outside the layers (embedding, final norm, logits), which sit at the ends (0.3 %)
    assert pp["activations"] == pytest.approx(one["activations"], rel=0.01)
    z3 = E.per_gpu_memory(cfg, 1, 2048, zero_stage=3, dp=64)
    assert z3["params"] + z3["grads"] + z3["optimizer"] == E.model_state_bytes(E.param_count(cfg), "bf16_mixed", 3, 64)["total"]
    off = E.per_gpu_memory(cfg, 1, 2048, offload="optimizer")
    assert off["optimizer"] == 0 and off["cpu_offload"] == one["optimizer"]
    assert one["total"] == one["params"] + one["grads"] + one["optimizer"] + one["activations"]


def test_per_gpu_memory_expert_parallel():
    moe = E.MoEConfig(E.LLAMA3_8B, n_experts=8, top_k=2)
    p = E.param_breakdown(moe)
    a = E.per_gpu_memory(moe, 1, 4096)
    b = E.per_gpu_memory(moe, 1, 4096, ep=8)
    assert a["params_on_gpu"] - b["params_on_gpu"] == E.LLAMA3_8B.n_layer * 7 * p["mlp"]
    assert a["n_gpus"] * 8 == b["n_gpus"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=5), "tp=5 must divide n_head=96"),
    (dict(pp=97), "n_layer=96 blocks cannot fill 97 stages"),  # pp=5 runs: 20 + 19 + 19 + 19 + 19 blocks
    (dict(ep=2), "ep=2"),
    (dict(dp=0), "dp=0 must be a positive whole number"),
    (dict(tp=2.5), "tp=2.5 must be a positive whole number"),
    (dict(recipe="int8"), "recipe='int8'"),
    (dict(zero_stage=4), "zero_stage=4"),
    (dict(recompute="some"), "recompute='some'"),
    (dict(offload="nvme"), "offload='nvme'"),
    (dict(seq=4096), "seq=4096 must be <= block_size=2048"),
])
def test_per_gpu_memory_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        E.per_gpu_memory(E.GPT3_175B, **kwargs)


def test_other_validation():
    with pytest.raises(ValueError, match="dp=0"):
        E.model_state_bytes(10, "fp32", 1, dp=0)
    with pytest.raises(ValueError, match="attention='flash'"):
        E.activation_bytes(E.COURSE_GPT, 1, attention="flash")
    with pytest.raises(ValueError, match="mfu=1.5"):
        E.training_time(1e20, 1, 1e12, mfu=1.5)
    with pytest.raises(ValueError, match="n_head=32 must be a multiple of n_kv_head=3"):
        E.LlamaLikeConfig(vocab_size=10, n_layer=1, d_model=64, n_head=32, n_kv_head=3, d_ff=8)
    with pytest.raises(ValueError, match="top_k=3"):
        E.MoEConfig(E.COURSE_GPT, n_experts=2, top_k=3)


# ---------------------------------------------------------------- calculator


def test_calculator_static_and_widget():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.estimate import calculator as C
    from course_lib.estimate import calculator_widget as CW

    ladder = C.gpt3_ladder()
    fig = C.plot_scenarios(ladder)
    totals = [C.evaluate(s)["memory"]["total"] for _, s in ladder]
    assert totals[0] > 80e9 > totals[-1]
    plt.close(fig)
    w = CW.MemoryCalculator()
    assert repr(w) == "MemoryCalculator(preset='GPT-3 175B')"
    assert "fits" in w.summary.value and w.image.value[:4] == b"\x89PNG"
    assert 64 not in w.controls["tp"].options  # only valid layouts are offered: tp divides the 96 heads
    w.controls["tokens"].value = "3OOB"  # a mistyped count greys the chart out and says why
    assert "tokens='3OOB'" in w.summary.value and not w.current.valid
    w.controls["preset"].value = "Llama-3 70B"
    assert w.controls["n_layer"].value == 80 and w.controls["seq"].value == 8192
