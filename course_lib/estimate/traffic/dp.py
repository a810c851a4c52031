"""Data parallelism's and ZeRO's collectives of one step, and the global norm's (course_lib.estimate.traffic: the notation)."""

from __future__ import annotations

from dataclasses import replace

from course_lib.estimate.per_gpu import zero_units
from course_lib.estimate.traffic.records import Collective, _shape, ddp_buckets, replica_group_params


def dp_traffic(config, dims, batch_size: int, seq: int | None = None, local_params: int = 0,
               grad_bytes: int = 4, param_bytes: int | None = None) -> list[Collective]:
    """Data parallelism's (and ZeRO's) collectives. The step-time model prices the gradients of
    `local_params` (the busiest rank's, per_gpu_memory's) over dp * ep replicas (the experts'
    really over dp alone); world_bytes counts every rank's flat shards exactly
    (replica_group_params), over dp. With dp = 1 and ep > 1 nothing crosses a dp group: the
    records are the model's price of EP's dense average (calls 0)."""
    cp = dims.cp  # cp ranks hold whole weights: the gradients are reduced over dp * ep * cp
    replicas = dims.replicas * cp
    if replicas == 1:
        return []
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    m, dp, pb = dims.microbatches, dims.dp * cp, grad_bytes if param_bytes is None else param_bytes
    grads, params, world = local_params * grad_bytes, local_params * pb, dims.world_size
    psi = replica_group_params(config, dims)  # the parameters of one data-parallel copy
    composed = dims.world_size > dims.dp  # an axis other than dp above 1: the hybrid runtime
    if dims.zero >= 2 and composed:  # reduced once per step (course_lib.parallel.hybrid.zero_pp)
        out = _composed_zero(config, dims, local_params, grad_bytes, pb)
    # the ZeRO engine (one all-reduce per parameter group) wherever the runtime composes
    elif dims.zero == 0 and composed:
        out = [Collective("dp", "all-reduce of the gradients (both groups' bytes)", "all_reduce", grads, replicas, 1,
                          dp * psi * grad_bytes),
               Collective("dp", "all-reduce of the second group (norms, biases)", "all_reduce", 0, replicas, 1, 0,
                          why="its bytes are counted with the first; priced at its latency")]
    elif dims.zero == 0:  # plain data parallelism: DDP's buckets
        out = [Collective("dp", f"DDP's bucket {i}", "all_reduce", size, replicas, 1, dp * psi * grad_bytes * size / grads)
               for i, size in enumerate(ddp_buckets(grads))]
    elif dims.zero == 1:
        out = [Collective("dp", "reduce-scatter of the gradients", "reduce_scatter", grads, replicas, 1,
                          dp * psi * grad_bytes),
               Collective("dp", "all-gather of the updated shards", "all_gather", params, replicas, 1, psi * pb)]
    elif dims.zero == 2:  # every rank taken as rank 0: the runtime composes stages 0 and 1 only
        out = [Collective("dp", "reduce-scatter of the gradients, every micro-batch", "reduce_scatter", grads,
                          replicas, m, world * m * grads),
               Collective("dp", "all-gather of the updated shards", "all_gather", params, replicas, 1,
                          world * params / replicas)]
    else:  # per micro-batch each block gathered in forward and again in backward, its gradient
        # scattered; the root (embeddings, norm, head) gathered once and kept until then
        u = l0 + 1
        out = [Collective("dp", "all-gathers of the blocks and the root", "all_gather", params / u, replicas,
                          m * (2 * l0 + 1), world * m * (2 * l0 + 1) * params / u / replicas),
               Collective("dp", "reduce-scatters of their gradients", "reduce_scatter", grads / u, replicas, m * u,
                          world * m * grads)]
    if dp == 1:
        return [replace(c, calls=0, world_bytes=0, priced=c.priced_calls, why="EP's dense average, priced as dp's")
                for c in out]
    return out + [Collective("dp", "the loss averaged over dp", "all_reduce", 8, dp, 1, 8 * world, report=True)]


def zero_pp_ops(config, dims, rank: int = 0, param_bytes: int = 4, grad_bytes: int = 4) -> dict[str, dict[str, int]]:
    """{op: {"calls", "bytes_sent"}} of one rank's ZeRO-2/3 collectives in one step when composed
    with pp / tp (what course_lib.observe.CommTracer counts on the dp group of a rank of pipeline
    rank `rank`). Its units P_u (per_gpu.zero_units), S_u = ceil(P_u / N) over N = dp*ep*cp ranks:

        reduce-scatter  once per unit and step (the gradient accumulated over the m micro-batches):
                        U calls, N sum_u S_u grad_bytes sent
        all-gather      zero 2: the updated shards, once per unit: U calls, sum_u S_u param_bytes
                        zero 3, reshard_after_forward=True: each unit gathered before every
                        micro-batch's forward and again before its backward: 2 m U calls,
                        2 m sum_u S_u param_bytes; False: once, kept for the step: U, sum_u S_u
                        param_bytes. The ratio of the two policies is 2m, calls and bytes."""
    n = dims.dp * dims.ep * dims.cp
    shards = [-(-p // n) for p in zero_units(config, dims, rank)]
    reshard = getattr(dims, "reshard_after_forward", True)
    gathers = 2 * dims.microbatches if dims.zero == 3 and reshard else 1
    return {"all_gather": {"calls": gathers * len(shards), "bytes_sent": gathers * sum(shards) * param_bytes},
            "reduce_scatter": {"calls": len(shards), "bytes_sent": n * sum(shards) * grad_bytes}}


def _composed_zero(config, dims, local_params, grad_bytes, param_bytes) -> list[Collective]:
    """dp_traffic's records for ZeRO-2/3 composed with pp / tp: rank 0's calls (zero_pp_ops),
    every rank's bytes (tp copies of each pipeline rank's, over its N dp ranks), priced as the
    busiest rank's average unit (local_params / U elements; rank 0's own when local_params is 0)."""
    n = dims.dp * dims.ep * dims.cp
    ranks = [zero_pp_ops(config, dims, r, param_bytes, grad_bytes) for r in range(dims.pp)]
    units = ranks[0]["reduce_scatter"]["calls"]
    local = local_params or ranks[0]["reduce_scatter"]["bytes_sent"] / grad_bytes  # N sum_u S_u

    def world(op):
        return dims.tp * n * sum(r[op]["bytes_sent"] for r in ranks)
    policy = ("2m per unit: freed after each forward and backward" if getattr(dims, "reshard_after_forward", True)
              else "once per unit: kept for the step") if dims.zero == 3 else "the updated shards, once per unit"
    return [Collective("dp", f"all-gathers of the units ({policy})", "all_gather", local * param_bytes / units, n,
                       ranks[0]["all_gather"]["calls"], world("all_gather")),
            Collective("dp", "reduce-scatter of each unit's gradient, once per step", "reduce_scatter",
                       local * grad_bytes / units, n, units, world("reduce_scatter"))]


def norm_traffic(dims) -> list[Collective]:
    """The squared global norm, one all-reduce over the world, when any rank holds a part of
    the model another does not (plain data parallelism clips its identical copies alone)."""
    if dims.world_size == 1 or not (dims.zero or dims.tp > 1 or dims.pp > 1 or dims.ep > 1):
        return []
    return [Collective("norm", "the squared global norm", "all_reduce", 8, dims.world_size, 1, 8 * dims.world_size)]
