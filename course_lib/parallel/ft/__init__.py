"""Fault-tolerant data parallelism (issue 43, after torchft): replica groups with a per-step quorum.

    replicas.py   data-parallel replicas (the gradient's mean over each step's quorum); run_ft (the
                  parent's launcher, real SIGKILL) and run_ft_hosted (the same run hosted by
                  torchrun's ranks: the diloco demo's --kill-replica)
    local.py      DiLoCo's replicas (algorithm "diloco"): inner steps alone, the quorum at the syncs
    quorum.py     what both share: the quorum over the store, the mean over a quorum, healing
    replay.py     FtConfig and its rules (check_ft), the tiny model and data, the state healing
                  sends, and replay: the same data and quorum sequence in one process
"""

from course_lib.parallel.ft.quorum import ReplicaResult, decide_quorum, quorum_mean
from course_lib.parallel.ft.replay import FtConfig, check_ft, replay, replay_diloco
from course_lib.parallel.ft.replicas import FtRun, run_ft, run_ft_hosted

__all__ = ["FtConfig", "check_ft", "replay", "replay_diloco", "FtRun", "ReplicaResult", "decide_quorum",
           "quorum_mean", "run_ft", "run_ft_hosted"]
