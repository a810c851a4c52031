"""Low-communication data parallelism (issue 43): LocalSGD and DiLoCo, replicas that meet every H steps.

    outer.py      the outer step (Nesterov on the averaged delta, by hand), Streaming DiLoCo's
                  fragments, and the rules of a run (check_diloco)
    training.py   train_local_sgd / train_diloco on ranks (shard=True: each replica FSDP-sharded,
                  the outer step on each rank's rows), run_diloco (the parent's launcher)
    simulate.py   simulate_diloco: the same algorithm with the replicas computed in turn in one process

Their traffic (the whole model every H steps, or one fragment at a time) is
course_lib.estimate.traffic.diloco.
"""

from course_lib.estimate.traffic.diloco import (ddp_bytes_per_step, diloco_sync_bytes, fragment_param_counts,
                                                sharded_fragment_counts)
from course_lib.parallel.diloco.outer import ALGORITHMS, NesterovOuter, check_diloco, due, fragment_params, sync_offsets
from course_lib.parallel.diloco.simulate import simulate_diloco
from course_lib.parallel.diloco.training import (DilocoResult, DilocoSync, LocalSGDSync, average, replica_lists,
                                                 run_diloco, train_diloco, train_local_sgd)

__all__ = ["ALGORITHMS", "NesterovOuter", "check_diloco", "due", "fragment_params", "sync_offsets",
           "simulate_diloco", "DilocoResult", "DilocoSync", "LocalSGDSync", "average", "replica_lists",
           "run_diloco", "train_diloco", "train_local_sgd", "ddp_bytes_per_step", "diloco_sync_bytes",
           "fragment_param_counts", "sharded_fragment_counts"]
