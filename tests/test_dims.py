"""The one layout description (course_lib.dims): its rule book agrees with the estimator and the
runtime on a grid of layouts and small models, and the capstone's schema is its fields."""

from __future__ import annotations

import itertools
from dataclasses import fields

import pytest

from course_lib import dims as D
from course_lib.capstone.config import SCHEMA, TRAIN_WIDE
from course_lib.estimate.bubble import formula_for
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.model import GPTConfig
from course_lib.parallel.hybrid import run_hybrid
from course_lib.parallel.pp.schedules import make_schedule, simulate
from course_lib.train import TrainConfig
from tests.test_planner import cpu_cluster

MODELS = {  # small models whose sizes make rules bite: odd layer counts, heads of 2 and 6
    "L3 h2": GPTConfig(vocab_size=32, block_size=12, n_layer=3, n_head=2, d_model=16),
    "L4 h6": GPTConfig(vocab_size=32, block_size=12, n_layer=4, n_head=6, d_model=24),
    "L2 moe4": GPTConfig(vocab_size=32, block_size=12, n_layer=2, n_head=2, d_model=16, n_experts=4, top_k=2,
                         aux_loss_coef=0.0, z_loss_coef=0.0),
}
GRID = [dict(dp=dp, tp=tp, pp=pp, ep=ep, virtual_stages=v, microbatches=m, schedule=s, sequence_parallel=sp)
        for dp, tp, pp, ep, v, m, s, sp in itertools.product(
            (1, 2), (1, 2, 3), (1, 2, 3), (1, 2), (1, 2), (1, 2, 4), ("1f1b", "interleaved_1f1b", "zero_bubble"),
            (False, True))]
# context parallelism: T = 12 tokens, so cp = 3 with load balancing (2cp = 6 chunks) fits and
# cp = 4 does not; Ulysses needs cp | n_head (heads of 2 and 6); cp with an MoE model is refused
GRID += [dict(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, cp_method=method, cp_load_balance=lb, microbatches=m,
              sequence_parallel=sp)
         for dp, tp, pp, ep, cp, method, lb, m, sp in itertools.product(
             (1, 2), (1, 2), (1, 2), (1, 2), (2, 3, 4), ("ring", "allgather", "ulysses"), (True, False), (1, 2),
             (False, True))]
BATCH = 8


