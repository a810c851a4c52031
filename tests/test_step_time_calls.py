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


# (layout, which trainer runs it (train_as), calls outside the model: the pipeline's loss
# report); every run trains BATCH sequences per step
BATCH = 8
CASES = [
    (Dims(dp=2), "dp", 0),
    (Dims(dp=2, microbatches=2), "dp", 0),
    (Dims(dp=2, zero=1), "zero", 0),
    (Dims(dp=2, microbatches=2, zero=2), "zero", 0),
    (Dims(dp=2, zero=3), "zero", 0),
    (Dims(tp=2), "tp", 0),
    (Dims(pp=2, microbatches=2), "hybrid", 1),
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
