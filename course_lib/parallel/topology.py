"""Rank placement: which mesh dimension's traffic crosses which link of a cluster (notebook 09).

Ranks are numbered node by node (ranks 0..G-1 on node 0, G = GPUs per node). The order of the
mesh dimensions decides which ranks form a group: with order (d_0, ..., d_3), d_3 innermost,

    rank = ((c_0 * n_1 + c_1) * n_2 + c_2) * n_3 + c_3,     stride(d_i) = n_{i+1} * ... * n_3

so a group of dimension d is {base + k * stride(d), k < n_d}, and it stays inside one node iff
no two of its ranks lie on different nodes (for the sizes here: stride * n_d <= G, aligned).
make_mesh uses TOPOLOGY_AWARE = ("pp", "dp", "ep", "tp"): tp innermost, on NVLink; pp
outermost, its point-to-point sends the only traffic that must leave the node. NAIVE reverses it.

Traffic of one step, bytes sent, summed over all ranks (e bytes per element, B global batch,
R = dp * ep replicas, b = B / R rows per replica, s sequence, d d_model, S = pp * v stages,
V' the vocabulary padded to a multiple of tp, m micro-batches):

    tp  R * tp * m * (Megatron's f and g on b/m rows: course_lib.parallel.tp.costs)  all-reduce
    pp  R * tp * [2 (S-1) b s d e  +  2 V' d e / tp (tied matrix)  +  4 (the loss)]  send/recv
    dp  ZeRO-1 per rank and flat unit of P_u elements: reduce-scatter sends dp*ceil(P_u/dp),
        all-gather ceil(P_u/dp); zero=0 all-reduces P_u           (+ 8 bytes: the step's loss)
    ep  per MoE layer: 4 all-to-alls of the routed rows (dispatch, combine, and their backward:
        B s top_k rows of d elements, summed over ranks; (ep-1)/ep of them leave the rank under
        uniform routing) + the counts (E int64 per rank and micro-batch) + the average of the
        dense gradients over ep (one all-reduce of every dense parameter a rank holds)

Time on a link: ring all-reduce 2(N-1) alpha + 2(N-1)/N S/beta; point-to-point alpha + S/beta
(course_lib.comm.costmodel's alpha-beta model; NVLink and InfiniBand figures from its CLUSTERS).
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.comm.costmodel import CLUSTERS, LinkModel
# the mesh geometry (orders, rank <-> coordinates, groups, which link a dimension crosses) is
# course_lib.dims': re-exported here, where notebook 09 and the traffic model read it
from course_lib.dims import MESH_DIMS, NAIVE, TOPOLOGY_AWARE, check_order, coordinates, groups, link_of, rank_of
from course_lib.estimate.params import param_breakdown, param_count
from course_lib.parallel.tp.costs import step_communication


@dataclass(frozen=True)
class ClusterShape:
    """gpus_per_node GPUs share NVLink (intra); nodes talk over InfiniBand (inter), per GPU."""

    gpus_per_node: int
    intra: LinkModel
    inter: LinkModel
    name: str = ""


DGX_H100 = ClusterShape(8, CLUSTERS["H100 NVLink 4 (intra-node)"], CLUSTERS["NDR InfiniBand 400 Gb/s (inter-node)"],
                        "DGX H100 nodes: NVLink 4 inside, NDR InfiniBand 400 Gb/s between")
DGX_A100 = ClusterShape(8, CLUSTERS["A100 NVLink 3 (intra-node)"], CLUSTERS["HDR InfiniBand 200 Gb/s (inter-node)"],
                        "DGX A100 nodes: NVLink 3 inside, HDR InfiniBand 200 Gb/s between")


def tp_replicated_params(config) -> int:
    """Parameters every tp rank keeps whole: norms, row-parallel biases, a position table."""
    parts, bias = param_breakdown(config), int(getattr(config, "bias", False))
    return config.n_layer * (parts["norms"] + 2 * config.d_model * bias) + parts["final_norm"] + parts["position"]


def traffic_per_step(config, dims, batch_size: int, seq: int | None = None, dtype_bytes: int = 4) -> dict:
    """{dim: {"op", "bytes_sent" (summed over all ranks), "bytes_per_rank", "message_bytes"}} of
    one step under `dims` (a ParallelDims), from the formulas in the module docstring. dp counts
    its flat units as one (the padding of each extra unit adds < dp elements per rank)."""
    s = config.block_size if seq is None else seq
    e, d, m, R = dtype_bytes, config.d_model, dims.microbatches, dims.dp * dims.ep
    b, world = batch_size // R, dims.world_size
    out = {}
    if dims.tp > 1:
        comm = step_communication(config, b // m, s, dims.tp, dims.sequence_parallel, e)
        sent = sum(row["bytes_sent"] for phase in comm.values() for row in phase.values())
        out["tp"] = {"op": "all_reduce", "bytes_sent": R * dims.tp * m * sent, "message_bytes": b // m * s * d * e}
    if dims.pp > 1:
        stages, vpad = dims.pp * dims.virtual_stages, padded_vocab(config, dims.tp)
        tied = 2 * vpad * d * e // dims.tp if getattr(config, "tie_weights", False) else 0
        out["pp"] = {"op": "send/recv", "bytes_sent": R * dims.tp * (2 * (stages - 1) * b * s * d * e + tied + 4),
                     "message_bytes": b // m * s * d * e}
    if dims.dp > 1:
        psi = replica_group_params(config, dims)  # over the pp*ep*tp ranks of one data-parallel copy
        factor = (dims.dp + 1) / dims.dp if dims.zero else 1.0
        sent = dims.dp * psi * factor * e + world * 8
        out["dp"] = {"op": "reduce_scatter+all_gather" if dims.zero else "all_reduce", "bytes_sent": sent,
                     "message_bytes": psi * e / (dims.pp * dims.ep * dims.tp)}
    if dims.ep > 1:
        rows = b * s * config.top_k  # a replica's routed rows per step
        a2a = R * 4 * config.n_layer * rows * d * e + config.n_layer * m * R * config.n_experts * 8
        tied = dims.pp > 1 and getattr(config, "tie_weights", False)
        dense = dense_params(config) + (padded_vocab(config, dims.tp) * d if tied else 0)
        sent = a2a + R * dense * e + world * 8  # + EP's average of the dense gradients, + the loss
        out["ep"] = {"op": "all_to_all", "bytes_sent": sent, "message_bytes": rows // m * d * e}
    for row in out.values():
        row["bytes_per_rank"] = row["bytes_sent"] / world
    return out


def padded_vocab(config, tp: int) -> int:
    return -(-config.vocab_size // tp) * tp


def total_params(config) -> int:
    """Every parameter once; the course's MoE GPT: the dense count with each MLP replaced by
    n_experts MLPs and a router (d x E, no bias)."""
    from dataclasses import replace

    experts = getattr(config, "n_experts", 0)
    if not experts:
        return param_count(config)
    dense = replace(config, n_experts=0)
    mlp = param_breakdown(dense)["mlp"]
    return param_count(dense) + config.n_layer * (mlp * (experts - 1) + config.d_model * experts)


def dense_params(config) -> int:
    """Parameters outside the experts (all of them for a dense model)."""
    experts = getattr(config, "n_experts", 0)
    if not experts:
        return total_params(config)
    from dataclasses import replace

    return total_params(config) - config.n_layer * experts * param_breakdown(replace(config, n_experts=0))["mlp"]


def replica_group_params(config, dims) -> int:
    """Parameters held by the pp*ep*tp ranks of one data-parallel copy, summed: a tp-replicated
    tensor counted tp times, dense tensors ep times, the tied matrix once more when the first
    and last stage differ, the vocabulary padding of tensor parallelism included."""
    vpad, d = padded_vocab(config, dims.tp), config.d_model
    n = total_params(config) + (vpad - config.vocab_size) * d * (1 if getattr(config, "tie_weights", False) else 2)
    n += (dims.tp - 1) * tp_replicated_params(config) if dims.tp > 1 else 0
    tied_copy = vpad * d if dims.pp > 1 and getattr(config, "tie_weights", False) else 0
    n += (dims.ep - 1) * dense_params(config) + dims.ep * tied_copy
    return n


def link_seconds(op: str, nbytes: float, n: int, link: LinkModel) -> float:
    """alpha-beta time of one message pattern: ring all-reduce, ring all-gather/reduce-scatter,
    all-to-all (pairwise) or point-to-point on `link`; nbytes is the message size."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes / link.beta
    if op in ("reduce_scatter+all_gather",):
        return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes / link.beta
    if op == "all_to_all":
        return (n - 1) * link.alpha + (n - 1) / n * nbytes * n / link.beta
    return link.alpha + nbytes / link.beta  # send/recv


