"""The step-time model, the memory model per rank and the planner (notebook 11)."""

import math

import pytest

from course_lib.comm.costmodel import LinkModel, predict_time
from course_lib.estimate import GPT3_175B, flops_per_token, per_gpu_memory
from course_lib.estimate.clusters import PUBLISHED, gpu_cluster
from course_lib.estimate.planner import plan
from course_lib.dims import ParallelDims
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.pp.bubble import bubble_fraction

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=32)


def same(a: float, b: float) -> bool:
    """A model term against its formula written out, on made-up inputs: float64 in another order,
    ~1e-16 relative apart (a few digits more where two terms are subtracted); math.isclose's
    rel_tol 1e-9 is far above that, and far below a wrong term."""
    return math.isclose(a, b, rel_tol=1e-9)

LINK = LinkModel(alpha=1e-4, beta=1e8)


def cpu_cluster(n=8, overlap=0.0, memory=1e9):
    return Cluster("test", n, n, peak_flops=2e9, achievable_flops=1e9, memory_bytes=memory, intra=LINK,
                   inter=LinkModel(1e-3, 1e7), memory_bandwidth=1e9, overlap=overlap)


def test_compute_term_is_flops_over_rate():
    lay = ParallelDims(dp=2, microbatches=2)
    t = step_time(CFG, lay, cpu_cluster(2), 16, recipe="fp32")
    flops = flops_per_token(CFG, 32) * 2 * 2 * 4 * 32
    assert t["flops"] == flops and t["batch"] == 16
    assert same(t["compute"], flops / (2 * 1e9))
    assert same(t["mfu"], flops / (t["total"] * 2 * 2e9))


def test_dp_traffic_is_a_ring_all_reduce_hidden_by_backward():
    lay = ParallelDims(dp=4)
    no = step_time(CFG, lay, cpu_cluster(4, overlap=0.0), 8, recipe="fp32")
    full = step_time(CFG, lay, cpu_cluster(4, overlap=1.0), 8, recipe="fp32")
    n_params = per_gpu_memory(CFG, 2, 32, "fp32", dp=4)["params_on_gpu"]
    assert same(no["dp_total"], predict_time("ring", 4 * n_params, 4, LINK))
    assert no["dp_exposed"] == no["dp_total"]
    assert same(full["dp_exposed"], max(0.0, full["dp_total"] - 2 / 3 * full["compute"]))


def test_tp_traffic_is_four_all_reduces_per_layer_never_hidden():
    lay = ParallelDims(tp=4)
    t = step_time(CFG, lay, cpu_cluster(4, overlap=1.0), 2, recipe="fp32")
    # 4 per layer, the embedding's and the head input's, and the vocabulary-parallel loss's 3 small ones
    per_layer = predict_time("ring", 2 * 32 * 32 * 4, 4, LINK)
    loss = 3 * predict_time("ring", 2 * 32 * 4, 4, LINK)
    assert same(t["tp"], (4 * CFG.n_layer + 2) * per_layer + loss)
    assert t["dp_total"] == 0 and t["tp"] > 0 and t["calls"]["tp"] == 4 * CFG.n_layer + 5
    # full recomputation repeats the forward: its 2 all-reduces per layer come back
    rc = step_time(CFG, ParallelDims(tp=4, recompute="full"), cpu_cluster(4), 2, recipe="fp32")
    assert same(rc["tp"], (6 * CFG.n_layer + 2) * per_layer + loss)
    assert same(rc["recompute"], t["compute"] / 3)


def test_overheads_are_per_layer_and_micro_batch_and_per_optimizer_tensor():
    from dataclasses import replace

    from course_lib.estimate.step_time import parameter_tensors

    base = cpu_cluster(2)
    slow = replace(base, layer_overhead=1e-3, tensor_overhead=1e-4)
    lay = ParallelDims(dp=2, microbatches=3)
    a, b = step_time(CFG, lay, base, 6, recipe="fp32"), step_time(CFG, lay, slow, 6, recipe="fp32")
    assert a["overhead"] == 0 and same(b["overhead"], (CFG.n_layer + 1) * 3 * 1e-3)
    per_block, outside = parameter_tensors(CFG)
    assert per_block * CFG.n_layer + outside == len(list(GPT(CFG, 0).parameters()))
    assert same(b["optimizer"] - a["optimizer"], (per_block * CFG.n_layer + outside) * 1e-4)
    # ZeRO steps flat shards (one per parameter group): the per-tensor cost nearly vanishes
    z = step_time(CFG, ParallelDims(dp=2, zero=1), slow, 6, recipe="fp32")
    z0 = step_time(CFG, ParallelDims(dp=2, zero=1), base, 6, recipe="fp32")
    assert same(z["optimizer"] - z0["optimizer"], 2 * 1e-4)
    with pytest.raises(ValueError, match="layer_overhead=-1"):
        replace(base, layer_overhead=-1)


