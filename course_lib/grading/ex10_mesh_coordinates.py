"""Checkers of exercise 10 (mesh coordinates, groups and the links they cross).

The learner writes coordinates(rank, sizes, order), groups(sizes, order), link_of(dim, sizes,
gpus_per_node, order), inter_node_bytes(bytes_per_rank, sizes, gpus_per_node, order) and
best_order(sizes, gpus_per_node, bytes_per_rank) (the design decision: which order keeps the
heaviest traffic inside the nodes; graded on layouts where make_mesh's order is not the best). Each
function is graded three ways, and never against the library's own bookkeeping
(course_lib.parallel.topology, mesh_groups), which REFUSE keeps out of the learner's module:

* values worked out by hand, stored as digests (course_lib.grading.stored: each is
  digest(the reference solution's answers on those inputs), checked against the hand
  derivation when stored), so reading this module gives no answer;
* a real device mesh on 8 ranks: make_mesh's (order pp, dp, ep, tp) and, for other orders,
  torch's init_device_mesh with the dimensions listed in that order (a DeviceMesh numbers
  its ranks row-major, the last dimension fastest: the rule the exercise states);
* properties every right answer has: the groups of a dimension partition the ranks, each has
  sizes[dim] members that agree on every other coordinate; a dimension's link is "intra"
  exactly when each of its groups lies inside one node.

Each check prints `PASS  ...` and shows no reference answer; a failure raises CheckFailed with
the learner's value and a hint, never the expected one.
"""

from __future__ import annotations

import itertools

import math

from course_lib.estimate.params import LLAMA3_405B
from course_lib.grading import CheckFailed, passed
from course_lib.grading.stored import check_digest
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


def _agree(label: str, got, expected, hint: str) -> None:
    """Pass when got == expected; a failure shows the learner's value and the hint, not expected."""
    if got != expected:
        raise CheckFailed(f"{label}: your code in student.py gives {got!r}\n {hint}")
    passed(label)


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
# Worked out by hand (digest of the five answers, in this order)
BY_HAND_COORDINATES = [(5, SMALL, DIMS), (6, SMALL, DIMS), (6, SMALL, NAIVE), (13, dict(pp=2, dp=2, ep=1, tp=4), DIMS),
                       (13, dict(pp=2, dp=2, ep=1, tp=4), NAIVE)]
COORDINATES_BY_HAND = "2fb4f4e5e8a46166443c8cb3ff45be86bc5a55ffdca4db2fa6467dd172cfcc44"
NUMBERING = "Number the ranks of the layout on paper: the LAST dimension of the order varies fastest."


def check_coordinates(student):
    got = [dict(student.coordinates(rank, sizes, order)) for rank, sizes, order in BY_HAND_COORDINATES]
    check_digest("ranks " + ", ".join(f"{rank} of {_show(sizes, order)}" for rank, sizes, order in BY_HAND_COORDINATES)
                 + " (worked out by hand)", got, COORDINATES_BY_HAND, hint=NUMBERING)
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
        _agree(f"{world} ranks of {_show(sizes, order)}: one coordinate each, in range, {last} fastest", broken, [],
               "Each line above is a rule your coordinates break.")
    facts = real_mesh_facts()
    for i, (sizes, order) in enumerate(REAL_CASES):
        _agree(f"every rank of {_show(sizes, order)} against a real mesh on 8 ranks",
               [dict(student.coordinates(r, sizes, order)) for r in range(8)], [f[i][0] for f in facts], NUMBERING)


# ------------------------------------------------------------------ 2. groups
# Worked out by hand: every dimension's groups of SMALL in order NAIVE, and dp's in make_mesh's order
GROUPS_BY_HAND = "6364e924cc21a28e6f8f8320e9094ca8fd37cebf47450fa806c5de94857175c7"
DP_BY_HAND = "88ba6dc5aabe8b5316d8fc5d63b6d8105eeb3138cfcd14c01e1df9ca8f6dafce"
GROUPING = ("A group of a dimension holds the ranks whose coordinates differ only along it, sorted; the groups "
            "are listed by their smallest rank.")


