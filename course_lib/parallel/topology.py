"""Rank placement: which mesh dimension's traffic crosses which link of a cluster (notebook 10).

Ranks are numbered node by node (ranks 0..G-1 on node 0, G = GPUs per node). The order of the
mesh dimensions decides which ranks form a group: with order (d_0, ..., d_4), d_4 innermost,

    rank = (((c_0 * n_1 + c_1) * n_2 + c_2) * n_3 + c_3) * n_4 + c_4,   stride(d_i) = n_{i+1} ... n_4

so a group of dimension d is {base + k * stride(d), k < n_d}, and it stays inside one node iff
no two of its ranks lie on different nodes (stride * n_d <= G, aligned: course_lib.dims.fits_node).
The groups are course_lib.dims.groups', the one geometry make_mesh's RankMesh is built from.
make_mesh uses TOPOLOGY_AWARE = ("pp", "dp", "ep", "cp", "tp"): tp innermost, on NVLink, cp
next; pp outermost, its point-to-point sends the only traffic that must leave the node. NAIVE
reverses it.

Traffic of one step, bytes sent, summed over all ranks: course_lib.estimate.traffic, one function
per axis (re-exported by each axis package), whose records the step-time model (notebook 11)
prices too. With e bytes per element, B global batch, R = dp * ep replicas, b = B / R rows per
replica, s sequence, d d_model, S = pp * v stages, V' the vocabulary padded to a multiple of tp,
m micro-batches, L blocks:

    tp  R * tp * m * [(4L + 2) all-reduces of b/m s d e (+ L under full recomputation) + the
        loss's 3 of b/m s fp32]; sequence parallelism: all-gathers and reduce-scatters instead
    pp  R * tp * [2 (S-1) b s d e  +  2 V' d e / tp (tied matrix)  +  4 (the loss)]  send/recv
    dp  ZeRO-1 per rank and flat unit of P_u elements: reduce-scatter sends dp*ceil(P_u/dp),
        all-gather ceil(P_u/dp); zero=0 all-reduces P_u           (+ 8 bytes: the step's loss)
    ep  per MoE layer: 4 all-to-alls of the routed rows (dispatch, combine, and their backward:
        B s top_k rows of d elements, summed over ranks; (ep-1)/ep of them leave the rank under
        uniform routing) + the counts (E int64 per rank and micro-batch) + the average of the
        dense gradients over ep (one all-reduce of every dense parameter a rank holds)
    cp  per block and micro-batch, the attention's exchange of keys and values (cp_method: the
        ring's sends, the all-gather and its reduce-scatter, or Ulysses' all-to-alls): cp_traffic

Time on a link: ring all-reduce 2(N-1) alpha + 2(N-1)/N S/beta; point-to-point alpha + S/beta
(course_lib.comm.costmodel's alpha-beta model; NVLink and InfiniBand figures from its CLUSTERS).
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.comm.costmodel import CLUSTERS, LinkModel
# the mesh geometry (orders, rank <-> coordinates, groups, which link a dimension crosses) is
# course_lib.dims': re-exported here, where notebook 10 and the traffic model read it
from course_lib.dims import (MESH_DIMS, MESH_ORDER, NAIVE, TOPOLOGY_AWARE, check_order, coordinates, fits_node, groups,
                             link_of, rank_of)
# each axis's traffic: the records the step-time model (notebook 11) prices too
from course_lib.estimate.traffic import step_traffic


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


def traffic_per_step(config, dims, batch_size: int, seq: int | None = None, dtype_bytes: int = 4) -> dict:
    """{dim: {"op", "bytes_sent" (summed over all ranks), "bytes_per_rank", "message_bytes"}} of
    one step under `dims` (a ParallelDims): each axis's records (course_lib.estimate.traffic, the
    model the step-time estimate prices too), every element `dtype_bytes` on the wire (but for
    what a bf16 run, dims.precision, sends as bf16), and dims.recompute's repeated collectives.
    The squared norm's all-reduce (over the world) is left out: the tracer files it under "world"."""
    records = step_traffic(config, dims, batch_size, seq, dtype_bytes)
    out = {}
    for dim in ("tp", "pp", "dp", "ep", "cp"):
        if getattr(dims, dim) == 1:
            continue
        rows = records[dim]
        main = [r for r in rows if r.op == rows[0].op and not r.report]
        # a message of the average rank: the dp flat unit (ranks differ: stages, tp copies), else rank 0's
        message = sum(r.world_bytes for r in main) / dims.world_size / main[0].calls if dim == "dp" else main[0].nbytes
        op = CP_OPS[dims.cp_method] if dim == "cp" else OPS[dim] if dim != "dp" or dims.zero else "all_reduce"
        out[dim] = {"op": op,
                    "bytes_sent": sum(r.world_bytes for r in rows), "message_bytes": message}
    for row in out.values():
        row["bytes_per_rank"] = row["bytes_sent"] / dims.world_size
    return out


OPS = {"tp": "all_reduce", "pp": "send/recv", "dp": "reduce_scatter+all_gather", "ep": "all_to_all"}
CP_OPS = {"ring": "send/recv", "allgather": "reduce_scatter+all_gather", "ulysses": "all_to_all"}  # by cp_method


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