def placement(config, dims, batch_size: int, cluster: ClusterShape = DGX_H100, order=TOPOLOGY_AWARE,
              seq: int | None = None, dtype_bytes: int = 2) -> list[dict]:
    """One row per communicating dim: bytes per rank per step, the link it crosses under `order`,
    and the alpha-beta seconds of that traffic on it (messages of message_bytes, serialised)."""
    sizes = dims.sizes()
    rows = []
    for dim, t in traffic_per_step(config, dims, batch_size, seq, dtype_bytes).items():
        kind = link_of(dim, sizes, cluster.gpus_per_node, order)
        link = cluster.intra if kind == "intra" else cluster.inter
        messages = max(1, round(t["bytes_per_rank"] / max(t["message_bytes"], 1)))
        per_message = link_seconds(t["op"], t["message_bytes"], sizes[dim], link)
        seconds = messages * per_message if t["op"] != "send/recv" else t["bytes_per_rank"] / link.beta
        rows.append({"dim": dim, "size": sizes[dim], "bytes_per_rank": t["bytes_per_rank"], "link": kind,
                     "link_name": link.name, "seconds": seconds})
    return rows


def compare_orders(config, dims, batch_size: int, cluster: ClusterShape = DGX_H100, seq: int | None = None,
                   dtype_bytes: int = 2) -> dict[str, float]:
    """Communication seconds per step, topology-aware order vs naive order."""
    return {name: sum(r["seconds"] for r in placement(config, dims, batch_size, cluster, order, seq, dtype_bytes))
            for name, order in (("topology_aware", TOPOLOGY_AWARE), ("naive", NAIVE))}
