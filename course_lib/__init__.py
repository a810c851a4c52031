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

from course_lib._lazy import lazy_exports

# Imported on first use (PEP 562), not with the package: `import course_lib.estimate` (pure
# formulas) must not import torch, and Python imports this file first for any course_lib module.
_EXPORTS = {
    "run_on_ranks": "course_lib.runtime.pool", "RankError": "course_lib.runtime.pool",
    "RankTimeout": "course_lib.runtime.pool", "shutdown_pools": "course_lib.runtime.pool",
    "CommTracer": "course_lib.observe.tracer", "merge_summaries": "course_lib.observe.tracer",
    "format_summary": "course_lib.observe.tracer",
    "Timeline": "course_lib.observe.timeline", "plot_gantt": "course_lib.observe.timeline",
    "make_mesh": "course_lib.parallel.mesh", "check_mesh": "course_lib.parallel.mesh",
    "mesh_groups": "course_lib.parallel.mesh",
}
__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
