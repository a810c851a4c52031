"""Expert parallelism (course_lib.parallel.ep) equal to the single-process MoE over several AdamW
steps; all-to-all bytes against the formula; ep x dp on a 2-D mesh; memory per rank against the
estimate formulas; bad input; the torchrun demo."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from course_lib import CommTracer, run_on_ranks
from course_lib.dims import ParallelDims
from course_lib.estimate import MoEConfig, param_count, per_gpu_memory
from course_lib.model import GPT, GPTConfig
from course_lib.model.moe import routing_stats
from course_lib.parallel.ep import (apply_expert_parallel, check_expert_parallel, full_flat, run_expert_parallel,
                                    traffic_matrix, train_moe_reference)
from course_lib.train import TrainConfig, flat_params

from _tolerances import adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw, by_name
from _demo_cli import run_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
V = 97


def moe(**kw):
    base = dict(n_layer=2, d_model=32, n_head=2, block_size=16, n_experts=4, top_k=2)
    return GPTConfig.tiny(V, **{**base, **kw})


TC = TrainConfig(steps=3, batch_size=8, lr=1e-2, progress=False)


def assert_matches_reference(results, ref, cfg):
    """The ranks sum in another order than the reference, and AdamW (lr = 1e-2) magnifies that
    rounding near g = 0 (e.g. the key bias, whose true gradient is 0, is pure rounding noise):
    losses within adamw_loss_atol, the last step's gradients in norm per tensor, parameters
    bounded by AdamW's step and in RMS against lr/100 (tests/_tolerances)."""
    steps = len(ref.train_losses)
    mean_losses = [sum(r.train_losses[i] for r in results) / len(results) for i in range(steps)]
    assert mean_losses == pytest.approx(ref.train_losses, abs=adamw_loss_atol(TC.lr))
    for r in results:
        assert_grads_close_after_adamw(by_name(r.final_grads, GPT(cfg)), by_name(ref.final_grads, GPT(cfg)), "grad")
        assert_adamw_params_close(r.final_params, ref.final_params, TC.lr, TC.steps, TC.betas, msg="params")


@pytest.mark.parametrize("ep,n_experts,top_k,capacity_factor", [
    (2, 4, 1, None), (2, 4, 2, 1.0), (4, 8, 2, None), (4, 8, 1, 0.75),
])
def test_expert_parallel_equals_single_process(ep, n_experts, top_k, capacity_factor):
    cfg = moe(n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor)
    ref = train_moe_reference(cfg, TC, shares=ep)
    results = run_expert_parallel(ParallelDims(ep=ep), cfg, TC, timeout_s=120)
    assert_matches_reference(results, ref, cfg)
    if capacity_factor is not None:  # the case really drops tokens
        model = GPT(cfg, seed=0)
        model(torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0)))
        assert sum(int(s.dropped.sum()) for s in routing_stats(model)) > 0


def test_replicated_experts_baseline_equals_single_process_too():
    cfg = moe(capacity_factor=1.0)
    results = run_expert_parallel(ParallelDims(ep=2), cfg, TC, experts="replicated")
    assert_matches_reference(results, train_moe_reference(cfg, TC, 2), cfg)


def test_expert_by_data_parallel_on_a_2d_mesh():
    cfg = moe(top_k=2, capacity_factor=1.25)
    ref = train_moe_reference(cfg, TC, shares=4)
    results = run_expert_parallel(ParallelDims(ep=2, dp=2), cfg, TC, timeout_s=120)
    assert_matches_reference(results, ref, cfg)


