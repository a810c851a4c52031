"""Pipeline parallelism (notebook 06): the model cut into stages on different ranks, micro-batches
flowing through them by a schedule.

    stage.py      build_stage(model, group, virtual_stages): this rank's blocks (+ embedding / head)
    actions.py    actions, per-rank action lists, and the stage placements ("loop", "v")
    schedules.py  the schedules as data (per-rank F/B/W lists), their simulation and checker
    v_schedules.py  ZB-V and DualPipeV: two chunks per rank in a V
    pipedream.py  PipeDream-2BW: no flush, two weight versions, one-step-stale updates
    p2p_plan.py   the schedule's messages in batches both ends issue in the same order (NCCL's rules)
    runner.py     plan_pipeline (a checked schedule and its messages, built once per run) and
                  run_schedule(stage, idx, targets, plan, n_microbatches): the executor, real send/recv
    accounting.py the executor's observer: saved bytes and their peak, timeline spans, padding
    deferred.py   zero bubble's split backward: input gradients in B, weight gradients in W
    training.py   train_pipeline / run_pipeline: the reference loop, pipelined
    bubble.py     the bubble formulas and the bubble measured from a run's timeline
    native.py     the same stages under torch.distributed.pipelining
    torch_order.py  torch's own action lists (pipeline_order, the lowered form) read without running, beside ours
"""

# this axis's per-step collectives: the records notebook 10's bytes and notebook 11's step time read
from course_lib.estimate.traffic import pp_traffic
from course_lib.parallel.pp.actions import rank_of, stage_of
from course_lib.parallel.pp.pipedream import reference_2bw, run_2bw
from course_lib.parallel.pp.runner import PipelinePlan, plan_pipeline, run_schedule
from course_lib.parallel.pp.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    check_schedule,
    in_flight,
    make_schedule,
    schedule_events,
    simulate,
)
from course_lib.parallel.pp.stage import PipelineStage, build_stage, split_layers
from course_lib.parallel.pp.training import (
    PipelineResult,
    check_pipeline,
    clip_grad_norm_pipeline,
    run_pipeline,
    stage_tensors,
    train_pipeline,
)

__all__ = [
    "build_stage", "pp_traffic", "PipelineStage", "split_layers", "run_schedule",
    "PipelinePlan", "plan_pipeline",
    "SCHEDULES", "Action", "Schedule", "ScheduleError", "make_schedule", "check_schedule", "simulate",
    "in_flight", "schedule_events",
    "train_pipeline", "run_pipeline", "check_pipeline", "PipelineResult", "clip_grad_norm_pipeline",
    "stage_tensors", "rank_of", "stage_of", "run_2bw", "reference_2bw",
]
