"""Checkers of exercise 10 (mesh coordinates, groups and the links they cross).

The learner writes coordinates(rank, sizes, order), groups(sizes, order), link_of(dim, sizes,
gpus_per_node, order) and inter_node_bytes(bytes_per_rank, sizes, gpus_per_node, order). Each
function is graded three ways, and never against the library's own bookkeeping
(course_lib.parallel.topology, mesh_groups), which REFUSE keeps out of the learner's module:

* values worked out by hand, written below as literals with the derivation beside them;
* a real device mesh on 8 ranks: make_mesh's (order pp, dp, ep, tp) and, for other orders,
  torch's init_device_mesh with the dimensions listed in that order (a DeviceMesh numbers
  its ranks row-major, the last dimension fastest: the rule the exercise states);
* properties every right answer has: the groups of a dimension partition the ranks, each has
  sizes[dim] members that agree on every other coordinate; a dimension's link is "intra"
  exactly when each of its groups lies inside one node.

Each check prints `PASS  ...` and shows no reference answer; a failure raises CheckFailed with
got and expected.
"""

from __future__ import annotations

import math

from course_lib.estimate.params import LLAMA3_405B
from course_lib.grading import check_close, check_equal, passed
from course_lib.parallel.hybrid import ParallelDims
from course_lib.parallel.mesh import make_mesh
from course_lib.parallel.topology import traffic_per_step
from course_lib.runtime.pool import run_on_ranks

DIMS = ("pp", "dp", "ep", "tp")  # make_mesh's order, outermost first
NAIVE = ("tp", "ep", "dp", "pp")  # the reverse: pp varies fastest

# What the learner's module may not use. The whole topology module: every function in it is
# built on coordinates/groups/link_of (rank_of, placement, compare_orders), and naming the module
# also refuses `from ... import *`. mesh_groups (course_lib.parallel.mesh, re-exported by
# course_lib.parallel and course_lib) computes make_mesh's groups without processes.
REFUSE = ("course_lib.parallel.topology", "course_lib.parallel.mesh.mesh_groups",
          # where the geometry lives (course_lib.dims), topology re-exporting it
          "course_lib.dims.coordinates", "course_lib.dims.rank_of", "course_lib.dims.groups",
          "course_lib.dims.link_of")

SMALL = dict(pp=2, dp=2, ep=1, tp=2)  # 8 ranks
# The meshes built on 8 real ranks: (sizes, order). One launch builds all of them.
REAL_CASES = ((SMALL, DIMS), (SMALL, NAIVE), (dict(pp=1, dp=2, ep=2, tp=2), DIMS),
              (dict(pp=2, dp=1, ep=4, tp=1), DIMS), (dict(pp=1, dp=2, ep=2, tp=2), ("ep", "tp", "pp", "dp")))
# Checked by properties only (no processes): 24 ranks, a size 3 to catch a modulo by the wrong size.
PROPERTY_CASES = ((dict(pp=2, dp=3, ep=1, tp=4), DIMS), (dict(pp=2, dp=3, ep=1, tp=4), NAIVE),
                  (dict(pp=3, dp=2, ep=2, tp=2), ("dp", "tp", "pp", "ep")))


def _show(sizes, order) -> str:
    where = "make_mesh's order" if tuple(order) == DIMS else f"order ({', '.join(order)})"
    return " x ".join(f"{d} {sizes[d]}" for d in DIMS) + f" in {where}"


