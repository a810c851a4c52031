"""Context parallelism with grouped-query attention (n_kv_head < n_head): the ring, the all-gather
and Ulysses send K and V un-repeated, the rank's own key/value heads (its one copied head at
tp > n_kv_head), and repeat them to the query heads after the communication. Proven on gloo ranks:
cp = 2 alone and tp x cp = 2 x 2, n_head 4 with n_kv_head 2 and 1, each equal to the single
process over several AdamW steps, and the bytes the tracer sees on the cp axis EQUAL cp_traffic's
records (exact: the records count K, V n_kv_head wide, so a runtime that repeated K, V before the
communication would send n_head / n_kv_head times their bytes). The rule book, the estimator and
the runtime refuse the same Ulysses layouts (cp must divide a tp rank's KV heads)."""

import sys
from dataclasses import replace

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.data import CharDataset, get_batch
from course_lib.dims import ParallelDims
from course_lib.estimate.clusters import gpu_cluster
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.estimate.traffic import cp_traffic, step_traffic
from course_lib.model import GPTConfig
from course_lib.parallel.cp import context_attention, train_context_parallel
from course_lib.parallel.cp.layout import SequenceLayout
from course_lib.parallel.cp.training import traced_forward_backward
from course_lib.parallel.hybrid import run_hybrid, train_single
from course_lib.train import flat_grads, flat_params, train_reference

from test_context_parallel import TRAIN as CP_TRAIN, assert_trains_like_the_reference
from test_hybrid_cp import TRAIN, _assert_equal_to_single

HY_TRAIN = replace(TRAIN, eval_every=10**6)  # test_hybrid_cp's run without its evaluation's forwards (cp bytes too)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

VOCAB = CharDataset("train").vocab_size
SEQ = 24  # 2cp = 4 zig-zag chunks at cp = 2


def config(n_kv: int) -> GPTConfig:
    return GPTConfig.tiny(VOCAB, block_size=SEQ, n_kv_head=n_kv)  # n_head 4, d_head 16


PLAIN = [(n_kv, m) for n_kv in (2, 1) for m in ("ring", "allgather", "ulysses") if not (m == "ulysses" and n_kv == 1)]
TRACED = [ParallelDims(cp=2, cp_method=m, cp_load_balance=lb, microbatches=mb)
          for m in ("ring", "allgather", "ulysses") for lb, mb in ((True, 1), (False, 2))]


def _traced(cfg, dims):
    x, y = get_batch(CharDataset("train", SEQ), CP_TRAIN.batch_size, torch.Generator().manual_seed(0))
    return traced_forward_backward(cfg, x, y, None, dims.cp_method, dims.cp_load_balance, dims.microbatches)


def _plain_runs():
    out = {}
    for n_kv, method in PLAIN:
        r = train_context_parallel(config(n_kv), CP_TRAIN, 2, 1, method, True)
        out[n_kv, method] = r.train_losses, r.final_params, r.final_grads
    for n_kv in (2, 1):
        for i, dims in enumerate(TRACED):
            if not (dims.cp_method == "ulysses" and n_kv == 1):
                out[n_kv, i] = _traced(config(n_kv), dims)
    return out


@pytest.fixture(scope="module")
def plain():
    return run_on_ranks(_plain_runs, world_size=2, timeout_s=300)


@pytest.mark.parametrize("n_kv, method", PLAIN)
def test_cp2_with_fewer_kv_heads_trains_like_the_single_process(plain, n_kv, method):
    """The tolerances of tests/test_context_parallel.py (its docstring says why): the merged softmax
    and the gradient sums add the same fp32 terms in another order; here also dK, dV summed over
    each KV head's group of query heads (the repeat's adjoint) in another order."""
    ref = train_reference(config(n_kv), CP_TRAIN)
    for r in (0, 1):
        assert_trains_like_the_reference(plain[r][n_kv, method], (ref.train_losses, flat_params(ref.model),
                                                                  flat_grads(ref.model)), config(n_kv), (n_kv, method))


FAMILY = {"isend": "send", "irecv": "send", "all_gather_single": "all_gather",
          "reduce_scatter_single": "reduce_scatter", "all_to_all_single": "all_to_all"}


@pytest.mark.parametrize("n_kv", [2, 1])
def test_traced_cp_bytes_equal_cp_traffic_counting_kv_heads(plain, n_kv):
    """Per kind of call: rank 0's calls and the bytes sent over both ranks equal the records."""
    cfg = config(n_kv)
    for i, dims in enumerate(TRACED):
        if dims.cp_method == "ulysses" and n_kv == 1:
            continue
        records = cp_traffic(cfg, dims, CP_TRAIN.batch_size)
        want_calls, want_bytes = {}, {}
        for rec in records:
            want_calls[rec.op] = want_calls.get(rec.op, 0) + rec.calls
            want_bytes[rec.op] = want_bytes.get(rec.op, 0) + rec.world_bytes
        calls, sent = {}, {}
        for op, row in plain[0][n_kv, i].items():
            calls[FAMILY[op]] = calls.get(FAMILY[op], 0) + row["calls"]
        for r in (0, 1):
            for op, row in plain[r][n_kv, i].items():
                sent[FAMILY[op]] = sent.get(FAMILY[op], 0) + row["bytes_sent"]
        assert calls == want_calls, (n_kv, dims.describe())
        assert sent == want_bytes, (n_kv, dims.describe(), sent, want_bytes)
        assert sum(want_bytes.values()) > 0


