"""Exercise 15: the capstone's layout, your choice and your reasons. Fill in the three functions,
then run the check cells of ex15_capstone.ipynb.

Every function gets a problem: `config` (the course GPT), `cluster` (its n_gpus,
memory_bytes per device, links and measured rates), `global_batch` (sequences per step), `seq`
(tokens per sequence) and `recipe` (the precision recipe of the estimator). The checks ask the
stated problem and others of the same family (another batch, more memory per device), so the
functions must reason from their arguments: a layout or a number typed in for the stated
problem fails on the others.

You may use the estimator's formulas (imported below): `memory_per_rank(config, layout,
global_batch, seq, recipe)["total"]` (bytes on the busiest rank) and `step_time(config, layout,
cluster, global_batch, seq, recipe)` (seconds per step, by term, and "total"). Not the planner (course_lib.estimate.planner):
it holds the answer, and the checks refuse a module that uses it.

A layout here is one the course's 3D trainer runs: `ParallelDims(dp=, tp=, pp=, microbatches=,
zero=, recompute=)` (course_lib.dims, the object the trainers take) with ep = 1, one chunk per
stage, schedule "1f1b", no sequence parallelism, zero 0 or 1, recompute "none" or "full";
dp * tp * pp = cluster.n_gpus, and the m = microbatches micro-batches split each replica's
global_batch / dp sequences evenly (each micro-batch holds global_batch / (dp * m)); and, as
this problem asks, m >= pp (1F1B in its steady state: the trainer also runs
fewer micro-batches than stages, all of them in the warm-up). Which of those are valid for this model is part of the exercise.
"""

from course_lib.dims import ParallelDims  # noqa: F401
from course_lib.estimate.step_time import memory_per_rank, step_time  # noqa: F401


def choose_layout(config, cluster, global_batch: int, seq: int, recipe: str = "fp32") -> ParallelDims:
    """The layout you would run: one the 3D trainer runs (above), that fits the device's memory by
    the estimator, and whose predicted throughput is at least the notebook's FRACTION of the
    best fitting layout's."""
    raise NotImplementedError("exercise 15: write choose_layout")


def binding_constraint(config, cluster, global_batch: int, seq: int, recipe: str = "fp32") -> tuple[str, float]:
    """(name, number): what stops any layout of the 3D trainer from being faster than the fastest
    one that fits.

        ("memory", bytes per rank)    when the fastest layout, memory ignored, does not fit; the
                                      number is the memory per device at which memory would
                                      stop binding
        (group, seconds per step)     otherwise: the largest group of the best layout's step-time
                                      terms, one of "compute" (with recomputation), "overhead",
                                      "communication" (tp, pp, ep and exposed dp), "bubble",
                                      "optimizer"; the number is that group's seconds
    """
    raise NotImplementedError("exercise 15: write binding_constraint")


def rejected_layout(config, cluster, global_batch: int, seq: int, recipe: str = "fp32") -> tuple[ParallelDims, str, float]:
    """(layout, reason, number): a layout the 3D trainer could run for this problem, other than
    yours, that you rejected, and why:

        "memory"       it does not fit; number: its bytes per rank minus the device's
        "throughput"   it fits but is too slow; number: the best fitting layout's predicted step
                       time over its own (below FRACTION)
    """
    raise NotImplementedError("exercise 15: write rejected_layout")
