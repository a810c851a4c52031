"""3D, 4D and 5D parallelism on one device mesh (notebook 10): the strategies composed, not re-implemented.

    ParallelDims (course_lib/dims.py, below this package and course_lib.estimate): the degrees
                 and options; .check(world_size, config, batch_size) rejects every impossible
                 layout with its rule, in the parent, before any rank starts
    compose.py   build_hybrid: make_mesh -> apply_tensor_parallel (tp) -> apply_expert_parallel (ep)
                 -> apply_context_parallel (cp) -> build_stage (pp) -> ZeRO-1 / AdamW over dp
                 (the mesh's dp·cp group: dp's own at cp = 1); sync_gradients; the ONE global-norm clip
                 (clip_grad_norm_hybrid) that counts each shard once across every dimension
    zero_pp.py   ZeRO-2 / ZeRO-3 over dp on a pipeline (and tp) stage: each gradient reduced once
                 per step, when its last micro-batch's backward ends; stage 3's two reshard policies
    training.py  train_hybrid (rank side, on train_loop), run_hybrid (parent), train_single (the
                 single-process twin), the traffic of each mesh dimension from the CommTracer
    figures.py   notebook 10's mesh picture and layout widget
    native.py    train_native_fsdp_tp: the same dp x tp, zero=3 run with torch's FSDP2 fully_shard
                 over DTensor TP, to hold the course's against (tests and bench_composed.py)

Rank placement and each dimension's traffic model live in course_lib/parallel/topology.py.
"""

from course_lib.dims import COMPOSED_ZERO_STAGES, PRECISIONS, ParallelDims
from course_lib.parallel.hybrid.compose import (HybridParts, build_hybrid, clip_grad_norm_hybrid, count_weights,
                                                full_state_dict, make_hybrid_optimizer, placements, sync_gradients,
                                                trained_module, trained_parameters)
from course_lib.parallel.hybrid.training import (HybridResult, dimension_of, make_forward_backward, merged_params,
                                                 owned_params, precision_context, run_hybrid, traffic_by_dimension,
                                                 train_hybrid,
                                                 train_single)
from course_lib.parallel.hybrid.native import run_native_fsdp_tp, train_native_fsdp_tp

__all__ = ["ParallelDims", "COMPOSED_ZERO_STAGES", "HybridParts", "build_hybrid", "make_hybrid_optimizer", "sync_gradients",
           "clip_grad_norm_hybrid", "count_weights", "trained_module", "trained_parameters", "placements", "full_state_dict", "HybridResult", "train_hybrid", "run_hybrid",
           "train_single", "merged_params", "traffic_by_dimension", "dimension_of", "make_forward_backward",
           "owned_params", "precision_context", "PRECISIONS", "train_native_fsdp_tp", "run_native_fsdp_tp"]
