"""The estimator at tp > n_kv_head (grouped-query attention, KV heads copied on tp / n_kv_head ranks by
course_lib.parallel.tp): the rule book, the runtime and the estimator accept the same layouts, and
what it counts equals a real run on gloo ranks at tp = 4 with n_kv_head = 2 and 1: each rank's
parameters (the copied head, not kv / tp), the bytes and calls the tracer sees (the all-reduces
that hand the copies their rows and sum their gradients back), the matmul FLOPs each rank runs."""

import sys
from dataclasses import replace

import cloudpickle
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib import run_on_ranks
from course_lib.data import CharDataset, get_batch
from course_lib.dims import ParallelDims, copies_kv
from course_lib.estimate import LLAMA3_70B, flops_per_token, per_gpu_memory, traffic
from course_lib.estimate.clusters import gpu_cluster
from course_lib.estimate.params import kv_copy_rows, kv_rows_per_rank
from course_lib.estimate.per_gpu import rank_param_counts
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.estimate.traffic.records import padded_vocab, replica_group_params
from course_lib.model import GPT, GPTConfig
from course_lib.observe.memory import measured_state_bytes
from course_lib.parallel.hybrid import run_hybrid
from course_lib.parallel.tp import apply_tensor_parallel
from course_lib.train import TrainConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

VOCAB = CharDataset("train").vocab_size  # 97: padded to 100 at tp = 4
SEQ = 32


def config(n_kv, **kw):
    return GPTConfig.tiny(VOCAB, block_size=SEQ, n_kv_head=n_kv, **kw)


def test_the_rule_book_and_the_estimator_accept_copied_kv_heads_for_the_course_gpt_only():
    for n_kv in (1, 2):
        cfg, dims = config(n_kv), ParallelDims(tp=4, sequence_parallel=True)
        assert copies_kv(cfg.shape) and kv_copy_rows(cfg, 4) == 2 * (4 - n_kv) * 16  # 16 = d_head
        dims.check_model(cfg, 4)
        memory_per_rank(cfg, dims, 4, recipe="fp32")
        step_time(cfg, dims, gpu_cluster("H100 SXM 80 GB", 8), 4, recipe="fp32")
    assert kv_copy_rows(config(2), 2) == kv_copy_rows(config(4), 4) == 0  # tp | n_kv_head: split, no copy
    # a Llama-like config is costed as Megatron splits it (tp | n_kv_head): still refused at tp > n_kv_head
    assert not copies_kv(LLAMA3_70B.shape)
    with pytest.raises(ValueError, match=r"tp=16 must divide n_kv_head=8$"):
        per_gpu_memory(LLAMA3_70B, tp=16)


def _held(n_kv, bias, tie):
    """Rank code: (parameters, parameter bytes) this rank holds in the tensor-parallel GQA model."""
    model = apply_tensor_parallel(GPT(config(n_kv, bias=bias, tie_weights=tie), seed=0), None, False)
    return sum(p.numel() for p in model.parameters()), measured_state_bytes(model)["params"]