def _message(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_rule_book_and_the_estimator_accept_and_refuse_the_same_layouts(name):
    """Every layout the rule book accepts is costed (time and memory); every one it refuses, the
    estimator and the runtime refuse with the same message (run_hybrid before any rank starts):
    one ParallelDims, one set of rules."""
    cfg = MODELS[name]
    train = TrainConfig(steps=1, batch_size=BATCH, progress=False)
    accepted = refused = 0
    for kw in GRID:
        d = D.ParallelDims(**kw)
        rule = _message(lambda: d.check_model(cfg, BATCH))
        cluster = cpu_cluster(d.world_size)
        if rule is None:
            t = step_time(cfg, d, cluster, BATCH, recipe="fp32")
            assert t["total"] > 0 and memory_per_rank(cfg, d, BATCH, recipe="fp32")["total"] > 0, kw
            accepted += 1
        else:
            for cost in (lambda: step_time(cfg, d, cluster, BATCH, recipe="fp32"),
                         lambda: memory_per_rank(cfg, d, BATCH, recipe="fp32"),
                         lambda: run_hybrid(d, cfg, train)):
                assert _message(cost) == rule, (kw, rule, _message(cost))
            refused += 1
    assert accepted and refused  # the grid exercises both sides


def test_uneven_pipeline_stages_are_costed_by_their_busiest_rank():
    cfg = MODELS["L3 h2"]  # 3 blocks on 2 stages: 2 + 1, as the runtime splits them
    assert [len(r) for r in D.split_layers(3, 2)] == [2, 1]
    assert D.layers_per_rank(5, 2, 2) == [3, 2]  # stages (2, 1, 1, 1): rank 0 runs stages 0 and 2
    lay = D.ParallelDims(pp=2, microbatches=2)
    mem = memory_per_rank(cfg, lay, 2, recipe="fp32")
    one_block_less = memory_per_rank(GPTConfig(**{**vars(cfg), "n_layer": 2}), lay, 2, recipe="fp32")
    assert mem["activations"] > one_block_less["activations"]  # stage 0 holds two blocks, not 3 // 2 = 1


def test_the_zero_bubble_formula_matches_the_schedules_simulation_for_every_m():
    for p in range(2, 7):
        for m in range(1, 3 * p):
            events = simulate(make_schedule("zero_bubble", p, m))
            span = max(end for rank in events for _, _, end in rank)
            # unit times: exact in binary fractions only by luck, so float64 rounding of one division
            assert formula_for("zero_bubble", p, m) == pytest.approx(1 - 3 * m / span, rel=1e-12, abs=0)


def test_the_capstone_schema_is_the_dataclass_fields():
    expected = [f.name for f in fields(D.ParallelDims) if f.name not in TRAIN_WIDE]
    for section in ("layout", "resume"):
        assert list(SCHEMA[section]) == expected
    assert set(TRAIN_WIDE) <= set(SCHEMA["train"])


def test_one_rule_one_place():
    with pytest.raises(ValueError, match="tp=4 must divide n_head=6"):
        D.check_tp(4, 6, 96)
    with pytest.raises(ValueError, match="sequence length 10 must be divisible by tp=3"):
        D.check_sequence_parallel(True, 3, 10)
    D.check_sequence_parallel(True, 3, 12)  # the whole sequence splits: 4 tokens per rank
    with pytest.raises(ValueError, match="n_layer=3 blocks cannot fill 4 stages"):
        D.split_layers(3, 4)
    with pytest.raises(ValueError, match="virtual_stages=2 needs pp > 1"):
        D.check_pipeline_choice("interleaved_1f1b", 1, 2, 2)


def test_the_label_names_a_layout_for_a_resume():
    assert D.ParallelDims(dp=2, tp=2, pp=2).label() == "dp2·tp2·pp2"
    assert D.ParallelDims(dp=1, ep=4).label() == "dp1·tp1·pp1·ep4"


def test_describe_names_every_option_and_the_micro_batch():
    d = D.ParallelDims(dp=8, tp=8, pp=16, virtual_stages=2, microbatches=192, schedule="interleaved_1f1b",
                       recompute="full")
    assert d.describe(1536) == "dp8·tp8·pp16·v2·m192·mb1·rc-full"
    assert D.ParallelDims(dp=2, zero=1, precision="bf16", sequence_parallel=True, tp=2).describe() == \
        "dp2·tp2·pp1·sp·zero1·bf16"
    with pytest.raises(ValueError, match="microbatches=3 must divide the per-replica batch"):
        D.ParallelDims(dp=2, microbatches=3).micro_batch(8)


@pytest.mark.parametrize("schedule, m", [("1f1b", 1), ("zero_bubble", 2)])
def test_layouts_only_the_rule_book_allowed_before_train_equal_to_one_process_and_are_costed(schedule, m):
    """3 blocks on 2 stages (uneven), and 1F1B with m < pp: the runtime always ran them; the
    estimator refused them (pp | n_layer, m >= pp). Now the one rule book accepts them, the
    estimator costs them, and they train equal to the single process."""
    from course_lib.data import CharDataset
    from course_lib.parallel.hybrid import train_single
    from test_hybrid import TRAIN, _assert_equal_to_single

    seq = 16
    cfg = GPTConfig(vocab_size=CharDataset("train", seq).vocab_size, block_size=seq, n_layer=3, n_head=2, d_model=16)
    d = D.ParallelDims(pp=2, microbatches=m, schedule=schedule).check(2, cfg, TRAIN.batch_size)
    assert step_time(cfg, d, cpu_cluster(2), TRAIN.batch_size, recipe="fp32")["bubble"] > 0
    _assert_equal_to_single(run_hybrid(d, cfg, TRAIN, timeout_s=240), train_single(cfg, TRAIN))
