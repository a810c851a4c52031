"""The estimator's fp8 recipe (issue #27): memory terms against hand counts and the measured
saved bytes of the course's FP8Linear, the step time's FP8 matmul rate, and ZeRO-3's all-gather
at 1 byte with gather_dtype="fp8". No ranks."""

from dataclasses import replace

import pytest
import torch

from course_lib.data import CharDataset
from course_lib.dims import ParallelDims
from course_lib.estimate import activation_bytes, model_state_bytes
from course_lib.estimate.calculator import GPUS, Settings, evaluate
from course_lib.estimate.clusters import GEMM_EFFICIENCY, gpu_cluster
from course_lib.estimate.compute import flops_per_token
from course_lib.estimate.params import GPT3_175B, LLAMA3_8B
from course_lib.estimate.per_gpu import per_gpu_memory
from course_lib.estimate.planner import plan
from course_lib.estimate.step_time import fp8_flops_per_token, step_time
from course_lib.estimate.traffic import seconds, step_traffic
from course_lib.model import GPT, GPTConfig
from course_lib.observe.memory import SavedActivations
from course_lib.techniques.fp8 import apply_fp8

torch.set_num_threads(1)


def tiny():
    return GPTConfig.tiny(CharDataset("train").vocab_size)


# ------------------------------------------------------------------ memory
def test_model_state_of_fp8_is_bf16_mixed():
    for stage, dp in ((0, 1), (3, 8)):
        assert model_state_bytes(10**6 + 1, "fp8", stage, dp) == model_state_bytes(10**6 + 1, "bf16_mixed", stage, dp)


@pytest.mark.parametrize("e", [4, 2])
def test_fp8_activation_terms_by_hand_gpt(e):
    cfg = tiny()
    b, s = 4, 32
    n, d, f, L = b * s, cfg.d_model, cfg.ff_dim, cfg.n_layer
    plain, fp8 = activation_bytes(cfg, b, s, e), activation_bytes(cfg, b, s, e, fp8_linears=True)
    t = fp8["layer_terms"]
    assert t["qkv input"] == t["attention proj input"] == t["mlp input"] == n * d  # 1 byte each
    assert t["mlp hidden"] == e * n * f + n * f  # GELU's input stays e bytes, the proj input 1
    assert t["fp8 weight copies"] == 4 * d * d + 2 * d * f and t["fp8 scales (fp32)"] == 32
    assert fp8["per_layer"] - plain["per_layer"] == -(e - 1) * (3 * n * d + n * f) + 4 * d * d + 2 * d * f + 32
    assert fp8["output_side"] == plain["output_side"] and fp8["input_side"] == plain["input_side"]  # head stays


def test_fp8_activation_terms_by_hand_llama_with_tp():
    cfg, b, s, tp = LLAMA3_8B, 1, 1024, 2
    n, d, f, kv = b * s, cfg.d_model, cfg.d_ff, cfg.n_kv_head * cfg.d_model // cfg.n_head
    t = activation_bytes(cfg, b, s, 2, tp=tp, sequence_parallel=True, fp8_linears=True)["layer_terms"]
    assert t["qkv input"] == t["mlp input"] == n * d // tp and t["attention proj input"] == n * d // tp
    assert t["mlp hidden"] == (3 * 2 * n * f + n * f) // tp  # gate, up, silu(gate) in bf16; down's input e4m3
    assert t["fp8 weight copies"] == (2 * d * d + 2 * d * kv + 3 * d * f) // tp  # q|k|v, o, gate|up, down


def test_fp8_activation_bytes_equal_what_fp8linear_saves():
    cfg = tiny()
    x, y = torch.randint(0, cfg.vocab_size, (2, 4, cfg.block_size), generator=torch.Generator().manual_seed(0))
    model = apply_fp8(GPT(cfg), "tensorwise")
    with SavedActivations(model) as saved:
        model(x, y)  # distinct targets: the same tensor would be counted once
    # to the byte, but for the 4-byte scalar loss (as notebook 04 counts the fp32 model)
    assert saved.bytes == activation_bytes(cfg, 4, cfg.block_size, 4, fp8_linears=True)["total"] + 4


def test_fp8_linears_flag_is_checked():
    with pytest.raises(ValueError, match="fp8_linears='yes' must be True or False"):
        activation_bytes(tiny(), 1, 8, fp8_linears="yes")


# ------------------------------------------------------------------ time
def test_gpu_specs_carry_the_datasheet_fp8_peaks():
    assert GPUS["H100 SXM 80 GB"].peak_fp8 == 1979e12 and GPUS["H100 SXM 80 GB"].peak_bf16 == 989e12
    assert GPUS["H200 SXM 141 GB"].peak_fp8 == 1979e12 and GPUS["A100 SXM 80 GB"].peak_fp8 == 0
    c = gpu_cluster("H100 SXM 80 GB", 8)
    assert c.achievable_fp8_flops == GEMM_EFFICIENCY * 1979e12
    assert c.with_gpus(16).achievable_fp8_flops == c.achievable_fp8_flops  # replace() keeps the FP8 rate