def _as_lists(groups) -> dict:
    return {d: [list(g) for g in groups[d]] for d in DIMS} if set(groups) >= set(DIMS) else dict(groups)


def check_groups(student):
    check_digest(f"dp groups of {_show(SMALL, DIMS)} (worked out by hand)", _as_lists(student.groups(SMALL))["dp"],
                 DP_BY_HAND, hint=GROUPING)
    check_digest(f"groups of {_show(SMALL, NAIVE)} (worked out by hand)", _as_lists(student.groups(SMALL, NAIVE)),
                 GROUPS_BY_HAND, hint=GROUPING + " " + NUMBERING)
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
        _agree(f"groups of {_show(sizes, order)}: for each dimension they partition the {world} ranks, "
               f"sizes[dim] ranks each, differing only along dim", broken, [], "Each line above is a rule your groups break.")
    facts = real_mesh_facts()
    for i, (sizes, order) in enumerate(REAL_CASES):
        mine = _as_lists(student.groups(sizes, order))
        expected = {d: [list(g) for g in sorted({tuple(f[i][1][d]) for f in facts})] for d in DIMS}
        _agree(f"groups of {_show(sizes, order)} against a real mesh on 8 ranks", mine, expected, GROUPING)


# ------------------------------------------------------------------ 3. links
# Worked out by hand: every dimension's link for BIG (1024 ranks) on nodes of 8 and SMALL on nodes
# of 4, each in both orders (digest of the four answers, in this order)
BIG = dict(pp=16, dp=8, ep=1, tp=8)
BY_HAND_LINKS = [(BIG, 8, DIMS), (BIG, 8, NAIVE), (SMALL, 4, DIMS), (SMALL, 4, NAIVE)]
LINKS_BY_HAND = "f8a9c288e0cfabf3aaa6fa84600900ad554f476e03fb39f111c1d37416559c87"
LINKING = ('"intra" only when EVERY group of the dimension sits in one node (ranks G*k .. G*k + G - 1): a group '
           'small enough for a node may still straddle two.')
# By the rule on the learner's own groups (checked above), including layouts whose groups fit a node
# in size but straddle two (tp 3 on nodes of 4: {3, 4, 5}) and nodes larger than the world.
LINK_CASES = [(dict(pp=2, dp=1, ep=1, tp=3), 4, DIMS), (dict(pp=2, dp=1, ep=1, tp=3), 6, DIMS),
              (dict(pp=2, dp=3, ep=1, tp=4), 8, DIMS), (dict(pp=2, dp=3, ep=1, tp=4), 6, NAIVE),
              (dict(pp=3, dp=2, ep=2, tp=2), 4, ("dp", "tp", "pp", "ep")), (SMALL, 16, NAIVE)]


