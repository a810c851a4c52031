"""course_lib: the library behind "Distributed Training from First Principles".

How data flows, and where each part lives:

    runtime/      the parent starts ranks: run_on_ranks (emulated CPU ranks) or torchrun
    model/, data.py
                  rank code builds the plain model and its batches
    techniques/   single-device techniques (mixed precision, activation checkpointing, accumulation)
    parallel/     strategies that transform the model and the step: dp/ tp/ pp/ ep/ zero/, on a mesh
    train.py      the one training step and the reference trainer every strategy is checked against
    observe/      records what happened: collective checks, CommTracer, timelines, memory
    comm/         collectives from send/recv, their alpha-beta cost, differentiable collectives
    estimate/     pure formulas: memory, FLOPs, time (no processes)
    measure/      runs on real ranks that check estimate/'s formulas: calibration, measured memory,
                  predicted against measured step times, profiles
    grading/      the graded exercises' loader, checks and per-exercise checkers;  demos/: the torchrun demos
    units.py      one byte-unit convention (KiB/MiB/GiB);  _validate.py: argument checks

Names the notebooks, exercises and graders rely on (kept stable):
    run_on_ranks, RankError, RankTimeout   -- run a function on N real ranks
    CommTracer, merge_summaries            -- count collective calls and bytes
    make_mesh, check_mesh                  -- named DeviceMesh for dp/tp/pp/ep
    course_lib.model.GPT / GPTConfig       -- the reference model
"""

from course_lib.observe.timeline import Timeline, plot_gantt
from course_lib.observe.tracer import CommTracer, format_summary, merge_summaries
from course_lib.parallel.mesh import check_mesh, make_mesh, mesh_groups
from course_lib.runtime.pool import RankError, RankTimeout, run_on_ranks, shutdown_pools

__all__ = [
    "run_on_ranks", "RankError", "RankTimeout", "shutdown_pools",
    "CommTracer", "merge_summaries", "format_summary",
    "Timeline", "plot_gantt",
    "make_mesh", "check_mesh", "mesh_groups",
]
