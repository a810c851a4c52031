"""Hot paths build once (#40): a pipeline's schedule is built, checked and planned once per run
on each rank, not once per step (the trainers pass run_schedule a PipelinePlan), the hybrid
optimizer reads the trainer's plan instead of building a second schedule, and a context-parallel
run's sequence layout computes and checks its positions once, not per batch.

Each rank counts the constructions while it trains 1 step and then 3 steps: the counts must not
grow with the steps. The thin path (run_schedule given a name) is counted too, so the counter is
seen to count: it plans on every call.
"""

import pytest
import torch

from course_lib.data import CharDataset
from course_lib.model import GPTConfig
from course_lib.runtime import run_on_ranks
from course_lib.train import TrainConfig

SEQ = 16


def _config():
    return GPTConfig(vocab_size=CharDataset("train", SEQ).vocab_size, block_size=SEQ, n_layer=2, n_head=2, d_model=16)


def _counting(train):
    """Rank code: {steps: counts} of Schedule constructions, schedule checks, message plans and
    sequence-layout rule checks while train(steps) runs, for 1 and then 3 steps."""
    from course_lib.parallel.cp import layout
    from course_lib.parallel.pp import actions, runner

    counts = {}
    real = {"schedule": actions.Schedule.__init__, "check": runner.check_schedule,
            "plan": runner.plan_messages, "layout": layout.check_context_parallel}

    def counted(key, fn):
        def wrapper(*a, **kw):
            counts[key] = counts.get(key, 0) + 1
            return fn(*a, **kw)
        return wrapper

    out = {}
    actions.Schedule.__init__ = counted("schedule", real["schedule"])
    runner.check_schedule, runner.plan_messages = counted("check", real["check"]), counted("plan", real["plan"])
    layout.check_context_parallel = counted("layout", real["layout"])
    try:
        for steps in (1, 3):
            counts.clear()
            train(steps)
            out[steps] = dict(counts)
    finally:
        actions.Schedule.__init__ = real["schedule"]
        runner.check_schedule, runner.plan_messages = real["check"], real["plan"]
        layout.check_context_parallel = real["layout"]
    return out


def _assert_once(results, keys):
    for counts in results:
        assert counts[1] == counts[3], counts  # nothing is built per step
        for key in keys:
            assert counts[3].get(key) == 1, (key, counts)  # built once per rank


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_the_pipeline_trainer_plans_its_schedule_once_per_rank(schedule):
    config = _config()

    def rank(schedule):
        from course_lib.parallel.pp import train_pipeline

        return _counting(lambda steps: train_pipeline(
            config, TrainConfig(steps=steps, batch_size=4, eval_every=10**6, eval_batches=1, progress=False),
            schedule, n_microbatches=2))

    _assert_once(run_on_ranks(rank, schedule, world_size=2, timeout_s=120), ("schedule", "plan"))


def test_run_schedule_given_a_name_plans_on_every_call():
    """The thin path for callers that pass a name: planned (built and checked) on each call, so the
    counter above counts what a per-step rebuild would cost."""
    config = _config()

    def rank():
        import torch.distributed as dist

        from course_lib.data import get_batch
        from course_lib.model import GPT
        from course_lib.parallel.pp import build_stage, run_schedule

        stage = build_stage(GPT(config, seed=0), dist.group.WORLD)
        x, y = get_batch(CharDataset("train", SEQ), 4, torch.Generator().manual_seed(0))
        return _counting(lambda steps: [run_schedule(stage, x, y, "1f1b", 2) for _ in range(steps)])

    for counts in run_on_ranks(rank, world_size=2, timeout_s=120):
        assert counts[1]["plan"] == 1 and counts[3]["plan"] == 3, counts
        assert counts[3]["schedule"] == 3, counts


@pytest.mark.parametrize("kw, world, keys", [
    # zero=2: make_hybrid_optimizer asks whether the backward is split; it reads the trainer's plan
    (dict(pp=2, zero=2, microbatches=2, schedule="zero_bubble"), 2, ("schedule", "plan")),
    # cp: the layout's positions computed and checked once (apply_context_parallel), not per batch
    (dict(pp=2, cp=2, cp_method="allgather", zero=1, microbatches=2, schedule="zero_bubble"), 4,
     ("schedule", "plan", "layout")),
])
def test_the_hybrid_trainer_builds_its_schedule_and_sequence_layout_once(kw, world, keys):
    from course_lib.dims import ParallelDims

    config, dims = _config(), ParallelDims(**kw)

    def rank(dims):
        from course_lib.parallel.hybrid.training import train_hybrid

        return _counting(lambda steps: train_hybrid(
            dims, config, TrainConfig(steps=steps, batch_size=4, eval_every=10**6, eval_batches=1, progress=False)))

    _assert_once(run_on_ranks(rank, dims, world_size=world, timeout_s=180), keys)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_a_context_parallel_run_checks_its_layout_once(method):
    """The layout's rules run when it is built (check_apply, SequenceLayout); a step reads the
    positions it computed then, and the attention modules do not re-check them per call."""
    config = _config()

    def rank(method):
        from course_lib.parallel.cp.training import train_context_parallel

        return _counting(lambda steps: train_context_parallel(
            config, TrainConfig(steps=steps, batch_size=4, eval_every=10**6, eval_batches=1, progress=False), cp=2,
            method=method))

    for counts in run_on_ranks(rank, method, world_size=2, timeout_s=120):
        assert counts[1] == counts[3] and counts[3].get("layout", 0) >= 1, counts
