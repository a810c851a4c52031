"""course_lib: the library behind "Distributed Training from First Principles".

Names the notebooks, exercises and graders rely on (kept stable):
    run_on_ranks, RankError, RankTimeout   -- run a function on N real ranks (runtime.py)
    CommTracer, merge_summaries            -- count collective calls and bytes (tracer.py)
    make_mesh, check_mesh                  -- named DeviceMesh for dp/tp/pp/ep (mesh.py)
    course_lib.model.GPT / GPTConfig       -- the reference model (model.py)
    course_lib.demos.allreduce             -- the torchrun demo
"""

from course_lib.mesh import check_mesh, make_mesh, mesh_groups
from course_lib.runtime import RankError, RankTimeout, run_on_ranks, shutdown_pools
from course_lib.timeline import Timeline, plot_gantt
from course_lib.tracer import CommTracer, format_summary, merge_summaries

__all__ = [
    "run_on_ranks", "RankError", "RankTimeout", "shutdown_pools",
    "CommTracer", "merge_summaries", "format_summary",
    "Timeline", "plot_gantt",
    "make_mesh", "check_mesh", "mesh_groups",
]