@pytest.mark.parametrize("n_kv", [2, 1])
@pytest.mark.parametrize("bias,tie", [(True, True), (False, False)], ids=["bias-tied", "no-bias-untied"])
def test_parameters_per_rank_equal_a_real_run_at_tp4(n_kv, bias, tie):
    cfg, tp = config(n_kv, bias=bias, tie_weights=tie), 4
    held = run_on_ranks(_held, n_kv, bias, tie, world_size=tp, timeout_s=120)
    counts = rank_param_counts(cfg, tp)
    for numel, nbytes in held:  # exact integers: every rank holds the same shapes
        assert numel == counts["dense"] + counts["expert"]
        assert nbytes == per_gpu_memory(cfg, 2, SEQ, recipe="fp32", tp=tp)["params"] == 4 * numel
    assert sum(n for n, _ in held) == replica_group_params(cfg, ParallelDims(tp=tp))
    # the copies are what kv / tp would miss: each rank holds one whole head (d_head rows of K and of V)
    b, d, L = int(bias), cfg.d_model, cfg.n_layer
    assert kv_rows_per_rank(cfg, tp) == 16
    split = held[0][0] - L * 2 * (16 - cfg.kv_dim // tp) * (d + b)  # what K, V rows of kv / tp would hold
    assert split * tp + L * kv_copy_rows(cfg, tp) * (d + b) == sum(n for n, _ in held) and split < held[0][0]


ONE_STEP = TrainConfig(steps=1, batch_size=8, lr=1e-2, grad_clip=0.05, progress=False)
LAYOUTS = [(2, ParallelDims(tp=4)), (1, ParallelDims(tp=4, sequence_parallel=True)),
           (1, ParallelDims(dp=2, tp=2, recompute="full", microbatches=2))]


@pytest.mark.parametrize("n_kv, dims", LAYOUTS, ids=[f"kv{k}-{d.describe()}" for k, d in LAYOUTS])
def test_traced_bytes_and_calls_equal_the_records(n_kv, dims):
    """As tests/test_traffic.py holds every axis against the tracer: rank 0's calls per axis and the
    bytes sent summed over the ranks (dp: its flat units padded to a multiple of dp, a few bytes more)."""
    cfg = replace(config(n_kv), n_layer=2, block_size=16)
    results = run_hybrid(dims, cfg, ONE_STEP, trace=True, timeout_s=240)
    records = traffic.step_traffic(cfg, dims, ONE_STEP.batch_size)
    copies = [r for r in records["tp"] if r.what.startswith("copied KV heads")]
    assert len(copies) == 2 and all(r.op == "all_reduce" for r in copies)  # the weight rows and the bias rows
    world_axis = "tp" if dims.tp == dims.world_size else "world"
    where = {axis: axis for axis in ("tp", "pp", "ep", "dp")} | {"norm": world_axis}
    want_bytes, want_calls = {}, {}
    for axis, rows in records.items():
        key = where[axis]
        want_bytes[key] = want_bytes.get(key, 0) + sum(r.world_bytes for r in rows)
        want_calls[key] = want_calls.get(key, 0) + sum(r.calls for r in rows)
    measured = {}
    for r in results:
        for dim, row in r.traffic.items():
            measured[dim] = measured.get(dim, 0) + row["bytes_sent"]
    calls = {dim: row["calls"] for dim, row in results[0].traffic.items() if dim != "other"}
    assert calls == {k: v for k, v in want_calls.items() if v}, records
    assert measured["tp"] == want_bytes["tp"]
    if dims.dp > 1:  # at most dp - 1 elements of padding per flat unit (2 groups) and rank, 4 bytes each
        assert want_bytes["dp"] <= measured["dp"] <= want_bytes["dp"] + 2 * (dims.dp - 1) * 4 * dims.world_size
    assert all(r.calls > 0 for r in copies)  # without them the tracer's tp calls would not be matched


def _matmul_flops(n_kv):
    """Rank code: the matmul FLOPs this rank runs in one forward and backward (FlopCounterMode)."""
    cfg = config(n_kv)
    model = apply_tensor_parallel(GPT(cfg, seed=0), None, False)
    x, y = get_batch(CharDataset("train", SEQ), 2, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(x, y)[1].backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("n_kv", [2, 1])
def test_every_copy_multiplies_the_flops_are_counted(n_kv):
    cfg, tp, tokens = config(n_kv), 4, 2 * SEQ
    per_rank = run_on_ranks(_matmul_flops, n_kv, world_size=tp, timeout_s=120)
    assert len(set(per_rank)) == 1  # the same shapes on every rank
    # the model's FLOPs (flops_per_token: K and V kv wide), plus what the ranks multiply beyond
    # one copy: the copied K, V rows and the vocabulary padding (100 - 97 rows of the head), x 3
    # for training; counted, not measured: exact
    extra = 3 * 2 * tokens * cfg.d_model * (cfg.n_layer * kv_copy_rows(cfg, tp) + padded_vocab(cfg, tp) - VOCAB)
    assert sum(per_rank) == flops_per_token(cfg, SEQ) * tokens + extra
    # the step-time model prices that copies' share (the padding is not priced)
    cluster, dims = gpu_cluster("H100 SXM 80 GB", 8), ParallelDims(tp=tp)
    copied = step_time(cfg, dims, cluster, 2, recipe="fp32")["compute"]
    rate = cluster.rates("fp32")[0]
    assert copied == pytest.approx(flops_per_token(cfg, SEQ) * tokens / (tp * rate)
                                   + 6 * cfg.n_layer * kv_copy_rows(cfg, tp) * cfg.d_model * tokens / (tp * rate),
                                   rel=1e-12)  # float sums in another order


def test_single_process_flops_count_gqa_k_and_v_kv_wide():
    for n_kv in (1, 2, 4):
        cfg = config(n_kv)
        model = GPT(cfg, seed=0)
        x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            model(x, x)[1].backward()
        assert flops_per_token(cfg, SEQ) * 2 * SEQ == counter.get_total_flops()  # counted: exact


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_the_copies_records_hold_beside_context_parallel(method):
    """tp = 2 > n_kv_head = 1 beside cp = 2: tp's traced calls and bytes (the copies' all-reduces
    included) equal tp_traffic's. cp's own bytes (the rank's one copied KV head, d_head wide, sent
    un-repeated) equal cp_traffic's in tests/test_cp_gqa.py."""
    cfg = replace(config(1), n_layer=2, block_size=16)
    dims = ParallelDims(tp=2, cp=2, cp_method=method)
    results = run_hybrid(dims, cfg, ONE_STEP, trace=True, timeout_s=240)
    records = traffic.step_traffic(cfg, dims, ONE_STEP.batch_size)["tp"]
    assert any(r.what.startswith("copied KV heads") for r in records)
    assert results[0].traffic["tp"]["calls"] == sum(r.calls for r in records)
    assert sum(r.traffic["tp"]["bytes_sent"] for r in results) == sum(r.world_bytes for r in records)
    assert kv_rows_per_rank(cfg, 2) == 16 == 2 * (cfg.kv_dim // 2)  # one whole head, not kv / tp


def _message(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def test_rule_book_estimator_and_runtime_agree_on_gqa_layouts():
    """As tests/test_dims.py's grid, on grouped-query models: every layout the rule book accepts is
    costed; every one it refuses, the estimator and the runtime refuse with the same message."""
    accepted = refused = 0
    for n_head, n_kv in ((4, 1), (4, 2), (6, 3), (6, 2)):
        cfg = GPTConfig(vocab_size=32, block_size=12, n_layer=2, n_head=n_head, d_model=8 * n_head, n_kv_head=n_kv)
        for tp, cp, sp in ((1, 1, False), (2, 1, True), (3, 1, False), (4, 1, False), (4, 1, True), (2, 2, False),
                           (6, 1, False)):
            d = ParallelDims(tp=tp, cp=cp, sequence_parallel=sp)
            rule = _message(lambda: d.check_model(cfg, 4))
            cluster = gpu_cluster("H100 SXM 80 GB", 8)
            if rule is None:
                assert step_time(cfg, d, cluster, 4, recipe="fp32")["total"] > 0
                assert memory_per_rank(cfg, d, 4, recipe="fp32")["total"] > 0
                accepted += 1
            else:
                for cost in (lambda: step_time(cfg, d, cluster, 4, recipe="fp32"),
                             lambda: memory_per_rank(cfg, d, 4, recipe="fp32"),
                             lambda: run_hybrid(d, cfg, ONE_STEP)):
                    assert _message(cost) == rule, (n_head, n_kv, tp, cp, rule, _message(cost))
                refused += 1
    assert accepted and refused
