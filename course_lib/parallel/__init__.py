"""Parallel training strategies: one sub-package per mesh axis.

    mesh.py    make_mesh(dims): this rank's RankMesh, every strategy's groups: the five axes (size 1
               included) and the derived groups of course_lib.dims.DERIVED_GROUPS
    clip.py    clip_grad_norm_(grads_and_weights, max_norm, group): the one global-norm clip; each
               axis passes its pieces with weight 1 / copies, so every element is counted once
    placement.py  Placement: how an axis splits (or replicates) a tensor: which dim, which ranks
               hold which rows, how many copies; the full state dict, the clip's weights and the
               checkpoint boxes read it for every axis
    dp/        data parallelism: DDP (notebook 03)
    tp/        tensor (and sequence) parallelism (notebook 05)
    pp/        pipeline parallelism (notebook 06)
    ep/        expert parallelism for mixture-of-experts models (notebook 07)
    zero/      ZeRO stages 1-3 / FSDP and offload (notebook 08)
    cp/        context parallelism: ring, all-gather and Ulysses attention (notebook 09)
    hybrid/    the ordered composition of the axes on one mesh (notebook 10)
    diloco/    LocalSGD and DiLoCo: replicas that meet every H steps
    ft/        fault-tolerant replica groups: a per-step quorum, a restarted replica healed from a peer
    topology.py  a cluster's links and each mesh axis's traffic on them

Convention: a strategy is `apply_<x>(model, group_or_mesh, ...)`, which turns the plain
single-process model into its parallel form in place (wrapping or swapping modules) and
returns it, plus at most one rank-side training function. A multi-dimensional run is an
ordered list of such calls on the groups of one mesh.

The data-parallel names stay importable from here: `from course_lib.parallel import DDP`.
"""

from course_lib.parallel.dp import (
    DDP,
    LowPrecisionHook,
    TopKHook,
    assign_buckets,
    broadcast_parameters,
    check_replicas,
    naive_all_reduce_gradients,
    run_data_parallel,
    train_data_parallel,
)
from course_lib.parallel.mesh import RankMesh, check_mesh, make_mesh, mesh_groups, mesh_layout

__all__ = [
    "DDP", "naive_all_reduce_gradients", "check_replicas", "broadcast_parameters", "assign_buckets",
    "train_data_parallel", "run_data_parallel", "LowPrecisionHook", "TopKHook",
    "make_mesh", "check_mesh", "mesh_groups", "mesh_layout", "RankMesh",
]