# ------------------------------------------------------------------ tp x cp = 2 x 2 (run_hybrid)
# (n_head, n_kv_head, method): at n_head 4, tp 2 leaves each rank one KV head (n_kv_head 2: its own;
# 1: a copy), which the ring passes round or the all-gather gathers d_head wide; Ulysses composes
# where the cp ranks split a tp rank's KV heads: n_head 8, n_kv_head 4, two KV heads per tp rank
HYBRID = [(4, n_kv, m) for n_kv in (2, 1) for m in ("ring", "allgather")] + [(8, 4, "ulysses")]


@pytest.mark.parametrize("n_head, n_kv, method", HYBRID)
def test_tp2_cp2_with_fewer_kv_heads_equals_the_single_process_and_cp_bytes_equal_the_records(n_head, n_kv, method):
    """tests/test_hybrid_cp.py's comparison (its tolerances and reasons); the cp axis's traced bytes
    over the 4 ranks are steps x cp_traffic's, exactly."""
    cfg = replace(config(n_kv), n_layer=2, d_model=32, n_head=n_head)
    dims = ParallelDims(tp=2, cp=2, cp_method=method)
    results = run_hybrid(dims, cfg, HY_TRAIN, trace=True, timeout_s=240)
    _assert_equal_to_single(results, train_single(cfg, HY_TRAIN))
    # at dp = 1 the dp·cp group that averages the gradients and the loss IS the cp group, so the
    # tracer counts dp's records on the cp axis too (hybrid.training.traffic_by_dimension)
    records = step_traffic(cfg, dims, HY_TRAIN.batch_size)
    on_cp = records["cp"] + records["dp"]
    assert sum(r.traffic["cp"]["bytes_sent"] for r in results) == HY_TRAIN.steps * sum(r.world_bytes for r in on_cp)
    assert results[0].traffic["cp"]["calls"] == HY_TRAIN.steps * sum(r.calls for r in on_cp)
    kv_bytes = 2 * HY_TRAIN.batch_size * (SEQ // 2) * max(1, n_kv // 2) * cfg.d_head * 4  # K||V, fp32
    if method != "ulysses":  # a tp rank's KV heads (its one copied head at n_kv_head 1), not its query heads
        assert {r.nbytes for r in records["cp"] if r.nbytes} == {kv_bytes * (2 if method == "allgather" else 1)}


# ------------------------------------------------------------------ the rule: one place, three callers
def _message(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("n_kv, tp, cp, refused", [
    (2, 1, 2, None), (1, 1, 2, "cp=2 must divide n_kv_head=1 for method='ulysses'"),
    (2, 2, 2, "cp=2 must divide the n_kv_head/tp = 2/2 = 1 heads of a tensor-parallel rank for method='ulysses'"),
    (1, 2, 2, "cp=2 must divide the one KV head a tp=2 > n_kv_head=1 rank copies for method='ulysses'"),
    (1, 4, 2, "cp=2 must divide the n_head/tp = 4/4 = 1 heads of a tensor-parallel rank for method='ulysses'"),
    (4, 2, 2, None)])
def test_rule_book_estimator_and_runtime_refuse_the_same_ulysses_layouts(n_kv, tp, cp, refused):
    """Ulysses re-shards a tp rank's heads, K and V un-repeated: cp | n_head / tp and cp | its KV
    heads (one copied head at tp > n_kv_head: the old rule read n_kv_head // tp = 0 there and let
    it through). The rule book, the step-time and memory estimates and run_hybrid (before any rank
    starts) give the same message."""
    cfg = replace(config(n_kv), n_layer=2, d_model=32)
    d = ParallelDims(tp=tp, cp=cp, cp_method="ulysses")
    rule = _message(lambda: d.check_model(cfg, 8))
    assert (rule is None) == (refused is None) and (refused is None or refused in rule), rule
    if refused is not None:
        cluster = gpu_cluster("H100 SXM 80 GB", 8)
        for cost in (lambda: step_time(cfg, d, cluster, 8, recipe="fp32"),
                     lambda: memory_per_rank(cfg, d, 8, recipe="fp32"),
                     lambda: run_hybrid(d, cfg, HY_TRAIN)):
            assert _message(cost) == rule


def _ulysses_refuses_local_kv_heads_cp_does_not_divide():
    layout = SequenceLayout(8, 2, False)
    q, k, v = torch.zeros(1, 4, 4, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    return _message(lambda: context_attention(q, k, v, layout.positions(dist.get_rank()), None, layout, "ulysses"))


def test_the_attention_itself_refuses_ulysses_over_one_kv_head():
    got = run_on_ranks(_ulysses_refuses_local_kv_heads_cp_does_not_divide, world_size=2, timeout_s=60)
    assert got == ["cp=2 must divide n_kv_head=1 for method='ulysses' (its all-to-all gives each rank whole heads "
                   "of the whole sequence)"] * 2
