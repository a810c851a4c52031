"""The step-time model's count of a tensor x pipeline step, held exactly against the tracer: tp2 x pp4,
1F1B, 4 micro-batches on 8 gloo ranks (benchmarks/bench_planner.py's most under-predicted layout, on
a smaller model). Every pipeline rank's tensor-parallel calls and bytes, rank 0's calls per mesh axis,
the pipeline's bytes over all ranks, and the loss the schedule broadcasts inside the step (priced as
the binomial tree's messages)."""

import pytest

from course_lib.comm.costmodel import LinkModel
from course_lib.comm.measured import CollectiveTable, collective_time
from course_lib.data import VOCAB_SIZE
from course_lib.dims import ParallelDims
from course_lib.estimate import traffic
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.step_time import step_time
from course_lib.estimate.traffic.records import broadcast_hops
from course_lib.model import GPTConfig
from course_lib.parallel.hybrid import run_hybrid
from course_lib.train import TrainConfig

CONFIG = GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=4, n_head=2, d_model=16)
DIMS = ParallelDims(tp=2, pp=4, microbatches=4)
ONE_STEP = TrainConfig(steps=1, batch_size=8, lr=1e-2, grad_clip=0.05, progress=False, eval_every=0)
LINK = LinkModel(1e-5, 1e9)
CLUSTER = Cluster("c", 8, 8, 1e9, 1e9, 1e9, LINK, LINK)


@pytest.fixture(scope="module")
def traced():
    """Per rank: the tracer's {axis: calls, bytes} of one step (the hybrid trainer traces its steps only)."""
    return run_hybrid(DIMS, CONFIG, ONE_STEP, trace=True, timeout_s=240)


def test_every_pipeline_ranks_tp_calls_and_bytes_are_the_records(traced):
    """tp_traffic(rank=s): what pipeline rank s calls, as the step-time model prices it on a measured
    table (busiest_tp_rank); both tp ranks of a stage make the same calls."""
    for result in traced:
        records = traffic.tp_traffic(CONFIG, DIMS, ONE_STEP.batch_size, rank=result.coords["pp"])
        assert result.traffic["tp"]["calls"] == sum(r.calls for r in records), result.coords
        assert result.traffic["tp"]["bytes_sent"] == sum(r.calls * r.nbytes for r in records), result.coords


def test_rank_0s_calls_per_axis_are_step_times_including_the_loss_broadcast(traced):
    """step_time(...)["calls"] is rank 0's calls in one step, axis by axis: the pipeline's 2m messages,
    the tied embedding's gradient both ways, and the mean loss run_schedule broadcasts from the last
    stage (inside the timed step: the model left it out as a log until it was counted); the norm's
    all-reduce spans the world. The ZeRO engine's calls on its size-1 dp group move nothing."""
    t = step_time(CONFIG, DIMS, CLUSTER, ONE_STEP.batch_size, recipe="fp32")
    made = {axis: row["calls"] for axis, row in traced[0].traffic.items() if axis != "other"}
    assert made == {"tp": t["calls"]["tp"], "pp": t["calls"]["pp"], "world": t["calls"]["norm"]}
    assert made["pp"] == 2 * DIMS.microbatches + 2 + 1  # what the tracer counts, written out


def test_pipeline_bytes_summed_over_the_ranks_are_the_records(traced):
    records = traffic.pp_traffic(CONFIG, DIMS, ONE_STEP.batch_size)
    assert sum(r.traffic["pp"]["bytes_sent"] for r in traced) == sum(r.world_bytes for r in records)


def test_a_broadcast_is_priced_as_its_binomial_trees_messages():
    """ceil(log2 n) messages one after another (gloo's broadcast), on an alpha-beta link and on a
    measured table's point-to-point column; the pipeline's loss broadcast is in step_time's pp term."""
    assert [broadcast_hops(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    cast = traffic.Collective("pp", "x", "broadcast", 4, 4, 1, 0)
    assert traffic.seconds(cast, LINK) == 2 * LINK.message_time(4)
    table = CollectiveTable("t", {"send": {"2": [[4, 400], [1.0, 3.0]]}})
    assert traffic.seconds(cast, table) == 2 * collective_time(table, "send", 4, 2) == 2.0
    t = step_time(CONFIG, DIMS, CLUSTER, ONE_STEP.batch_size, recipe="fp32")
    records = traffic.pp_traffic(CONFIG, DIMS, ONE_STEP.batch_size)
    (loss,) = [r for r in records if r.op == "broadcast"]
    assert not loss.report and traffic.seconds(loss, LINK) == 2 * LINK.message_time(4)
    # float64 sums of the same products in the same order: equal up to rounding (1e-12)
    assert t["pp"] == pytest.approx(sum(traffic.seconds(r, LINK) for r in records), rel=1e-12)