def check_links(student):
    got = [{d: student.link_of(d, sizes, gpn, order) for d in DIMS} for sizes, gpn, order in BY_HAND_LINKS]
    check_digest("links of " + "; ".join(f"{_show(sizes, order)} on nodes of {gpn}" for sizes, gpn, order in BY_HAND_LINKS)
                 + " (worked out by hand)", got, LINKS_BY_HAND, hint=LINKING)
    for sizes, gpn, order in LINK_CASES:
        groups = _as_lists(student.groups(sizes, order))
        expected = {d: "none" if sizes[d] == 1 else
                    "intra" if all(len({r // gpn for r in g}) == 1 for g in groups[d]) else "inter" for d in DIMS}
        _agree(f"links of {_show(sizes, order)} on nodes of {gpn}: \"intra\" iff every group is in one node",
               {d: student.link_of(d, sizes, gpn, order) for d in DIMS}, expected, LINKING)


# ------------------------------------------------------------------ 4. bytes that leave the node
# By hand: bytes chosen as distinct powers of two, so each total names the dimensions it summed
# (digest of the two totals for BIG on nodes of 8, make_mesh's order then NAIVE, as integers).
POWERS = {"tp": 2.0 ** 20, "pp": 2.0 ** 10, "dp": 1.0}
BYTES_BY_HAND = "a1141419cff4049c47c596ba6e2bfd1fafbc0ac8f7f0cfce9857cecf6b994f4c"


def _exact(x):
    """A whole float as an int (what the digest takes); anything else as it is."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def llama3_traffic() -> dict:
    """Bytes per rank and step of each dimension for Llama 3 405B on BIG (bf16, 128 sequences of
    8192 tokens, 16 micro-batches), from the course's traffic model (notebook 10, section 7)."""
    dims = ParallelDims(**BIG, microbatches=16)
    return {d: row["bytes_per_rank"] for d, row in traffic_per_step(LLAMA3_405B, dims, 128, seq=8192,
                                                                       dtype_bytes=2).items()}


def check_network_bytes(student):
    got = [_exact(student.inter_node_bytes(dict(POWERS), BIG, 8, order)) for order in (DIMS, NAIVE)]
    check_digest(f"bytes leaving the node, {_show(BIG, DIMS)} and in order ({', '.join(NAIVE)}), one distinct power "
                 f"of two per dimension (worked out by hand)", got, BYTES_BY_HAND,
                 hint="Each total is a sum of distinct powers of two: read off which dimensions you counted. Only "
                      "the bytes of dimensions whose link is \"inter\" leave the node.")
    traffic = llama3_traffic()
    for order in (DIMS, NAIVE):
        # the links are the learner's own, checked by hand above; float64 sums of 2-3 terms, perhaps
        # in another order: at most a few units of 2^-53 apart
        want = sum(traffic[d] for d in traffic if student.link_of(d, BIG, 8, order) == "inter")
        got = student.inter_node_bytes(dict(traffic), BIG, 8, order)
        if not math.isclose(got, want, rel_tol=1e-12, abs_tol=0):
            raise CheckFailed(f"bytes leaving the node for Llama 3 405B, {_show(BIG, order)}: your inter_node_bytes "
                              f"in student.py gives {got:.6g}, not the sum of the bytes of the dimensions your link_of "
                              f"calls \"inter\"")
        passed(f"bytes leaving the node for Llama 3 405B, {_show(BIG, order)}")


# ------------------------------------------------------------------ 5. the best order
# Layouts and made-up bytes where the heaviest traffic is not tp's, so make_mesh's order (tp
# innermost) is not the best; and Llama 3 405B's own traffic on BIG.
BEST_ORDER_CASES = [
    (dict(pp=2, dp=4, ep=1, tp=2), 4, {"dp": 2.0 ** 20, "tp": 2.0 ** 10, "pp": 1.0}),
    (dict(pp=1, dp=2, ep=4, tp=2), 4, {"ep": 2.0 ** 20, "tp": 2.0 ** 10, "dp": 1.0}),
    (dict(pp=4, dp=2, ep=1, tp=2), 4, {"pp": 2.0 ** 20, "dp": 2.0 ** 10, "tp": 1.0}),
]


def check_best_order(student):
    """best_order's order sends as few bytes over the network as any of the 24 orders, by the
    learner's own inter_node_bytes (checked above)."""
    cases = [*BEST_ORDER_CASES, (BIG, 8, llama3_traffic())]
    for sizes, gpn, traffic in cases:
        label = f"best_order for {' x '.join(f'{d} {sizes[d]}' for d in DIMS)} on nodes of {gpn}"
        order = student.best_order(dict(sizes), gpn, dict(traffic))
        if not isinstance(order, (tuple, list)) or sorted(order) != sorted(DIMS):
            raise CheckFailed(f"{label}: best_order in student.py returned {order!r}, not an order of {DIMS}")
        sent = student.inter_node_bytes(dict(traffic), sizes, gpn, tuple(order))
        fewest = min(student.inter_node_bytes(dict(traffic), sizes, gpn, o) for o in itertools.permutations(DIMS))
        if sent > fewest:
            raise CheckFailed(f"{label}: best_order in student.py returns {tuple(order)}, which sends {sent:.6g} bytes "
                              f"per rank over the network; another order sends fewer.\n Which dimension sends the "
                              f"most, and where in the order must it sit for its groups to stay inside a node?")
        passed(f"{label}: no order sends fewer bytes over the network")
