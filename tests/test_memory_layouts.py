"""The per-rank memory model (course_lib.estimate.per_gpu_memory, memory_per_rank) against the
bytes the course's own layouts hold after one fp32 AdamW step (course_lib.measure.memory):
parameters, gradients and optimizer state equal on every rank; activations within a stated margin."""

import sys
from dataclasses import replace

import cloudpickle
import pytest

from course_lib.data import CharDataset
from course_lib.estimate import param_count
from course_lib.estimate.per_gpu import per_gpu_memory, rank_param_counts
from course_lib.dims import ParallelDims as Dims
from course_lib.estimate.step_time import memory_per_rank
from course_lib.measure.memory import check_runnable, estimated_per_rank, format_memory_table, memory_table
from course_lib.model import GPTConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SEQ = 16
BATCH = 8  # sequences per step, every layout: 8 / (dp * ep * m) per micro-batch
STATE = ("params", "grads", "optimizer")

DENSE_LAYOUTS = [
    Dims(dp=4),                                                   # DDP
    Dims(dp=4, microbatches=2),                                   # DDP with accumulation
    Dims(dp=4, zero=1), Dims(dp=4, zero=2), Dims(dp=4, zero=3),
    Dims(tp=4),                                                   # vocabulary padded to 4 | V'
    Dims(dp=2, tp=2),
    Dims(dp=2, tp=2, zero=1),
    Dims(tp=2, pp=2, microbatches=2),
    Dims(dp=2, pp=2, microbatches=2),                             # the tied matrix on two stages
    Dims(pp=4, microbatches=4), Dims(pp=4, microbatches=4, schedule="gpipe"),
]
MOE_LAYOUTS = [Dims(dp=2, ep=2), Dims(ep=4)]


@pytest.fixture(scope="module")
def config():
    return GPTConfig.tiny(CharDataset("train", SEQ).vocab_size, block_size=SEQ, n_layer=4, d_model=32)


@pytest.fixture(scope="module")
def moe_config(config):
    return replace(config, n_layer=2, n_experts=4, top_k=2)


@pytest.fixture(scope="module")
def dense_rows(config):
    return memory_table(config, DENSE_LAYOUTS, BATCH, SEQ, timeout_s=180)


@pytest.fixture(scope="module")
def moe_rows(moe_config):
    return memory_table(moe_config, MOE_LAYOUTS, BATCH, SEQ, timeout_s=180)


def _check_state_equal(rows):
    for row in rows:
        for est, meas in zip(row["estimated"], row["measured"]):
            assert est["stage"] == meas["stage"]
            for k in STATE:
                assert est[k] == meas[k], (row["label"], est["rank"], k, est[k], meas[k])
        assert row["state_equal"] and row["busiest"][0] == row["busiest"][1]


def test_model_state_equals_measured_on_every_rank_of_every_dense_layout(dense_rows):
    _check_state_equal(dense_rows)


def test_model_state_equals_measured_with_experts_split_over_ep(moe_rows):
    _check_state_equal(moe_rows)
    # ep splits the experts: ep4 holds fewer parameters per rank than dp2 x ep2
    assert moe_rows[1]["busiest"][1] < moe_rows[0]["busiest"][1]


def test_planner_memory_per_rank_is_the_busiest_measured_rank(config, dense_rows):
    for lay, row in zip(DENSE_LAYOUTS, dense_rows):
        mem = memory_per_rank(config, lay, BATCH, SEQ, "fp32")
        assert sum(mem[k] for k in STATE) == max(sum(m[k] for k in STATE) for m in row["measured"]), row["label"]


def test_activations_within_the_stated_margin(config, dense_rows):
    """The formula (naive attention, fp32) counts what autograd saves: equal up to a scalar (the
    loss, 4 bytes per micro-batch) without tp. TP's vocabulary-parallel loss saves a second
    (n, V/tp) fp32 tensor beside the log-softmax, and its embedding and loss a few per-token
    masks and indices: at most 4 n ceil(V/tp) + 16 n bytes more on the last stage (n tokens of
    a micro-batch). ZeRO-3 also keeps gathered weights alive for backward: not compared."""
    V = config.vocab_size
    for lay, row in zip(DENSE_LAYOUTS, dense_rows):
        if lay.zero == 3:
            continue
        n = lay.micro_batch(BATCH) * SEQ
        for est, meas in zip(row["estimated"], row["measured"]):
            diff = meas["activations"] - est["activations"]
            loss_side = est["stage"] == lay.pp - 1
            if lay.tp == 1:
                assert 0 <= diff <= 4 * lay.microbatches, (row["label"], est["rank"], diff)
            else:
                margin = (4 * n * -(-V // lay.tp) if loss_side else 0) + 16 * n
                assert 0 <= diff <= margin, (row["label"], est["rank"], diff, margin)


def test_table_text_names_every_layout(dense_rows):
    text = format_memory_table(dense_rows)
    assert len(text.splitlines()) == len(DENSE_LAYOUTS) + 1
    assert "DIFFERENT" not in text and "gpipe" in text


def test_rank_param_counts_add_up_to_the_model(config, moe_config):
    assert sum(rank_param_counts(config).values()) == param_count(config)
    assert sum(rank_param_counts(moe_config).values()) == param_count(moe_config)
    # pipeline: the stages hold every parameter once, plus the last stage's copy of the tied matrix
    stages = [sum(rank_param_counts(config, pp=4, stage=s).values()) for s in range(4)]
    assert sum(stages) == param_count(config) + config.vocab_size * config.d_model
    # tensor parallelism keeps the row-parallel biases (2 d per layer) whole on every rank
    d, L, V = config.d_model, config.n_layer, config.vocab_size
    split = sum(rank_param_counts(config, tp=2).values())
    assert 2 * split - param_count(config) == 2 * d * L + 2 * (-(-V // 2)) * d - V * d + (
        L * 2 * 2 * d + 2 * d + config.block_size * d)  # biases, padded vocabulary, norms, positions


def test_per_gpu_memory_stage_argument(config):
    busiest = per_gpu_memory(config, 1, SEQ, "fp32", pp=4)
    per_stage = [per_gpu_memory(config, 1, SEQ, "fp32", pp=4, stage=s) for s in range(4)]
    assert busiest["total"] == max(s["total"] for s in per_stage)
    assert [s["stage"] for s in per_stage] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"stage=4 must be None"):
        per_gpu_memory(config, pp=4, stage=4)
    assert len(estimated_per_rank(config, Dims(dp=2, pp=2, microbatches=2), BATCH, SEQ)) == 4


def test_bad_input_is_named_before_any_rank_starts(config):
    with pytest.raises(ValueError, match="same number of ranks"):
        memory_table(config, [Dims(dp=2), Dims(dp=4)], BATCH, SEQ)
    with pytest.raises(ValueError, match=r"zero=2 runs on pure data parallelism"):
        check_runnable(config, Dims(dp=2, tp=2, zero=2), BATCH, SEQ)
    with pytest.raises(ValueError, match=r"recompute='full'"):
        check_runnable(config, Dims(dp=2, recompute="full"), BATCH, SEQ)
    with pytest.raises(ValueError, match="batch_size=6 must be divisible by dp\\*ep = 4"):
        check_runnable(config, Dims(dp=4), 6, SEQ)
    with pytest.raises(ValueError, match="at least one ParallelDims"):
        memory_table(config, [], BATCH, SEQ)
