"""The step-time model's communication, held against what the course's strategies really send:
the measured CollectiveTable, and the calls per step counted by the tracer."""

import math

import pytest

from course_lib.comm.costmodel import LinkModel, predict_time
from course_lib.comm.measured import CollectiveTable, collective_time, link_from_dict, table_to_dict
from course_lib.dims import ParallelDims as Dims
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.step_time import step_time

TABLE = CollectiveTable("t", {"all_reduce": {"2": [[10, 20, 40], [1.0, 3.0, 2.0]], "8": [[10], [7.0]]},
                              "send": {"2": [[10, 100], [0.5, 1.5]]}}, LinkModel(1e-3, 1e6))


def test_table_is_piecewise_linear_between_measured_sizes():
    # made-up times: float64 interpolation, exact up to rounding (math.isclose's rel_tol 1e-9)
    assert TABLE.seconds("all_reduce", 5, 2) == 1.0  # below the smallest: its time
    assert math.isclose(TABLE.seconds("all_reduce", 15, 2), 2.0)
    assert math.isclose(TABLE.seconds("all_reduce", 30, 2), 2.5)  # times need not grow with size
    assert math.isclose(TABLE.seconds("all_reduce", 80, 2), 4.0)  # beyond: bandwidth-bound
    assert TABLE.seconds("all_reduce", 8, 4) == 7.0  # a group of 4: the next measured size up (8)
    assert TABLE.seconds("all_reduce", 15, 1) == 0.0
    assert math.isclose(TABLE.message_time(55), 1.0)
    with pytest.raises(ValueError, match="no measurement of 'all_gather'"):
        TABLE.seconds("all_gather", 8, 2)
    with pytest.raises(ValueError, match="op='gather'"):
        collective_time(TABLE, "gather", 8, 2)
    assert link_from_dict(table_to_dict(TABLE)) == TABLE


def test_collective_time_on_a_link_model_is_the_alpha_beta_formula():
    link = LinkModel(1e-5, 1e9)
    for op, algorithm in (("all_reduce", "ring"), ("all_gather", "all_gather"),
                          ("reduce_scatter", "reduce_scatter"), ("all_to_all", "all_to_all")):
        assert collective_time(link, op, 1 << 20, 8) == predict_time(algorithm, 1 << 20, 8, link)
    assert collective_time(link, "send", 1 << 20, 2) == link.message_time(1 << 20)
    assert collective_time(link, "all_reduce", 1 << 20, 1) == 0.0


# ----------------------------------------------------------------------------- calls = the tracer's
def _traced_calls(kind, dims, config, steps):
    """Rank code: collective calls this rank made while training `steps` steps."""
    from course_lib.measure.validation import train_as
    from course_lib.observe.tracer import CommTracer
    from course_lib.train import TrainConfig

    with CommTracer() as tracer:
        train_as(kind, dims, config, TrainConfig(steps=steps, batch_size=BATCH, progress=False, eval_every=0))
    # calls that cross ranks (the hybrid trainer also calls its size-1 groups, which move nothing)
    return sum(1 for r in tracer.records if not r.group_ranks or len(r.group_ranks) > 1)


# (layout, which trainer runs it (train_as), calls outside the model: the composed trainer's loss
# log over dp; the pipeline's loss broadcast is inside the step, and counted); every run trains
# BATCH sequences per step
BATCH = 8
CASES = [
    (Dims(dp=2), "dp", 0),
    (Dims(dp=2, microbatches=2), "dp", 0),
    (Dims(dp=2, zero=1), "zero", 0),
    (Dims(dp=2, microbatches=2, zero=2), "zero", 0),
    (Dims(dp=2, zero=3), "zero", 0),
    (Dims(tp=2), "tp", 0),
    (Dims(pp=2, microbatches=2), "hybrid", 0),
    (Dims(dp=2, tp=2), "hybrid", 1),
]


@pytest.mark.parametrize("layout,kind,extra", CASES, ids=[f"{c[1]}-{c[0].describe()}" for c in CASES])
def test_calls_per_step_equal_the_tracer(layout, kind, extra, tiny_config):
    """Calls of step 2 alone = calls of a 2-step run - calls of a 1-step run (set-up and the
    final gathers cancel), on rank 0 (an end stage, the busiest for a pipeline)."""
    from course_lib.runtime import run_on_ranks

    cluster = Cluster("c", 4, 4, 1e9, 1e9, 1e9, LinkModel(1e-5, 1e9), LinkModel(1e-5, 1e9))
    t = step_time(tiny_config, layout, cluster, BATCH, recipe="fp32")
    counted = [run_on_ranks(_traced_calls, kind, layout, tiny_config, steps, world_size=layout.world_size,
                            timeout_s=120)[0]
               for steps in (1, 2)]
    assert counted[1] - counted[0] == sum(t["calls"].values()) + extra, (t["calls"], counted)


