"""One traffic model per mesh axis (course_lib.estimate.traffic): its records held against what the
course's runtime sends (CommTracer on gloo ranks), and read by both the byte accounting of
notebook 10 (parallel.topology) and the step-time model of notebook 11 (estimate.step_time)."""

from dataclasses import replace

import pytest

from course_lib.comm.costmodel import LinkModel
from course_lib.comm.measured import collective_time
from course_lib.data import VOCAB_SIZE
from course_lib.dims import ParallelDims
from course_lib.estimate import traffic
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.step_time import step_time
from course_lib.model import GPTConfig
from course_lib.parallel import dp, ep, pp, topology, tp, zero
from course_lib.parallel.hybrid import run_hybrid
from course_lib.train import TrainConfig

DENSE = GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=2, n_head=2, d_model=16)
MOE = replace(DENSE, n_experts=4, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.0)
ONE_STEP = TrainConfig(steps=1, batch_size=8, lr=1e-2, grad_clip=0.05, progress=False)
CLUSTER = Cluster("c", 8, 8, 1e9, 1e9, 1e9, LinkModel(1e-5, 1e9), LinkModel(1e-5, 1e9))

# (model, layout): the collectives where the step-time model departs from the runtime (sequence
# parallelism, recomputation, bf16 messages, tp on the first of two stages, interleaving, the
# routing counts); where one axis spans the world, rank 0's calls of it include the norm's
LAYOUTS = [
    (DENSE, ParallelDims(tp=2, sequence_parallel=True, recompute="full", precision="bf16")),
    (DENSE, ParallelDims(tp=2, pp=2, microbatches=2, precision="bf16")),
    (replace(DENSE, n_layer=4), ParallelDims(pp=2, virtual_stages=2, schedule="interleaved_1f1b", microbatches=2)),
    (MOE, ParallelDims(ep=2, microbatches=2)),
    (DENSE, ParallelDims(dp=2, tp=2, recompute="full", microbatches=2)),
]


def _world_axis(dims) -> str:
    """The axis the tracer files the world group under (the first of size > 1 that spans it)."""
    spanning = [d for d in ("pp", "dp", "ep", "tp") if getattr(dims, d) == dims.world_size]
    return spanning[0] if spanning else "world"


@pytest.mark.parametrize("config, dims", LAYOUTS, ids=[d.describe() for _, d in LAYOUTS])
def test_records_equal_the_tracer(config, dims):
    """Every axis: bytes sent summed over the ranks and rank 0's calls in one step, measured by
    the CommTracer of the hybrid trainer (which traces the training loop only), equal the
    records (the data-parallel flat units padded to a multiple of dp: a few bytes more)."""
    results = run_hybrid(dims, config, ONE_STEP, trace=True, timeout_s=240)
    records = traffic.step_traffic(config, dims, ONE_STEP.batch_size)
    where = {axis: axis for axis in ("tp", "pp", "ep", "dp")} | {"norm": _world_axis(dims)}
    want_bytes, want_calls = {}, {}
    for axis, rows in records.items():
        key = where[axis]
        want_bytes[key] = want_bytes.get(key, 0) + sum(r.world_bytes for r in rows)
        want_calls[key] = want_calls.get(key, 0) + sum(r.calls for r in rows)
    measured = {}
    for r in results:
        for dim, row in r.traffic.items():
            measured[dim] = measured.get(dim, 0) + row["bytes_sent"]
    calls = {dim: row["calls"] for dim, row in results[0].traffic.items() if dim != "other"}  # other: size-1 groups
    assert calls == {k: v for k, v in want_calls.items() if v}, records
    assert set(measured) - {"other"} == {k for k, v in want_calls.items() if v}
    for dim in set(measured) - {"other", "dp"}:
        assert measured[dim] == want_bytes[dim], dim
    if dims.dp > 1:  # at most dp - 1 elements of padding per flat unit (2 groups) and rank, 4 bytes each
        assert want_bytes["dp"] <= measured["dp"] <= want_bytes["dp"] + 2 * (dims.dp - 1) * 4 * dims.world_size


