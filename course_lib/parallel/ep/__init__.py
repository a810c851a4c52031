"""Expert parallelism for mixture-of-experts models (notebook 07).

    dispatch.py   exchange_counts, dispatch, run_local_experts, combine: the two all-to-alls;
                  dispatch_once_per_rank: each token once per destination rank (DeepSeek-style)
    apply.py      apply_expert_parallel(model, group, once_per_rank), reduce_gradients(model, group),
                  clip_grad_norm, full_flat (the whole model's parameters, experts gathered),
                  sync_expert_load (bias balancing: the step's loads summed over ranks)
    training.py   train_expert_parallel (rank side, ep x dp mesh), run_expert_parallel (parent),
                  train_moe_reference (the single process it equals)
    figures.py    notebook 07's widget: experts, top_k, capacity factor -> load and drops
    imbalance.py  timed_moe_layer: each rank's expert time against its load, on a timeline
"""

# this axis's per-step collectives: the records notebook 10's bytes and notebook 11's step time read
from course_lib.estimate.traffic import ep_traffic
from course_lib.parallel.ep.apply import (ExpertParallelExperts, apply_expert_parallel, check_expert_parallel,
                                          clip_grad_norm, ep_placements, expert_parameters, full_flat,
                                          reduce_gradients, sync_expert_load)
from course_lib.parallel.ep.dispatch import (combine, dispatch, dispatch_once_per_rank, exchange_counts, run_local_experts,
                                            traffic_matrix)
from course_lib.parallel.ep.training import run_expert_parallel, train_expert_parallel, train_moe_reference

__all__ = ["apply_expert_parallel", "ep_traffic", "reduce_gradients", "clip_grad_norm", "full_flat", "expert_parameters",
           "check_expert_parallel", "ep_placements", "ExpertParallelExperts", "exchange_counts", "dispatch", "run_local_experts",
           "combine", "traffic_matrix", "train_expert_parallel", "run_expert_parallel", "train_moe_reference",
           "sync_expert_load", "dispatch_once_per_rank"]