def test_shared_cores_hide_the_bubble_only_while_cores_would_idle():
    from dataclasses import replace

    lay = ParallelDims(pp=4, microbatches=4)
    own = step_time(CFG, lay, cpu_cluster(4), 4, recipe="fp32")
    two = step_time(CFG, lay, replace(cpu_cluster(4), shared_cores=2), 4, recipe="fp32")
    four = step_time(CFG, lay, replace(cpu_cluster(4), shared_cores=4), 4, recipe="fp32")
    f = bubble_fraction(4, 4, 1)
    busy = own["total"] - own["bubble"] - own["dp_exposed"] - own["optimizer"]
    assert same(own["bubble"], busy * f / (1 - f)) and four["bubble"] == own["bubble"]
    # 4 ranks on 2 cores: alone a rank runs twice as fast; 2 * busy / (1 - f) ... here < busy: no bubble
    assert two["bubble"] == max(0.0, busy * 0.5 / (1 - f) - busy) == 0.0


def test_bubble_uses_the_schedule_formula():
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        lay = ParallelDims(pp=2, microbatches=4, virtual_stages=v, schedule=schedule)
        t = step_time(CFG, lay, cpu_cluster(2), 4, recipe="fp32")
        f = bubble_fraction(2, 4, v)
        busy = t["compute"] + t["overhead"] + t["recompute"] + t["tp"] + t["pp"] + t["ep"]
        assert same(t["bubble"] / (busy + t["bubble"]), f)


def test_link_is_the_network_when_a_group_leaves_the_node():
    c = Cluster("c", 16, 8, 1e12, 1e12, 1e12, intra=LinkModel(1e-6, 1e11), inter=LinkModel(1e-5, 1e10))
    assert c.link(8, 1) is c.intra and c.link(2, 8) is c.inter and c.link(16, 1) is c.inter


def test_memory_model_is_notebook_01s_per_layout():
    lay = ParallelDims(dp=2, tp=2, pp=2, microbatches=4, zero=1, sequence_parallel=True)
    mem = memory_per_rank(CFG, lay, 16, recipe="fp32")
    ref = per_gpu_memory(CFG, 2, 32, "fp32", 1, 2, 2, 2, sequence_parallel=True)
    assert mem == ref
    gp = memory_per_rank(CFG, ParallelDims(pp=2, microbatches=4, schedule="gpipe"), 4, recipe="fp32")
    one = memory_per_rank(CFG, ParallelDims(pp=2, microbatches=4), 4, recipe="fp32")
    assert gp["activations"] == 2 * one["activations"]  # all 4 micro-batches in flight, not 2


def test_planner_keeps_what_fits_fastest_first():
    p = plan(CFG, cpu_cluster(8), 16, recipe="fp32")
    totals = [c.time["total"] for c in p.ranked]
    assert totals == sorted(totals) and all(c.fits for c in p.ranked)
    assert p.best.dims.world_size == 8 and p.best.time["batch"] == 16 and p.best.batch_size == 16
    assert "biggest cost term" in p.explain()
    # a memory limit below the fastest layout's footprint makes memory the binding constraint
    fastest = min(p.candidates, key=lambda c: c.time["total"])
    tight = plan(CFG, cpu_cluster(8, memory=fastest.memory["total"] - 1), 16, recipe="fp32")
    assert tight.best.memory["total"] < fastest.memory["total"]
    assert "binding constraint: memory" in tight.explain()


def test_planner_on_published_clusters_returns_a_fitting_layout():
    d = PUBLISHED["GPT-3 175B on 1024 A100"]
    p = plan(d["config"], d["cluster"], d["global_batch"], d["seq"])
    assert p.best.memory["total"] <= d["cluster"].memory_bytes
    assert 0 < p.best.time["mfu"] < GEMM_CAP(d["cluster"])
    published = step_time(d["config"], d["dims"], d["cluster"], d["global_batch"], d["seq"])
    assert published["total"] >= p.best.time["total"] or not p.best.fits