def test_train_as_names_an_unknown_strategy_and_a_layout_it_cannot_train(tiny_config):
    from course_lib.measure.validation import train_as

    with pytest.raises(ValueError, match="kind='fsdp' must be one of"):
        train_as("fsdp", Dims(dp=2), tiny_config, None)
    with pytest.raises(ValueError, match=r"kind='tp' trains one axis \(tp\); the layout dp2·tp2·pp1 also has \{'dp': 2\}"):
        train_as("tp", Dims(dp=2, tp=2), tiny_config, None)


# ----------------------------------------------------------------------------- a measured table: the runtime's busiest rank
def _traced_tp_calls(dims, config, steps):
    """Rank code: this rank's tensor-parallel calls while the composed trainer runs `steps` steps."""
    from course_lib.measure.validation import train_as
    from course_lib.observe.tracer import CommTracer
    from course_lib.parallel.hybrid import traffic_by_dimension
    from course_lib.train import TrainConfig

    import torch.distributed as dist

    with CommTracer() as tracer:
        train_as("hybrid", dims, config, TrainConfig(steps=steps, batch_size=BATCH, progress=False, eval_every=0))
    return traffic_by_dimension(tracer.records, dims, dist.get_world_size()).get("tp", {"calls": 0})["calls"]


def test_a_measured_table_prices_the_tp_calls_of_the_runtimes_busiest_rank(tiny_config):
    """On a measured table (the course's runtime runs the layout) tensor parallelism is priced on
    the pipeline rank that makes the most calls, as it makes them: 3 blocks on 2 stages put 2
    blocks and the embedding on the first, 1 block, the head and the loss on the last, and
    torch's checkpoint repeats one all-reduce per recomputed block. (Pricing l0 = 2 blocks with
    both ends and Megatron's 2 repeats on one rank gave 34 calls per step where the busiest
    rank makes 22: the capstone's small configs were predicted up to twice their step.) Every
    call costs 1 s on this made-up table, so the tp term counts the calls, and the checks the
    same calls plus the norm's."""
    from dataclasses import replace

    from course_lib.runtime import run_on_ranks

    config = replace(tiny_config, n_layer=3)
    dims = Dims(tp=2, pp=2, microbatches=2, recompute="full")
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    flat = [[4, 1 << 40], [1.0, 1.0]]  # 1 s at every size
    table = CollectiveTable("1 s per call", {op: {"2": flat, "4": flat} for op in ops}
                            | {"send": {"2": [[4, 1 << 40], [0.0, 0.0]]}})
    cluster = Cluster("c", 4, 4, 1e9, 1e9, 1e9, table, table, memory_bandwidth=1e9)
    t = step_time(config, dims, cluster, BATCH, recipe="fp32", checked_collectives=True)
    counted = [run_on_ranks(_traced_tp_calls, dims, config, steps, world_size=4, timeout_s=120) for steps in (1, 2)]
    per_rank = [b - a for a, b in zip(*counted)]  # step 2's calls on each rank
    assert per_rank == [22, 22, 18, 18]  # tp groups {0, 1} (first stage) and {2, 3} (last stage)
    assert t["tp"] == max(per_rank)  # sums of 1.0: exact
    assert t["checks"] == max(per_rank) + 1  # one check per call, and the norm's all-reduce over the world
    assert t["calls"]["tp"] == per_rank[0]  # rank 0's calls, the tracer's count, unchanged
    # a published cluster still prices Megatron's: 2 blocks with both ends on one rank, 2 repeats per block
    megatron = step_time(config, dims, Cluster("c", 4, 4, 1e9, 1e9, 1e9, LinkModel(1.0, 1e30), LinkModel(1.0, 1e30)),
                         BATCH, recipe="fp32")
    assert megatron["tp"] == pytest.approx(34 * 2 * 1.0, rel=1e-12)  # ring all-reduce of 2: 2(n-1) = 2 alphas a call
