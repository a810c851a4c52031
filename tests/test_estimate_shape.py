"""The estimator on ParallelDims end to end (#40): one model-shape view (n_experts = 0 is dense,
whatever config form said it) that the rule book and the estimator share, the layout checked once
(ParallelDims.check_model) and costed by gpu_memory(dims, shape, ...), per_gpu_memory's keyword
form a thin wrapper around it. Pure Python: no rank starts."""

from __future__ import annotations

import itertools

import pytest

from course_lib.dims import ParallelDims
from course_lib.estimate import per_gpu, step_time as st
from course_lib.estimate.clusters import gpu_cluster
from course_lib.estimate.params import LlamaLikeConfig, MoEConfig, model_shape
from course_lib.estimate.per_gpu import gpu_memory, per_gpu_memory
from course_lib.model.config import GPTConfig, ModelShape

DENSE = GPTConfig(n_layer=4, n_head=4, d_model=64, block_size=64)
LLAMA = LlamaLikeConfig(vocab_size=500, n_layer=4, d_model=128, n_head=8, n_kv_head=4, d_ff=352, block_size=64)
CLUSTER = gpu_cluster("H100 SXM 80 GB", 16)


@pytest.mark.parametrize("base", [DENSE, LLAMA], ids=["gpt", "llama"])
def test_a_dense_model_has_one_shape_whether_it_says_zero_experts_or_one(base):
    dense = model_shape(base)
    one_expert = model_shape(MoEConfig(base, n_experts=1, top_k=1))  # the estimator's old "dense"
    assert dense.n_experts == 0 and dense.top_k == 1 and dense.mlps == 1
    assert one_expert == dense
    assert dense.shape is dense and model_shape(dense) is dense  # a shape is its own view
    moe = model_shape(MoEConfig(base, n_experts=8, top_k=2))
    assert (moe.n_experts, moe.top_k, moe.mlps) == (8, 2, 8) and moe != dense


def test_the_shape_reads_every_config_form():
    gpt = DENSE.shape
    assert (gpt.n_head, gpt.n_kv_head, gpt.ff_dim, gpt.n_layer, gpt.block_size) == (4, 4, 256, 4, 64)
    assert gpt.config is DENSE and gpt.base is DENSE
    moe_gpt = GPTConfig.tiny(n_experts=4, top_k=2).shape  # the course's MoE GPT: 4 experts, a router
    assert (moe_gpt.n_experts, moe_gpt.top_k) == (4, 2)
    llama = LLAMA.shape
    assert (llama.n_kv_head, llama.ff_dim) == (4, 352)
    wrapped = MoEConfig(LLAMA, 8, 2)
    assert model_shape(wrapped).base is LLAMA and model_shape(wrapped).config is wrapped
    with pytest.raises(ValueError, match="must be a GPTConfig, LlamaLikeConfig or MoEConfig"):
        model_shape("gpt")
    with pytest.raises(ValueError, match="n_experts=-1 must be an int >= 0"):
        ModelShape(1, 1, 1, 1, 1, 1, 1, n_experts=-1)
    with pytest.raises(ValueError, match="top_k=2 must be <= n_experts=0"):
        ModelShape(1, 1, 1, 1, 1, 1, 1, top_k=2)


@pytest.mark.parametrize("base", [DENSE, LLAMA], ids=["gpt", "llama"])
def test_the_estimator_gives_a_dense_model_the_same_numbers_in_either_form(base):
    one_expert = MoEConfig(base, n_experts=1, top_k=1)
    for kw in (dict(), dict(tp=2, pp=2, dp=2, zero_stage=1), dict(cp=2, recompute="full")):
        assert per_gpu_memory(one_expert, 2, **kw) == per_gpu_memory(base, 2, **kw)
    dims = ParallelDims(dp=2, tp=2, pp=2, microbatches=2, sequence_parallel=True)
    assert st.step_time(one_expert, dims, CLUSTER, 8) == st.step_time(base, dims, CLUSTER, 8)
    assert st.memory_per_rank(one_expert, dims, 8) == st.memory_per_rank(base, dims, 8)