def GEMM_CAP(cluster):
    # the cluster's own achievable / peak ratio (spec numbers), + 1e-12 for the float64 rounding of
    # an MFU computed at exactly that rate
    return cluster.achievable_flops / cluster.peak_flops + 1e-12


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "tp=3 must divide n_head=4"),
    (dict(pp=3, microbatches=3), None),  # 4 blocks on 3 stages: 2 + 1 + 1, as the runtime splits them
    (dict(pp=5, microbatches=5), "n_layer=4 blocks cannot fill 5 stages"),
    (dict(pp=2, virtual_stages=2, microbatches=2, schedule="interleaved_1f1b"), None),
    (dict(pp=4, microbatches=2), None),  # m < pp runs (every micro-batch in the warm-up): costed
    (dict(pp=4, virtual_stages=2, microbatches=2, schedule="interleaved_1f1b"),
     "microbatches=2 must be a multiple of the pp=4 ranks"),
    (dict(virtual_stages=2), "virtual_stages=2 needs pp > 1"),
    (dict(pp=2, virtual_stages=2, microbatches=2), "needs schedule='interleaved_1f1b'"),
    (dict(ep=2), "ep=2 needs an MoE model"),
    (dict(zero=4), "zero=4"),
    (dict(recompute="some"), "recompute='some'"),
    (dict(tp=0), "tp=0"),
    (dict(dp=2, microbatches=4), "microbatches=4 must divide the per-replica batch"),  # 30 / 2 = 15 rows
])
def test_bad_layouts_are_named(kwargs, message):
    def build():
        lay = ParallelDims(**kwargs)
        return step_time(CFG, lay, cpu_cluster(8), 30, recipe="fp32")
    if message is None:
        assert build()["total"] > 0
    else:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            build()


def test_impossible_plans_are_named():
    with pytest.raises(ValueError, match="needs dp\\*ep\\*tp\\*pp = 16 devices"):
        step_time(CFG, ParallelDims(dp=16), cpu_cluster(8), 16)
    with pytest.raises(ValueError, match="no layout fits"):
        plan(CFG, cpu_cluster(8, memory=1e3), 16, recipe="fp32")
    with pytest.raises(ValueError, match="global_batch=7"):
        plan(CFG, cpu_cluster(3), 7)  # 3 devices: only dp=3 divides 4 heads and 4 layers
    with pytest.raises(ValueError, match="seq=64 must be <= block_size=32"):
        plan(CFG, cpu_cluster(8), 16, seq=64)
    with pytest.raises(ValueError, match="gpu='TPU'"):
        gpu_cluster("TPU", 8)


def test_gpt3_predicted_mfu_is_in_a_sane_range():
    c = gpu_cluster("A100 SXM 80 GB", 1024)
    t = step_time(GPT3_175B, PUBLISHED["GPT-3 175B on 1024 A100"]["dims"], c, 1536, 2048)
    # the model on spec-sheet inputs (a formula, not a measurement)
    assert 0.2 < t["mfu"] < 0.75 and t["compute"] == max(t[k] for k in ("compute", "tp", "bubble", "dp_exposed"))


# ----------------------------------------------------------------------------- calibration, validation
from course_lib.measure.calibrate import calibrate, cluster_from_dict, cluster_to_dict, median_of_rounds  # noqa: E402
from course_lib.measure.validation import compare, load_validation, spearman  # noqa: E402


def test_spearman_is_the_rank_correlation():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 400]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert same(spearman([1, 2, 3], [1, 3, 2]), 0.5)
    assert same(spearman([1, 1, 2], [1, 2, 3]), 0.8660254037844387)  # ties share their mean rank
    with pytest.raises(ValueError, match="two equally long"):
        spearman([1], [1])


def test_median_of_rounds_keeps_each_quantity_at_its_median_round():
    """Every probed quantity at its median over the rounds, each on its own: three rounds whose
    fastest values come from different rounds give neither the fastest nor the first."""
    def probe(matmul, model, flat, table):
        return {"matmul": matmul, "bandwidth": matmul, "model": model,
                "recipes": {"bf16_autocast": [2 * t for t in model]},
                "optimizer": {"tensors": 2 * flat, "flat": flat, "n_tensors": 5, "numel": 9},
                "table": {"all_reduce": {"2": [[4, 8], table]}},
                "table_back_to_back": {"send": {"2": [[4, 8], [t / 2 for t in table[::-1]]]}}}

    rounds = [probe(1.0, [5.0, 1.0], 3.0, [1.0, 4.0]), probe(2.0, [4.0, 2.0], 2.0, [2.0, 3.0]),
              probe(3.0, [6.0, 3.0], 1.0, [3.0, 5.0])]
    assert median_of_rounds(rounds) == probe(2.0, [5.0, 2.0], 2.0, [2.0, 4.0])
    assert median_of_rounds(rounds[:1]) == rounds[0]
    assert rounds[0] == probe(1.0, [5.0, 1.0], 3.0, [1.0, 4.0])  # the rounds are left as they were


