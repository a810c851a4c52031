"""MFU reported by the trainer: TrainResult.flops_per_step / tokens_per_step, filled by the
reference loop and every strategy's loop, tokens_per_second() and mfu(peak_flops, n_devices)."""

import math
import sys
from dataclasses import replace

import cloudpickle
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.estimate import flops_per_token
from course_lib.model import GPT, GPTConfig
from course_lib.observe.profile import mfu as profile_mfu
from course_lib.train import TrainConfig, TrainResult, train_reference

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SEQ, BATCH = 16, 4
CFG = TrainConfig(steps=2, batch_size=BATCH, grad_clip=1.0, eval_every=100, eval_batches=1, progress=False)


@pytest.fixture(scope="module")
def config():
    return GPTConfig.tiny(CharDataset("train", SEQ).vocab_size, block_size=SEQ, d_model=32)


def test_reference_records_the_model_flops_of_a_step(config):
    result = train_reference(config, CFG)
    assert result.tokens_per_step == BATCH * SEQ
    assert result.flops_per_step == flops_per_token(config, SEQ) * BATCH * SEQ
    # the count is what autograd really multiplies: forward + backward matmuls of one step
    model = GPT(config)
    x = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(x, x)[1].backward()
    assert counter.get_total_flops() == result.flops_per_step
    # Formulas on whatever seconds were measured (never how many): float64 in another order,
    # rounding only (approx's default 1e-6 relative)
    mean = sum(result.step_seconds) / len(result.step_seconds)
    assert result.tokens_per_second() == pytest.approx(BATCH * SEQ / mean)
    assert result.mfu(1e12, 1) == pytest.approx(profile_mfu(result.flops_per_step, mean, 1, 1e12))
    assert result.mfu(1e12, 4) == pytest.approx(result.mfu(1e12, 1) / 4)
    assert result.mfu(1e12, 1, skip=1) == pytest.approx(result.flops_per_step / result.step_seconds[1] / 1e12)


def test_bad_input_named():
    empty = TrainResult(step_seconds=[0.1])
    with pytest.raises(ValueError, match="flops_per_step=0"):
        empty.mfu(1e12, 1)
    with pytest.raises(ValueError, match="tokens_per_step=0"):
        empty.tokens_per_second()
    done = TrainResult(step_seconds=[0.1], tokens_per_step=8, flops_per_step=1e9)
    with pytest.raises(ValueError, match="peak_flops=0"):
        done.mfu(0, 1)
    with pytest.raises(ValueError, match="n_devices=0"):
        done.mfu(1e12, 0)
    with pytest.raises(ValueError, match="skip=1 must be an int in"):
        done.mfu(1e12, 1, skip=1)


def _every_strategy(config, moe_config, train_cfg):
    from course_lib.parallel.dp.training import train_data_parallel
    from course_lib.parallel.ep.training import train_expert_parallel
    from course_lib.parallel.hybrid import ParallelDims, train_hybrid
    from course_lib.parallel.pp.training import train_pipeline
    from course_lib.parallel.tp.training import train_tensor_parallel
    from course_lib.parallel.zero.native import train_native
    from course_lib.parallel.zero.training import train_zero

    runs = {"dp": train_data_parallel(config, train_cfg), "zero1": train_zero(config, train_cfg, 1),
            "zero3": train_zero(config, train_cfg, 3), "tp": train_tensor_parallel(config, train_cfg),
            "zero_redundancy": train_native(config, train_cfg, "zero_redundancy"),
            "pp": train_pipeline(config, train_cfg, "1f1b", 2), "ep": train_expert_parallel(moe_config, train_cfg),
            "hybrid": train_hybrid(ParallelDims(tp=2), config, train_cfg)}
    return {k: (r.tokens_per_step, r.flops_per_step, len(r.step_seconds), r.mfu(1e12, 2)) for k, r in runs.items()}


def test_every_strategy_reports_the_flops_of_the_global_batch(config):
    moe_config = replace(config, n_experts=4, top_k=2)
    train_cfg = replace(CFG, steps=1)
    per_rank = run_on_ranks(_every_strategy, config, moe_config, train_cfg, world_size=2, timeout_s=120)
    for rank in per_rank:
        for name, (tokens, flops, steps, mfu) in rank.items():
            want = flops_per_token(moe_config if name == "ep" else config, SEQ) * BATCH * SEQ
            assert (tokens, flops, steps) == (BATCH * SEQ, want, 1), name
            # MFU comes from measured seconds: only its type and finiteness, and >= 0 (FLOPs > 0 over
            # a monotonic-clock duration); its size depends on the machine and its load
            assert isinstance(mfu, float) and math.isfinite(mfu) and mfu >= 0, name
    assert len(per_rank[0]) == 8
    # an MoE step multiplies top_k of the experts' MLPs per token: more FLOPs than the dense model
    assert per_rank[0]["ep"][1] > per_rank[0]["dp"][1]


def test_the_large_batch_runs_record_their_batch(config):
    from course_lib.parallel.dp.large_batch import train_at_token_budget

    result = train_at_token_budget(config, 2, 2 * SEQ * 2, 1e-3, 2, eval_batches=1)
    assert (result.tokens_per_step, result.flops_per_step) == (2 * SEQ, flops_per_token(config, SEQ) * 2 * SEQ)
