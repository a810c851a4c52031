"""Starting ranks: the parent side of every run.

    pool.py     run_on_ranks: a persistent pool of rank processes, RankError / RankTimeout
    worker.py   the loop each rank process runs (joins the process group, serves calls)
    modules.py  share_with_ranks: a module loaded from a file (student.py) runs on the ranks from its source
    launch.py   the torchrun path: init_from_env()
    device.py   the backend/device rules: run_on_ranks' resolve_backend, torchrun's launch_backend, local_device
    recorded.py run_recorded: run_on_ranks with a flight recorder; a hang comes back analysed
"""

from course_lib.runtime.device import rank_device, resolve_backend, threads_per_rank
from course_lib.runtime.pool import RankError, RankTimeout, run_on_ranks, shutdown_pools
from course_lib.runtime.recorded import HangAnalysed, run_recorded

__all__ = ["run_on_ranks", "RankError", "RankTimeout", "shutdown_pools", "run_recorded", "HangAnalysed",
           "resolve_backend", "rank_device", "threads_per_rank"]