def test_calibration_without_a_fitting_line_falls_back_to_the_largest_probe(tiny_config):
    """Model times that do not grow with the work (a loaded machine) fit no line: the rate is the
    largest micro-batch's FLOP/s and no fixed part is claimed (was a ValueError from the fit)."""
    from course_lib.measure.calibrate import MICRO_BATCHES, cluster_from_probes
    from course_lib.estimate.compute import flops_per_token

    seq = tiny_config.block_size
    flat = {"tensors": 2.0, "flat": 1.0, "n_tensors": 5, "numel": 9}
    table = {"all_reduce": {"2": [[4, 8], [1.0, 1.0]]}}
    rank = {"matmul": 1.0, "bandwidth": 1.0, "model": [4.0, 3.0, 2.0, 1.0], "optimizer": flat, "table": table}
    cluster, raw = cluster_from_probes([rank, rank], tiny_config, 1, seq, memory_bytes=1.0)
    largest = flops_per_token(tiny_config, seq) * MICRO_BATCHES[-1] * seq
    assert cluster.achievable_flops == largest / 1.0  # the same division
    assert cluster.layer_overhead == 0.0 and raw["model_fixed_seconds"] == 0.0
    assert cluster.intra.fit is None  # the all-reduce times do not grow either


def test_calibration_on_two_ranks_feeds_the_model(tiny_config):
    cluster, raw = calibrate(2, tiny_config, micro_batch=2, timeout_s=120, sizes=(4, 1 << 14, 1 << 18))

    def measured(x):
        """A measured or fitted number (seconds, FLOP/s, bytes/s): its size depends on the machine
        and its load, so only its type, finiteness and sign are checked; >= 0 holds by construction
        (monotonic-clock durations; fits clamped at 0 or rejected unless the slope is > 0)."""
        return isinstance(x, float) and math.isfinite(x) and x >= 0

    assert measured(cluster.achievable_flops) and measured(cluster.layer_overhead)  # was layer_overhead > 0
    assert measured(cluster.tensor_overhead) and measured(cluster.memory_bandwidth)
    fit = cluster.intra.fit  # None when the all-reduce times do not grow with size (a loaded machine)
    assert fit is None or (measured(fit.alpha) and measured(fit.beta))
    assert cluster.overlap == 0.0 and cluster.shared_cores >= 1  # set, and a core count: not measured
    assert len(raw["matmul_flops_per_rank"]) == 2 and len(raw["model_seconds"]) == 4
    assert all(measured(x) for x in raw["model_seconds"])
    table = cluster.intra.entries
    assert set(table) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"}
    assert all(measured(t) for t in table["all_reduce"]["2"][1])
    # the same calls back to back, kept beside the table the model reads (calibrate.spacing)
    back_to_back = raw["table_back_to_back"]
    assert {op: {g: sizes for g, (sizes, _) in by.items()} for op, by in back_to_back.items()} == \
        {op: {g: sizes for g, (sizes, _) in by.items()} for op, by in table.items()}
    assert all(measured(t) for by in back_to_back.values() for _, times in by.values() for t in times)
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    t = step_time(tiny_config, ParallelDims(dp=2), cluster, 4, recipe="fp32")
    # every term of the model is >= 0 by construction, so the total is at least the compute term;
    # how much more (communication, overheads) depends on the measurements: not asserted
    assert measured(t["compute"]) and measured(t["total"]) and t["total"] >= t["compute"]
    # bf16 autocast measured beside fp32, and read by the model for that recipe only
    (recipe, rate16, overhead16), = cluster.recipe_rates
    assert recipe == "bf16_autocast" and measured(rate16) and measured(overhead16)
    assert len(raw["recipes"]["bf16_autocast"]["model_seconds"]) == 3
    t16 = step_time(tiny_config, ParallelDims(dp=2), cluster, 4, recipe="bf16_autocast")
    assert t16["compute"] == t16["flops"] / (2 * rate16) and t["compute"] == t["flops"] / (2 * cluster.achievable_flops)
    with pytest.raises(ValueError, match="world_size=1"):
        calibrate(1, tiny_config)


