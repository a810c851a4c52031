"""Exercise 12, reference solution: the planner's fastest fitting layout that the course's 3D
trainer can run (one solution of many)."""

from course_lib.estimate.planner import plan
from course_lib.estimate.step_time import Layout


def runnable(layout: Layout) -> bool:
    """What course_lib.parallel.hybrid composes: dp x tp x pp, 1F1B, ZeRO 0 or 1, whole-block recomputation or none."""
    return (layout.ep == 1 and layout.v == 1 and layout.schedule == "1f1b" and layout.recompute in ("none", "full")
            and not layout.sequence_parallel and layout.zero_stage in (0, 1))


def choose_layout(config, cluster, global_batch: int, seq: int, recipe: str = "fp32") -> Layout:
    ranked = plan(config, cluster, global_batch, seq, recipe).ranked  # fitting, fastest first
    return next(c.layout for c in ranked if runnable(c.layout))