def test_topology_and_step_time_read_the_same_records(monkeypatch):
    """One extra all-reduce in tensor parallelism's record moves notebook 10's bytes and notebook
    11's calls and seconds by exactly that call: neither keeps a count of its own."""
    dims = ParallelDims(dp=2, tp=2, pp=2, zero=1, microbatches=2)
    before = topology.traffic_per_step(DENSE, dims, 8), step_time(DENSE, dims, CLUSTER, 8, recipe="fp32")
    tp_traffic = traffic.tp_traffic

    def one_more(*args, **kw):
        first, *rest = tp_traffic(*args, **kw)
        return [replace(first, calls=first.calls + 1, priced=first.priced_calls + 1,
                        world_bytes=first.world_bytes + dims.replicas * dims.tp * first.nbytes), *rest]

    monkeypatch.setattr(traffic, "tp_traffic", one_more)
    after = topology.traffic_per_step(DENSE, dims, 8), step_time(DENSE, dims, CLUSTER, 8, recipe="fp32")
    message = 8 // (dims.dp * dims.microbatches) * DENSE.block_size * DENSE.d_model * 4  # one micro-batch, fp32
    assert after[0]["tp"]["bytes_sent"] - before[0]["tp"]["bytes_sent"] == dims.replicas * dims.tp * message
    assert after[1]["calls"]["tp"] - before[1]["calls"]["tp"] == 1
    # the alpha-beta price of one all-reduce; float64 sums in another order: a few ulps
    assert after[1]["tp"] - before[1]["tp"] == pytest.approx(
        collective_time(CLUSTER.intra, "all_reduce", message, 2), rel=1e-12)
    assert {d: r for d, r in after[0].items() if d != "tp"} == {d: r for d, r in before[0].items() if d != "tp"}


def test_each_term_is_a_sum_over_the_records():
    dims = ParallelDims(dp=2, tp=2, pp=2, microbatches=4)
    t = step_time(DENSE, dims, CLUSTER, 16, recipe="fp32")
    records = traffic.step_traffic(DENSE, dims, 16)  # fp32: 4 bytes an element, as recipe="fp32"
    for axis in ("tp", "pp"):  # float64 sums of the same products: exact up to rounding (1e-12)
        assert t[axis] == pytest.approx(sum(traffic.seconds(r, CLUSTER.link_of(axis, dims)) for r in records[axis]),
                                        rel=1e-12)
        assert t["calls"][axis] == sum(r.calls for r in records[axis] if not r.report)
    topo = topology.traffic_per_step(DENSE, dims, 16)
    for axis in ("tp", "pp", "dp"):
        assert topo[axis]["bytes_sent"] == sum(r.world_bytes for r in records[axis])


def test_wire_bytes_are_the_ring_formulas():
    ar = traffic.Collective("tp", "x", "all_reduce", 1000, 4, 3, 0)
    assert traffic.wire_bytes(ar) == 3 * 2 * 3 / 4 * 1000
    assert traffic.wire_bytes(replace(ar, op="all_gather")) == traffic.wire_bytes(replace(ar, op="reduce_scatter")) \
        == 3 * 3 / 4 * 1000
    assert traffic.wire_bytes(replace(ar, op="send", group=2)) == 3 * 1000
    assert traffic.wire_bytes(replace(ar, group=1)) == 0.0
    link = LinkModel(1e-5, 1e9)
    assert traffic.seconds(ar, link) == 3 * collective_time(link, "all_reduce", 1000, 4)
    assert traffic.seconds(replace(ar, priced=0), link) == 0.0
    assert traffic.seconds(replace(ar, report=True), link) == 0.0


def test_each_axis_package_exports_its_traffic():
    assert tp.tp_traffic is traffic.tp_traffic and pp.pp_traffic is traffic.pp_traffic
    assert ep.ep_traffic is traffic.ep_traffic and dp.dp_traffic is zero.dp_traffic is traffic.dp_traffic
    dims = ParallelDims(dp=2, tp=2, pp=2, microbatches=2)
    assert {a for a, rows in traffic.step_traffic(DENSE, dims, 8).items() if rows} == {"tp", "pp", "dp", "norm"}
    assert traffic.step_traffic(DENSE, ParallelDims(), 8) == {"tp": [], "pp": [], "ep": [], "dp": [], "norm": []}
    with pytest.raises(ValueError, match="batch_size=7 must be divisible by dp\\*ep = 2"):
        traffic.step_traffic(DENSE, dims, 7)


def test_sequence_parallel_calls_megatron_overlaps_are_priced_on_a_measured_table_only():
    """The re-gathers in backward and the replicated parameters' small all-reduces: the course's
    runtime makes each call (a measured table prices them), Megatron overlaps or batches them
    (a published alpha-beta link leaves them out)."""
    from course_lib.comm.measured import CollectiveTable

    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=2, n_head=2, d_model=16)
    dims = ParallelDims(tp=2, sequence_parallel=True)
    records = traffic.tp_traffic(config, dims, 4, 16)
    later = [r for r in records if r.measured_only]
    assert {r.op for r in later} == {"all_gather", "all_reduce"} and all(r.calls > 0 for r in later)
    link = LinkModel(1e-5, 1e10, "a published link")
    sizes = [4, 1 << 20]
    entries = {op: {"2": [sizes, [1e-3, 2e-3]]} for op in ("all_reduce", "all_gather", "reduce_scatter")}
    table = CollectiveTable("a measured table", entries, None)
    for r in later:
        assert traffic.seconds(r, link) == 0.0
        assert traffic.seconds(r, table) == r.priced_calls * collective_time(table, r.op, r.nbytes, 2) > 0
    others = [r for r in records if not r.measured_only and r.priced_calls]
    assert all(traffic.seconds(r, link) > 0 for r in others)
