"""Context parallelism in the rule book (course_lib.dims) and the estimator (course_lib.estimate):
activations divided by cp, the causal work per rank, the ring's exposed time, the planner's
choice at a long sequence, and Llama 3's 128K stage (notebook 09)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from course_lib import dims as D
from course_lib.comm.costmodel import CLUSTERS, LinkModel
from course_lib.comm.measured import collective_time
from course_lib.estimate import LLAMA3_70B, LlamaLikeConfig, activation_bytes, model_state_bytes, per_gpu_memory
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.clusters import LONG_CONTEXT, PUBLISHED, ROCE_400, gpu_cluster, published_estimate
from course_lib.estimate.context import attention_imbalance, attention_pairs, cp_costs, ring_exposed
from course_lib.estimate.planner import plan
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.estimate.traffic import seconds, step_traffic
from course_lib.model import GPTConfig
from course_lib.parallel.mesh import mesh_groups
from course_lib.units import GB

GPT = GPTConfig(vocab_size=64, block_size=48, n_layer=2, n_head=4, d_model=32)
LLAMA = LlamaLikeConfig(vocab_size=64, n_layer=2, d_model=64, n_head=8, n_kv_head=2, d_ff=96, block_size=96)


def _message(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


# ---------------------------------------------------------------- memory: activations / cp

@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("attention, method", [("fused", "ring"), ("naive", "ulysses"), ("fused", "allgather")])
def test_every_activation_term_falls_by_cp_exactly(config, attention, method):
    """s/cp tokens per rank: every term linear in the tokens falls by cp, and so do the naive
    kernel's scores (s/cp queries x s keys); all-gather adds the other ranks' K and V."""
    seq, b = 48, 2
    one = activation_bytes(config, b, seq, 2, attention=attention, tp=2, sequence_parallel=True)
    for cp in (2, 4):
        kv_heads = getattr(config, "kv_heads", None) or config.n_kv_head  # GPTConfig: None means n_head
        if method == "ulysses" and ((config.n_head // 2) % cp or (kv_heads // 2) % cp):
            continue  # Ulysses needs cp | a tp = 2 rank's heads (and KV heads)
        got = activation_bytes(config, b, seq, 2, attention=attention, tp=2, sequence_parallel=True, cp=cp,
                               cp_method=method)
        extra = dict(got["layer_terms"])
        gathered = extra.pop("gathered k, v", 0)
        assert extra == {k: v // cp for k, v in one["layer_terms"].items()}, cp
        assert all(v % cp == 0 for v in one["layer_terms"].values())  # so the comparison above is exact
        kv = config.d_model if isinstance(config, GPTConfig) else config.n_kv_head * config.d_model // config.n_head
        assert gathered == (2 * b * (seq - seq // cp) * 2 * kv // 2 if method == "allgather" else 0)
        assert (got["input_side"], got["output_side"]) == (one["input_side"] // cp, one["output_side"] // cp)


def test_zero_shards_over_dp_times_cp_and_the_layout_counts_cp_ranks():
    mem = per_gpu_memory(LLAMA, 1, 96, "bf16_mixed", zero_stage=1, dp=2, cp=4)
    params = mem["params_on_gpu"]
    assert mem["optimizer"] == model_state_bytes(params, "bf16_mixed", 1, 8)["optimizer"]
    assert mem["n_gpus"] == 8
    dims = D.ParallelDims(dp=2, cp=4, zero=1)
    assert memory_per_rank(LLAMA, dims, 2, 96)["optimizer"] == mem["optimizer"]


# ---------------------------------------------------------------- the causal work per rank

def _brute_force(seq, cp, load_balance):
    c = seq // (2 * cp if load_balance else cp)
    chunks = [(r, 2 * cp - 1 - r) if load_balance else (r,) for r in range(cp)]
    return [sum(1 for i in mine for q in range(i * c, (i + 1) * c) for k in range(seq) if k <= q)
            for mine in chunks]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("load_balance", [True, False])
def test_the_work_closed_form_equals_a_brute_force_count(cp, load_balance):
    for seq in (2 * cp * 3, 2 * cp * 7):  # 7 chunks: not a power of two
        pairs = attention_pairs(seq, cp, load_balance)
        assert pairs == _brute_force(seq, cp, load_balance)
        assert sum(pairs) == seq * (seq + 1) // 2
        assert attention_imbalance(seq, cp, load_balance) == cp * max(pairs) / sum(pairs)
    if load_balance:
        assert len(set(pairs)) == 1  # zig-zag: the same work on every rank
    elif cp > 1:  # contiguous: the last rank's share tends to (2cp-1)/cp^2 of the triangle
        big = attention_pairs(2**16 * cp, cp, False)
        assert math.isclose(big[-1] / sum(big), (2 * cp - 1) / cp**2, rel_tol=1e-4)  # O(1/c) from c(c+1)/2


# ---------------------------------------------------------------- the rule book

def test_the_rule_book_refuses_a_bad_cp_before_any_rank_starts():
    cases = [(D.ParallelDims(cp=5), 48, "seq_len=48 must be divisible by 2*cp = 10 chunks"),
             (D.ParallelDims(cp=5, cp_load_balance=False), 48, "seq_len=48 must be divisible by cp = 5 equal shards"),
             (D.ParallelDims(cp=3, cp_method="ulysses"), 48, "cp=3 must divide n_head=4 for method='ulysses'"),
             (D.ParallelDims(cp=2, cp_method="zigzag"), 48, "cp_method"),
             (D.ParallelDims(cp=2, tp=4, sequence_parallel=True), 12, "sequence length 6 must be divisible by tp=4")]
    for dims, seq, rule in cases:
        got = _message(lambda: dims.check_model(GPT, 2, seq))
        assert got is not None and rule in got, (dims, got)
        # the estimator names the same rule first
        assert _message(lambda: memory_per_rank(GPT, dims, 2, seq)) == got
        assert _message(lambda: step_time(GPT, dims, _cluster(dims.world_size), 2, seq)) == got
    with pytest.raises(ValueError, match=r"pp\*dp\*ep\*cp\*tp = 1\*2\*1\*2\*1 = 4 must equal world_size=2"):
        D.ParallelDims(dp=2, cp=2).check(2, GPT, 2)


def test_label_and_describe_name_cp_only_when_it_is_used():
    assert D.ParallelDims(dp=2, tp=2, pp=2).label() == "dp2·tp2·pp2"
    assert D.ParallelDims(dp=8, tp=8, pp=16, cp=16).label() == "dp8·tp8·pp16·cp16"
    assert D.ParallelDims(dp=2, cp=4, cp_method="allgather", cp_load_balance=False).describe(8) == \
        "dp2·tp1·pp1·cp4·allgather·no-lb·mb4"
    assert D.ParallelDims(dp=2, cp_method="ulysses", cp_load_balance=False).describe() == "dp2·tp1·pp1"
    assert D.ParallelDims(cp=4).world_size == 4 and D.ParallelDims(dp=2, cp=4).replicas == 2


# ---------------------------------------------------------------- the mesh

@pytest.mark.parametrize("sizes", [dict(pp=2, dp=2, ep=1, tp=2), dict(pp=1, dp=2, ep=2, tp=2)])
def test_at_cp_1_every_coordinate_and_group_is_as_before(sizes):
    world = math.prod(sizes.values())
    assert D.groups(sizes) == mesh_groups(world, **sizes)
    with_cp = {**sizes, "cp": 1}
    dims = D.ParallelDims(**sizes)
    assert dims.sizes() == with_cp  # every axis, cp of size 1 included: make_mesh's five
    for r in range(world):
        c = D.coordinates(r, sizes)
        assert list(c) == ["pp", "dp", "ep", "tp"]
        assert D.coordinates(r, with_cp) == {**c, "cp": 0}
        assert D.rank_of(c, with_cp) == r == D.rank_of(c, sizes)
    groups = D.groups(with_cp)
    assert groups.pop("cp") == [[r] for r in range(world)]
    assert groups == D.groups(sizes)
    assert D.groups(sizes, D.NAIVE) == D.groups(sizes, ("tp", "ep", "dp", "pp"))  # the order before cp


def test_cp_sits_between_tp_and_ep():
    sizes = D.ParallelDims(pp=2, dp=2, cp=2, tp=2).sizes()
    assert list(sizes) == ["pp", "dp", "ep", "cp", "tp"]
    g = D.groups(sizes)
    # cp groups: tp-strided pairs inside blocks of cp*tp = 4 ranks; dp, pp strides grow by cp
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["tp"][:2] == [[0, 1], [2, 3]] and g["dp"][0] == [0, 4] and g["pp"][0] == [0, 8]
    assert D.coordinates(7, sizes) == {"pp": 0, "dp": 1, "ep": 0, "cp": 1, "tp": 1}
    assert [D.link_of(d, sizes, 4) for d in ("tp", "cp", "dp", "pp")] == ["intra", "intra", "inter", "inter"]
    assert D.link_of("cp", D.ParallelDims(dp=2).sizes(), 4) == "none"
    with pytest.raises(ValueError, match="leaves out cp, so it needs cp=1"):
        D.groups(sizes, ("pp", "dp", "ep", "tp"))


# ---------------------------------------------------------------- step time

LINK = LinkModel(alpha=1e-4, beta=1e8)


def _cluster(n, flops=1e9):
    return Cluster("test", n, n, peak_flops=2 * flops, achievable_flops=flops, memory_bytes=1e9, intra=LINK,
                   inter=LinkModel(1e-3, 1e7))


def test_the_ring_is_exposed_only_where_a_hop_outlasts_a_block_pair():
    dims = D.ParallelDims(cp=4)
    q, kv = 48 // 4, 2 * 2 * 12 * 32 * 2  # tokens per rank; K||V block: 2 rows of 12 tokens, d = 32, bf16
    t_kv = collective_time(LINK, "send", kv, 2)
    for flops, causal in ((1e9, True), (1e6, True), (1e6, False)):
        t_f = (0.5 if causal else 1.0) * 4 * 2 * q * q * 32 / flops
        got = ring_exposed(GPT, dims, 2, 48, LINK, flops, 2, causal)
        assert math.isclose(got["forward"], 3 * max(0.0, t_kv - t_f), rel_tol=1e-12)  # same float ops reordered
        assert math.isclose(got["backward"], 3 * max(0.0, 2 * t_kv - 2 * t_f) + t_kv, rel_tol=1e-12)
    slow = ring_exposed(GPT, dims, 2, 48, LINK, 1e3, 2, True)  # slow compute hides all but the last dK/dV hop
    assert slow == {"forward": 0.0, "backward": t_kv}
    assert ring_exposed(GPT, D.ParallelDims(), 2, 48, LINK, 1e9) == {"forward": 0.0, "backward": 0.0}


def test_compute_divides_by_cp_and_the_busiest_contiguous_rank_sets_the_time():
    base = step_time(GPT, D.ParallelDims(), _cluster(1), 2, 48, causal=True)
    balanced = step_time(GPT, D.ParallelDims(cp=4), _cluster(4), 2, 48, causal=True)
    contiguous = step_time(GPT, D.ParallelDims(cp=4, cp_load_balance=False), _cluster(4), 2, 48, causal=True)
    assert math.isclose(balanced["compute"], base["compute"] / 4, rel_tol=1e-12)
    attn = 3 * 4 * GPT.n_layer * 48 * GPT.d_model * 0.5 * 2 * 48  # causal attention FLOPs of the step
    extra = attn * (attention_imbalance(48, 4, False) - 1) / (4 * 1e9)
    assert math.isclose(contiguous["compute"], balanced["compute"] + extra, rel_tol=1e-12)
    assert balanced["flops"] == base["flops"]  # model FLOPs do not change with the layout


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_cp_records_are_priced_on_cp_s_link_and_the_ring_only_where_exposed(method):
    dims = D.ParallelDims(cp=4, cp_method=method, microbatches=2)
    cluster = _cluster(4, flops=1e6)
    t = step_time(GPT, dims, cluster, 4, 48, recipe="fp32", causal=True)
    records = step_traffic(GPT, dims, 4, 48, 4)["cp"]
    assert t["calls"]["cp"] == sum(r.calls for r in records)
    total = sum(seconds(r, LINK) for r in records)
    assert math.isclose(t["cp_total"], total, rel_tol=1e-12)
    if method != "ring":  # nothing overlaps them in the course's runtime: priced whole
        assert t["cp"] == t["cp_total"] > 0
    else:
        ring = ring_exposed(GPT, dims, 2, 48, LINK, 1e6, 4, True)
        assert math.isclose(t["cp"], GPT.n_layer * 2 * (ring["forward"] + ring["backward"]), rel_tol=1e-12)
        # the K||V block the exposed time sends is the records' hop
        assert {r.nbytes for r in records if r.nbytes} == {2 * 2 * 12 * GPT.d_model * 4}
        assert 0 < t["cp"] < t["cp_total"]


def test_the_other_axes_carry_a_cp_rank_s_tokens_and_dp_reduces_over_cp():
    """tp's collectives act on the rank's T/cp tokens: tp at cp=2 over 48 tokens is tp at cp=1 over
    24; the gradients are averaged over the dp * cp ranks holding the same weights."""
    two = step_time(GPT, D.ParallelDims(tp=2, cp=2), _cluster(4), 2, 48, recipe="fp32")
    half = step_time(GPT, D.ParallelDims(tp=2), _cluster(2), 2, 24, recipe="fp32")
    assert two["tp"] == half["tp"] > 0
    dp = step_traffic(GPT, D.ParallelDims(cp=2), 2, 48, 4)["dp"]
    assert dp and {r.group for r in dp if not r.report} == {2}


# ---------------------------------------------------------------- the planner and Llama 3 at 128K

def test_the_planner_picks_cp_where_memory_forces_it():
    """Llama 3 70B on one sequence of 128K tokens, 32 H100s: no layout without cp fits."""
    config = replace(LLAMA3_70B, block_size=131072)
    kw = dict(micro_batches=(1,), zero_stages=(1,), recomputes=("none", "full"), schedules=("1f1b",), causal=True)
    p = plan(config, gpu_cluster("H100 SXM 80 GB", 32), 1, 131072, **kw)
    assert p.best.dims.cp > 1 and p.best.fits
    assert not any(c.fits for c in p.candidates if c.dims.cp == 1)
    short = plan(config, gpu_cluster("H100 SXM 80 GB", 32), 4, 8192, **kw)  # 8K fits without cp: not searched
    assert {c.dims.cp for c in short.candidates} == {1}


def test_llama3_405b_at_128k_fits_with_cp_16_and_not_without():
    name = "Llama 3 405B 128K on 16k H100"
    run = LONG_CONTEXT[name]
    assert run["dims"].world_size == run["cluster"].n_gpus == 16384
    assert run["global_batch"] * run["seq"] == 16 * 2**20  # 16M tokens per batch
    ours = published_estimate(name)
    assert ours["fits"] and ours["memory"]["total"] <= 80 * GB
    without = published_estimate(name, cp=1)
    assert not without["fits"] and without["memory"]["total"] > 80 * GB
    assert without["memory"]["activations"] > 10 * ours["memory"]["activations"]
    assert ours["time"]["total"] > 0 and 0 < ours["time"]["mfu"] < 1


def test_llama3_405b_runs_are_priced_on_roce_at_ndr_s_figures():
    # Dubey et al. 2024 §3.3.1: the 405B trained on RoCE, at the 400 Gb/s per GPU of NDR InfiniBand
    ndr = CLUSTERS["NDR InfiniBand 400 Gb/s (inter-node)"]
    assert (ROCE_400.alpha, ROCE_400.beta) == (ndr.alpha, ndr.beta) and "RoCE" in ROCE_400.name
    for run in (PUBLISHED["Llama 3 405B on 16k H100"], *LONG_CONTEXT.values()):
        h100 = gpu_cluster("H100 SXM 80 GB", 16384)
        assert run["cluster"].inter is ROCE_400 and run["cluster"] == replace(h100, inter=ROCE_400)
    assert PUBLISHED["GPT-3 175B on 1024 A100"]["cluster"].inter is CLUSTERS["HDR InfiniBand 200 Gb/s (inter-node)"]


def test_cp_costs_for_the_widget():
    row = cp_costs(LLAMA, 4096, 4, "ring")  # beyond block_size: costed with a longer window
    one = cp_costs(LLAMA, 4096, 1, "ring")
    assert row["seq_per_rank"] == 1024 and row["activations_per_layer"] * 4 == one["activations_per_layer"]
    assert one["bytes_per_layer"] == 0 and row["bytes_per_layer"] > 0
    assert row["attention_pairs"] == attention_pairs(4096, 4) and row["imbalance"] == 1.0
    with pytest.raises(ValueError, match="cp=3 must divide n_head=8 for method='ulysses'"):
        cp_costs(LLAMA, 4096 * 3, 3, "ulysses")