# ------------------------------------------------------------------ the real mesh, on 8 ranks
def mesh_facts(cases):
    """Rank code: for each (sizes, order), this rank's coordinates and, per dimension, the sorted
    ranks of its group, read from a real DeviceMesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # make_mesh's rule
    out = []
    for sizes, order in cases:
        if tuple(order) == DIMS:
            mesh = make_mesh(**sizes)
        else:
            mesh = init_device_mesh(device, tuple(sizes[d] for d in order), mesh_dim_names=tuple(order))
        coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        ranks = {d: sorted(dist.get_process_group_ranks(mesh[d].get_group())) for d in mesh.mesh_dim_names}
        out.append(({d: coords[d] for d in DIMS}, ranks))
    return out


_FACTS: list = []  # one launch per kernel: [per rank: [per case: (coords, groups)]]


def real_mesh_facts():
    if not _FACTS:
        _FACTS.extend(run_on_ranks(mesh_facts, REAL_CASES, world_size=8, timeout_s=120))
    return _FACTS


# ------------------------------------------------------------------ 1. coordinates
# By hand, for pp 2 x dp 2 x ep 1 x tp 2. make_mesh's order: rank = ((pp*2 + dp)*1 + ep)*2 + tp,
# so rank 5 = 4 + 1 -> pp 1, dp 0, tp 1 and rank 6 = 4 + 2 -> pp 1, dp 1, tp 0. Order (tp, ep, dp, pp):
# rank = ((tp*1 + ep)*2 + dp)*2 + pp, so rank 6 = 4 + 2 -> tp 1, dp 1, pp 0.
# pp 2 x dp 2 x ep 1 x tp 4 (16 ranks), rank 13: make_mesh's order 13 = 8 + 4 + 1 -> pp 1, dp 1, tp 1;
# order (tp, ep, dp, pp): rank = tp*4 + dp*2 + pp, 13 = 12 + 1 -> tp 3, dp 0, pp 1.
BY_HAND_COORDINATES = [
    (5, SMALL, DIMS, {"pp": 1, "dp": 0, "ep": 0, "tp": 1}),
    (6, SMALL, DIMS, {"pp": 1, "dp": 1, "ep": 0, "tp": 0}),
    (6, SMALL, NAIVE, {"pp": 0, "dp": 1, "ep": 0, "tp": 1}),
    (13, dict(pp=2, dp=2, ep=1, tp=4), DIMS, {"pp": 1, "dp": 1, "ep": 0, "tp": 1}),
    (13, dict(pp=2, dp=2, ep=1, tp=4), NAIVE, {"pp": 1, "dp": 0, "ep": 0, "tp": 3}),
]


def check_coordinates(student):
    for rank, sizes, order, expected in BY_HAND_COORDINATES:
        check_equal(f"rank {rank} of {_show(sizes, order)} (worked out by hand)",
                    dict(student.coordinates(rank, sizes, order)), expected)
    for sizes, order in PROPERTY_CASES:
        world = math.prod(sizes.values())
        got = [dict(student.coordinates(r, sizes, order)) for r in range(world)]
        broken = [f"rank {r}: {c} is not one index per dimension, each below its size" for r, c in enumerate(got)
                  if set(c) != set(DIMS) or not all(0 <= c[d] < sizes[d] for d in DIMS)][:1]
        seen = {}
        for r, c in enumerate(got):
            seen.setdefault(tuple(c.get(d) for d in DIMS), []).append(r)
        broken += [f"ranks {rs} get the same coordinates" for rs in seen.values() if len(rs) > 1][:1]
        last = order[-1]  # rank r + 1 is one step further along the last dimension of the order, or wraps to 0
        broken += [f"ranks {r} and {r + 1}: {last} goes {got[r].get(last)} -> {got[r + 1].get(last)}"
                   for r in range(world - 1) if got[r + 1].get(last) != (got[r].get(last, 0) + 1) % sizes[last]][:1]
        check_equal(f"{world} ranks of {_show(sizes, order)}: one coordinate each, in range, "
                    f"{last} fastest", broken, [])
    facts = real_mesh_facts()
    for i, (sizes, order) in enumerate(REAL_CASES):
        check_equal(f"every rank of {_show(sizes, order)} against a real mesh on 8 ranks",
                    [dict(student.coordinates(r, sizes, order)) for r in range(8)], [f[i][0] for f in facts])


# ------------------------------------------------------------------ 2. groups
# By hand, pp 2 x dp 2 x ep 1 x tp 2 in order (tp, ep, dp, pp): rank = tp*4 + dp*2 + pp (ep has size 1),
# so pp groups are pairs 1 apart, dp pairs 2 apart, tp pairs 4 apart, every ep group one rank.
BY_HAND_GROUPS = {
    "pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "ep": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "tp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}
# make_mesh's order (the stub's docstring example): dp has stride ep*tp = 2.
BY_HAND_DP = [[0, 2], [1, 3], [4, 6], [5, 7]]


def _as_lists(groups) -> dict:
    return {d: [list(g) for g in groups[d]] for d in DIMS} if set(groups) >= set(DIMS) else dict(groups)


def check_groups(student):
    check_equal(f"dp groups of {_show(SMALL, DIMS)} (worked out by hand)", _as_lists(student.groups(SMALL))["dp"],
                BY_HAND_DP)
    check_equal(f"groups of {_show(SMALL, NAIVE)} (worked out by hand)", _as_lists(student.groups(SMALL, NAIVE)),
                BY_HAND_GROUPS)
    for sizes, order in PROPERTY_CASES:
        world, mine = math.prod(sizes.values()), _as_lists(student.groups(sizes, order))
        coords = [dict(student.coordinates(r, sizes, order)) for r in range(world)]
        broken = []
        for dim in DIMS:
            gs = [list(g) for g in mine.get(dim, [])]
            if sorted(r for g in gs for r in g) != list(range(world)):
                broken.append(f"{dim}: the groups do not hold every rank 0..{world - 1} exactly once")
            broken += [f"{dim}: group {g} has {len(g)} ranks, not {sizes[dim]}" for g in gs if len(g) != sizes[dim]][:1]
            if not all(g == sorted(g) for g in gs) or [g[:1] for g in gs] != sorted(g[:1] for g in gs):
                broken.append(f"{dim}: each group sorted, the groups in order of their smallest rank")
            # members agree on every coordinate but dim's, and take each of dim's values once
            broken += [f"{dim}: group {g} is not ranks that differ only along {dim}" for g in gs
                       if len({tuple(coords[r][d] for d in DIMS if d != dim) for r in g if 0 <= r < world}) != 1
                       or sorted(coords[r][dim] for r in g if 0 <= r < world) != list(range(sizes[dim]))][:1]
        check_equal(f"groups of {_show(sizes, order)}: for each dimension they partition the {world} ranks, "
                    f"sizes[dim] ranks each, differing only along dim", broken, [])
    facts = real_mesh_facts()
    for i, (sizes, order) in enumerate(REAL_CASES):
        mine = _as_lists(student.groups(sizes, order))
        expected = {d: [list(g) for g in sorted({tuple(f[i][1][d]) for f in facts})] for d in DIMS}
        check_equal(f"groups of {_show(sizes, order)} against a real mesh on 8 ranks", mine, expected)


# ------------------------------------------------------------------ 3. links
# By hand. pp 16 x dp 8 x ep 1 x tp 8 = 1024 ranks on nodes of 8, make_mesh's order: tp has stride 1
# and spans ranks 8k..8k+7, one node; dp has stride 8 (crosses), pp stride 64 (crosses); ep size 1.
# Order (tp, ep, dp, pp): pp stride 1 but 16 members (two nodes), dp stride 16, tp stride 128: all cross.
# pp 2 x dp 2 x ep 1 x tp 2 on nodes of 4: make_mesh's order tp {0,1} and dp {0,2} stay in {0..3}, pp {0,4}
# crosses; order (tp, ep, dp, pp): pp {0,1} and dp {0,2} stay in, tp {0,4} crosses.
BIG = dict(pp=16, dp=8, ep=1, tp=8)
BY_HAND_LINKS = [
    (BIG, 8, DIMS, {"pp": "inter", "dp": "inter", "ep": "none", "tp": "intra"}),
    (BIG, 8, NAIVE, {"pp": "inter", "dp": "inter", "ep": "none", "tp": "inter"}),
    (SMALL, 4, DIMS, {"pp": "inter", "dp": "intra", "ep": "none", "tp": "intra"}),
    (SMALL, 4, NAIVE, {"pp": "intra", "dp": "intra", "ep": "none", "tp": "inter"}),
]
# By the rule on the learner's own groups (checked above), including layouts whose groups fit a node
# in size but straddle two (tp 3 on nodes of 4: {3, 4, 5}) and nodes larger than the world.
LINK_CASES = [(dict(pp=2, dp=1, ep=1, tp=3), 4, DIMS), (dict(pp=2, dp=1, ep=1, tp=3), 6, DIMS),
              (dict(pp=2, dp=3, ep=1, tp=4), 8, DIMS), (dict(pp=2, dp=3, ep=1, tp=4), 6, NAIVE),
              (dict(pp=3, dp=2, ep=2, tp=2), 4, ("dp", "tp", "pp", "ep")), (SMALL, 16, NAIVE)]


def check_links(student):
    for sizes, gpn, order, expected in BY_HAND_LINKS:
        check_equal(f"links of {_show(sizes, order)} on nodes of {gpn} (worked out by hand)",
                    {d: student.link_of(d, sizes, gpn, order) for d in DIMS}, expected)
    for sizes, gpn, order in LINK_CASES:
        groups = _as_lists(student.groups(sizes, order))
        expected = {d: "none" if sizes[d] == 1 else
                    "intra" if all(len({r // gpn for r in g}) == 1 for g in groups[d]) else "inter" for d in DIMS}
        check_equal(f"links of {_show(sizes, order)} on nodes of {gpn}: \"intra\" iff every group is in one node",
                    {d: student.link_of(d, sizes, gpn, order) for d in DIMS}, expected)


# ------------------------------------------------------------------ 4. bytes that leave the node
# By hand: bytes chosen as distinct powers of two, so each total names the dimensions it summed.
# BIG on nodes of 8 (links above): make_mesh's order sends pp and dp over the network, 2^10 + 1;
# order (tp, ep, dp, pp) sends all three, 2^20 + 2^10 + 1.
POWERS = {"tp": 2.0 ** 20, "pp": 2.0 ** 10, "dp": 1.0}
BY_HAND_BYTES = [(DIMS, 1025.0), (NAIVE, 1049601.0)]
BY_HAND_INTER = {DIMS: ("pp", "dp"), NAIVE: ("tp", "pp", "dp")}  # from BY_HAND_LINKS' BIG rows


def llama3_traffic() -> dict:
    """Bytes per rank and step of each dimension for Llama 3 405B on BIG (bf16, 128 sequences of
    8192 tokens, 16 micro-batches), from the course's traffic model (notebook 10, section 7)."""
    dims = ParallelDims(**BIG, microbatches=16)
    return {d: row["bytes_per_rank"] for d, row in traffic_per_step(LLAMA3_405B, dims, 128, seq=8192,
                                                                       dtype_bytes=2).items()}


def check_network_bytes(student):
    for order, expected in BY_HAND_BYTES:
        check_equal(f"bytes leaving the node, {_show(BIG, order)}, one distinct power of two per dimension "
                    f"(worked out by hand)", student.inter_node_bytes(dict(POWERS), BIG, 8, order), expected)
    traffic = llama3_traffic()
    for order, inter in BY_HAND_INTER.items():
        # float64 sums of 2-3 terms, perhaps in another order: at most a few units of 2^-53 apart
        check_close(f"bytes leaving the node for Llama 3 405B, {_show(BIG, order)}",
                    student.inter_node_bytes(dict(traffic), BIG, 8, order), sum(traffic[d] for d in inter),
                    rtol=1e-12, atol=0)