def test_the_keyword_form_is_gpu_memory_on_the_same_parallel_dims():
    """per_gpu_memory(config, dp=..., ...) equals gpu_memory(ParallelDims(...), shape, ...) on a grid."""
    shape = model_shape(DENSE)
    for dp, tp, pp, cp, zero, rc, sp in itertools.product((1, 2), (1, 2, 4), (1, 2, 4), (1, 2), (0, 1, 3),
                                                          ("none", "full"), (False, True)):
        if sp and tp == 1:
            continue
        dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, recompute=rc, sequence_parallel=sp)
        keywords = per_gpu_memory(DENSE, 2, 32, "fp32", zero, dp, tp, pp, 1, rc, sequence_parallel=sp, cp=cp)
        assert gpu_memory(dims, shape, 2, 32, "fp32") == keywords
    moe = MoEConfig(DENSE, 4, 2)
    assert (gpu_memory(ParallelDims(ep=4, dp=2, zero=1), model_shape(moe), 1, offload="optimizer", stage=0)
            == per_gpu_memory(moe, 1, ep=4, dp=2, zero_stage=1, offload="optimizer", stage=0))


@pytest.mark.parametrize("dims", [ParallelDims(dp=2, tp=2, pp=2, microbatches=2, sequence_parallel=True),
                                  ParallelDims(dp=2, cp=2, zero=1, recompute="selective"),
                                  ParallelDims(pp=2, tp=2, dp=2, zero=3, microbatches=2)], ids=str)
def test_a_layout_is_checked_once_per_estimate_and_never_on_the_way(dims, monkeypatch):
    calls = []
    check_model = ParallelDims.check_model

    def counted(self, *args, **kwargs):
        calls.append(self)
        return check_model(self, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the keyword form's checks ran on a layout already checked")

    monkeypatch.setattr(ParallelDims, "check_model", counted)
    monkeypatch.setattr(per_gpu, "check_degrees", refused)
    st.step_time(DENSE, dims, CLUSTER, 8)
    assert calls == [dims]
    st.memory_per_rank(DENSE, dims, 8)
    assert calls == [dims, dims]


@pytest.mark.parametrize("dims, config, message", [
    (ParallelDims(precision="fp16"), DENSE, "precision='fp16' must be one of"),
    (ParallelDims(tp=8), LLAMA, "tp=8 must divide n_kv_head=4"),
    (ParallelDims(ep=2), MoEConfig(DENSE, 1, 1), "ep=2 needs an MoE model: n_experts=0 is dense"),
    (ParallelDims(ep=3), MoEConfig(DENSE, 4, 2), "ep=3 must divide n_experts=4"),
    (ParallelDims(pp=2, virtual_stages=2, schedule="interleaved_1f1b", microbatches=2), GPTConfig.tiny(),
     "n_layer=2 blocks cannot fill 4 stages"),
], ids=["precision", "gqa", "dense-as-one-expert", "experts", "stages"])
def test_the_estimator_refuses_what_the_rule_book_refuses_with_its_words(dims, config, message):
    with pytest.raises(ValueError, match=message):
        dims.check_model(config, 8)  # the rule book reads any config form through its shape
    with pytest.raises(ValueError, match=message):
        st.step_time(config, dims, CLUSTER, 8)


def test_the_planner_checks_each_candidate_once(monkeypatch):
    from course_lib.estimate.planner import search

    calls = []
    check_model = ParallelDims.check_model

    def counted(self, *args, **kwargs):
        calls.append(self)
        return check_model(self, *args, **kwargs)

    monkeypatch.setattr(ParallelDims, "check_model", counted)
    candidates = search(DENSE, gpu_cluster("H100 SXM 80 GB", 4), 8, micro_batches=(1, 2))
    assert len(candidates) > 10 and calls == [c.dims for c in candidates]
