"""Fault-tolerant data parallelism (issue 43, after torchft): replica groups with a per-step quorum.

    replicas.py   the quorum over the store, the mean over the quorum by point-to-point, healing a
                  joiner from a healthy peer; run_ft (the parent's launcher, real SIGKILL)
    replay.py     FtConfig and its rules (check_ft), the tiny model and data, the state healing
                  sends, and replay: the same data and quorum sequence in one process
"""

from course_lib.parallel.ft.replay import FtConfig, check_ft, replay
from course_lib.parallel.ft.replicas import FtRun, ReplicaResult, decide_quorum, quorum_mean, run_ft

__all__ = ["FtConfig", "check_ft", "replay", "FtRun", "ReplicaResult", "decide_quorum", "quorum_mean", "run_ft"]