def _one_step_traced(cfg):
    model = GPT(cfg, seed=0)
    apply_expert_parallel(model)
    gen = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, V, (2, cfg.block_size), generator=gen)
    with CommTracer() as tracer:
        model(idx, idx)[1].backward()
    rows = [r for r in tracer.records if r.op == "all_to_all_single" and r.dtype == "float32"]
    return ([s.kept for s in routing_stats(model)], tracer.summary(), [(r.bytes_sent, r.bytes_recv) for r in rows],
            sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_equal_the_formula(ep):
    cfg = moe(n_experts=8, top_k=2, capacity_factor=1.0)
    out = run_on_ranks(_one_step_traced, cfg, world_size=ep, timeout_s=60)
    d, L, E = cfg.d_model, cfg.n_layer, cfg.n_experts
    kept = [o[0] for o in out]  # kept[r][layer]: rows rank r sends to each global expert
    for r, (_, summary, rows, _) in enumerate(out):
        sent = [int(kept[r][layer].sum()) for layer in range(L)]  # M: rows this rank sends
        recv = [int(sum(kept[s][layer].view(ep, -1)[r].sum() for s in range(ep))) for layer in range(L)]  # R
        # per layer: counts E*8 bytes; forward dispatch M, combine R; backward R, M rows of d fp32
        expected = sum(E * 8 + 2 * (m + q) * d * 4 for m, q in zip(sent, recv))
        assert summary["all_to_all_single"] == {"calls": 5 * L, "bytes_sent": expected, "bytes_recv": expected}
        for layer in range(L):  # forward dispatch of each layer, against the traffic matrix
            matrix = traffic_matrix([kept[s][layer] for s in range(ep)], d)
            assert rows[2 * layer] == (int(matrix[r].sum()), int(matrix[:, r].sum()))
            off_rank = int(matrix[r].sum() - matrix[r, r])
            assert off_rank == (sent[layer] - int(kept[r][layer].view(ep, -1)[r].sum())) * d * 4
        assert "all_reduce" not in summary  # forward/backward: only the all-to-alls communicate


def test_parameters_per_rank_match_the_estimate_formulas():
    cfg = moe(n_experts=8, top_k=2)
    dense = GPTConfig.tiny(V, n_layer=2, d_model=32, n_head=2, block_size=16)
    per_rank = run_on_ranks(_one_step_traced, cfg, world_size=4, timeout_s=60)
    for ep_out in per_rank:
        assert ep_out[3] == per_gpu_memory(MoEConfig(dense, 8, 2), ep=4, recipe="fp32")["params_on_gpu"]
    total = param_count(MoEConfig(dense, 8, 2))
    assert GPT(cfg).num_params() == total > per_rank[0][3]
    # active parameters: what one token touches (top_k experts of each layer), the same with or without EP
    assert param_count(MoEConfig(dense, 8, 2), active=True) < total


def test_full_flat_gathers_the_single_process_order():
    cfg = moe(n_experts=4)

    def gathered():
        model = apply_expert_parallel(GPT(cfg, seed=5))
        return full_flat(model), sorted(n for n, _ in model.named_parameters() if ".experts." in n)[:2]

    out = run_on_ranks(gathered, world_size=2, timeout_s=60)
    assert torch.equal(out[0][0], flat_params(GPT(cfg, seed=5))) and torch.equal(out[1][0], out[0][0])
    assert out[1][1] == ["blocks.0.mlp.experts.mlps.2.fc.bias", "blocks.0.mlp.experts.mlps.2.fc.weight"]


@pytest.mark.parametrize("call,msg", [
    (lambda: run_expert_parallel(ParallelDims(ep=3), moe(n_experts=4), TC), "ep=3 must divide n_experts=4"),
    (lambda: run_expert_parallel(ParallelDims(ep=2), GPTConfig.tiny(V), TC), "n_experts=0 is a dense model"),
    (lambda: run_expert_parallel(ParallelDims(ep=2, tp=2), moe(), TC), "tp=2: run_expert_parallel runs ep, dp only"),
    (lambda: run_expert_parallel(ParallelDims(ep=4), moe(), TrainConfig(batch_size=6)), "batch_size=6 must be divisible"),
    (lambda: run_expert_parallel(ParallelDims(ep=2), moe(), TC, experts="all"), "experts='all' must be one of"),
    (lambda: check_expert_parallel(moe(), 0), "ep=0 must be a positive int"),
    (lambda: moe(n_experts=2, top_k=3), r"top_k=3 must satisfy 1 <= top_k <= n_experts=2"),
    (lambda: moe(capacity_factor=0), "capacity_factor=0 must be > 0"),
])
def test_bad_input_is_rejected_in_the_parent(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def test_apply_rejects_dense_models_and_double_application():
    def bad():
        errors = []
        for make in (lambda: GPT(GPTConfig.tiny(V)), lambda: apply_expert_parallel(GPT(moe()))):
            try:
                apply_expert_parallel(make())
            except ValueError as e:
                errors.append(str(e))
        return errors

    errors = run_on_ranks(bad, world_size=2, timeout_s=60)[0]
    assert "no MoE layers" in errors[0] and "already applied" in errors[1]


def test_expert_parallel_demo_under_torchrun_with_gloo():
    # the demo compares losses after AdamW steps at its lr (1e-2) with its default tolerance,
    # adamw_loss_atol(1e-2) (course_lib.tolerances)
    from course_lib.demos.expert_parallel import LR, TOLERANCE
    assert TOLERANCE == adamw_loss_atol(LR)
    # one launch for the demo and its frontier flags (a shared expert, the sigmoid router, bias
    # balancing, device-limited routing), each step against the single process (--check)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.expert_parallel", "--steps", "2", "--n-experts", "8", "--top-k", "4",
           "--n-shared-experts", "1", "--router", "sigmoid", "--balance", "bias", "--max-ranks-per-token", "1",
           "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |loss difference|" in proc.stdout and "tokens per expert" in proc.stdout
    assert "MATCH" in proc.stdout and "MISMATCH" not in proc.stdout and "DIFFERS" not in proc.stdout, proc.stdout
    assert "shared experts 1" in proc.stdout, proc.stdout


def test_expert_parallel_demo_rejects_bad_arguments():
    code, err = run_main("course_lib.demos.expert_parallel", ["--top-k", "9"])
    assert code != 0 and "top_k=9 must satisfy" in err