def test_collective_checks_are_priced_once_per_checked_call(tiny_config):
    """checked_collectives: every collective call (not a point-to-point send) is preceded by an
    all-gather of CHECK_BYTES per rank over its group (course_lib.observe.checks)."""
    from course_lib.comm.measured import collective_time
    from course_lib.estimate.step_time import CHECK_BYTES
    from course_lib.observe.checks import MAX_DIMS

    assert CHECK_BYTES == (4 + MAX_DIMS) * 8  # the fingerprint: op, dtype, ndim, MAX_DIMS sizes, root; int64
    cluster = gpu_cluster("H100 SXM 80 GB", 8)
    dims = ParallelDims(dp=2, tp=2)  # every group of 2 ranks but the norm's, over all 4
    plain = step_time(tiny_config, dims, cluster, 8, recipe="fp32")
    checked = step_time(tiny_config, dims, cluster, 8, recipe="fp32", checked_collectives=True)
    calls = plain["calls"]
    per_pair = collective_time(cluster.intra, "all_gather", CHECK_BYTES * 2, 2)
    expected = (calls["tp"] + calls["dp"]) * per_pair + calls["norm"] * collective_time(
        cluster.intra, "all_gather", CHECK_BYTES * 4, 4)
    assert plain["checks"] == 0.0 and calls["tp"] > 0 and calls["dp"] > 0 and calls["norm"] == 1
    # a sum of the same products in another order: equal to float rounding
    assert checked["checks"] == pytest.approx(expected, rel=1e-12)
    assert checked["total"] == pytest.approx(plain["total"] + expected, rel=1e-12)
    pipeline = step_time(tiny_config, ParallelDims(pp=2, microbatches=2), cluster, 8, recipe="fp32",
                         checked_collectives=True)  # sends are not checked: the broadcast and norm are
    assert pipeline["checks"] < (pipeline["calls"]["pp"] + 1) * per_pair
    # with pp > 1 the busiest rank holds both ends (the embedding's, the head's and the loss's calls):
    # its checks are as many as the tp calls the model prices for it, more than rank 0 makes
    from course_lib.estimate.traffic import step_traffic

    both = ParallelDims(tp=2, pp=2, microbatches=2)
    tp = [r for r in step_traffic(tiny_config, both, 8, tiny_config.block_size, 4, 4, 4, 1)["tp"] if not r.report]
    checked = step_time(tiny_config, both, cluster, 8, recipe="fp32", checked_collectives=True)
    busiest = sum(r.priced_calls for r in tp)
    assert busiest > checked["calls"]["tp"]  # the busiest rank makes more tp calls than rank 0
    assert checked["checks"] == pytest.approx(busiest * per_pair + collective_time(
        cluster.intra, "all_gather", CHECK_BYTES * 4, 4) + per_pair, rel=1e-12)  # + the norm's, over all
    # 4 ranks, and the loss broadcast's over the 2 stages (inside the step, so priced and checked)


def test_stored_validation_compares_every_layout():
    data = load_validation()
    result = compare(data["config"], data["cluster"], data["runs"], data["batch"], data["seq"], "fp32")
    assert len(result["rows"]) == len(data["runs"]) >= 8
    # the stored run's measured times are fixed inputs here (a file), not measured by this test:
    # the model on them is a formula. A correlation is in [-1, 1]; the pick over the fastest >= 1.
    assert -1 <= result["spearman"] <= 1 and result["pick_over_best"] >= 1
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in result["rows"])


# ----------------------------------------------------------------------------- memory model = measured
def _measured_state(dims, config):
    """Rank code: notebook 10's composed model and its optimizer after one step, measured."""
    import torch

    from course_lib.observe.memory import measured_state_bytes
    from course_lib.parallel.hybrid.compose import build_hybrid, make_hybrid_optimizer, trained_module
    from course_lib.train import TrainConfig

    parts = build_hybrid(dims, config)
    module = trained_module(parts)
    optimizer = make_hybrid_optimizer(parts, TrainConfig())
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW creates its moments on the first step
    return measured_state_bytes(module, optimizer)


@pytest.mark.parametrize("sizes", [dict(dp=2, tp=2), dict(tp=2, pp=2, microbatches=2),
                                   dict(dp=2, pp=2, microbatches=2)])
def test_memory_model_equals_measured_state_of_the_busiest_rank(sizes, tiny_config):
    from course_lib.runtime import run_on_ranks

    dims = ParallelDims(**sizes)
    per_rank = run_on_ranks(_measured_state, dims, tiny_config, world_size=4, timeout_s=120)
    lay = ParallelDims(dp=dims.dp, tp=dims.tp, pp=dims.pp, microbatches=max(dims.microbatches, dims.pp))
    mem = memory_per_rank(tiny_config, lay, dims.dp * lay.microbatches, recipe="fp32")
    predicted = mem["params"] + mem["grads"] + mem["optimizer"]
    # per_gpu_memory follows TP's real split (rank_param_counts): the row-parallel biases stay
    # whole on every rank, and the vocabulary is padded to a multiple of tp (ceil(V / tp) rows)
    assert max(r["total"] for r in per_rank) == predicted, (per_rank, mem)