def test_fp8_compute_term_uses_the_fp8_rate():
    c, dims, B, s = gpu_cluster("H100 SXM 80 GB", 64), ParallelDims(dp=64), 64, 2048
    bf16, fp8 = step_time(GPT3_175B, dims, c, B, s), step_time(GPT3_175B, dims, c, B, s, recipe="fp8")
    d, f, L = GPT3_175B.d_model, GPT3_175B.ff_dim, GPT3_175B.n_layer
    assert fp8_flops_per_token(GPT3_175B) == 6 * L * (4 * d * d + 2 * d * f)
    F, F8 = flops_per_token(GPT3_175B, s) * B * s, fp8_flops_per_token(GPT3_175B) * B * s
    assert bf16["compute"] == pytest.approx(F / (64 * c.achievable_flops), rel=1e-12)  # float rounding only
    assert fp8["compute"] == pytest.approx((F - F8) / (64 * c.achievable_flops) + F8 / (64 * c.achievable_fp8_flops),
                                           rel=1e-12)  # float rounding only
    assert fp8["flops"] == bf16["flops"]  # the same model FLOPs, done faster


def test_fp8_gather_halves_zero3_all_gather_bytes():
    c, B, s = gpu_cluster("H100 SXM 80 GB", 64), 64, 2048
    dims = ParallelDims(dp=64, zero=3)
    t16 = step_time(GPT3_175B, dims, c, B, s, recipe="fp8")
    t8 = step_time(GPT3_175B, dims, c, B, s, recipe="fp8", gather_dtype="fp8")
    local = per_gpu_memory(GPT3_175B, 1, s, "fp8", 3, 64)["params_on_gpu"]
    r16 = step_traffic(GPT3_175B, dims, B, s, 2, 2, 2, local)["dp"]
    r8 = step_traffic(GPT3_175B, dims, B, s, 2, 2, 1, local)["dp"]
    gathers16 = [r for r in r16 if r.op == "all_gather"]
    gathers8 = [r for r in r8 if r.op == "all_gather"]
    assert [g.nbytes for g in gathers8] == [g.nbytes / 2 for g in gathers16]  # 1 byte per parameter, not 2
    assert [r for r in r8 if r.op == "reduce_scatter"] == [r for r in r16 if r.op == "reduce_scatter"]
    link = c.link_of("dp", dims)
    assert t16["dp_total"] == pytest.approx(sum(seconds(r, link) for r in r16), rel=1e-12)  # float rounding only
    assert t8["dp_total"] == pytest.approx(sum(seconds(r, link) for r in r8), rel=1e-12)
    assert t8["dp_total"] < t16["dp_total"]


def test_fp8_refusals_name_the_rule():
    c = gpu_cluster("H100 SXM 80 GB", 64)
    with pytest.raises(ValueError, match="gather_dtype='fp8' needs zero=3"):
        step_time(GPT3_175B, ParallelDims(dp=64, zero=1), c, 64, 2048, recipe="fp8", gather_dtype="fp8")
    with pytest.raises(ValueError, match="needs a cluster with an FP8 matmul rate"):
        step_time(GPT3_175B, ParallelDims(dp=64), gpu_cluster("A100 SXM 80 GB", 64), 64, 2048, recipe="fp8")
    with pytest.raises(ValueError, match="needs a GPU with an FP8 peak"):
        evaluate(Settings(recipe="fp8", gpu="A100 SXM 80 GB"))


def test_calculator_times_fp8_linears_at_the_fp8_peak():
    s = Settings(preset="GPT-3 175B", recipe="bf16_mixed", gpu="H100 SXM 80 GB",
                 layout=ParallelDims(dp=64, zero=3, recompute="full"))
    r16, r8 = evaluate(s), evaluate(replace(s, recipe="fp8"))
    flops, n, mfu = r16["flops"], r16["memory"]["n_gpus"], s.mfu
    f8 = fp8_flops_per_token(GPT3_175B) * r16["tokens"] * 4 / 3
    assert r16["seconds"] == pytest.approx(flops / (n * 989e12 * mfu), rel=1e-12)  # float rounding only
    assert r8["seconds"] == pytest.approx((flops - f8) / (n * 989e12 * mfu) + f8 / (n * 1979e12 * mfu), rel=1e-12)
    assert r8["memory"]["params"] == r16["memory"]["params"] and r8["memory"]["optimizer"] == r16["memory"]["optimizer"]


def test_planner_accepts_the_fp8_recipe():
    out = plan(GPT3_175B, gpu_cluster("H100 SXM 80 GB", 1024), 1536, 2048, "fp8")
    assert out.ranked and all(c.time["compute"] > 0 for c in out.ranked)
