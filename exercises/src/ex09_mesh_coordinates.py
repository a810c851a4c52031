# %% [markdown]
# # Exercise 09: mesh coordinates, groups and the links they cross
#
# **Goal.** Write the bookkeeping of a 4-D device mesh in
# `exercises/ex09_mesh_coordinates/student.py` (notebook `09_3d_parallelism` explains every
# idea used here; re-read §1 for the numbering, §2 for the groups, §6 for nodes and links):
#
# 1. `coordinates(rank, sizes, order)`: a rank's index along pp, dp, ep and tp;
# 2. `groups(sizes, order)`: the process groups of every dimension;
# 3. `link_of(dim, sizes, gpus_per_node, order)`: does that dimension stay inside a node?
# 4. `inter_node_bytes(bytes_per_rank, sizes, gpus_per_node, order)`: how much of a step's
#    traffic crosses the network.
#
# **Think first.** 16 ranks, `pp 2, dp 2, ep 1, tp 4`, nodes of 8 GPUs. In make_mesh's order,
# which ranks form rank 13's dp group? Does dp cross nodes? And in the order
# `("tp", "ep", "dp", "pp")`?
#
# <details><summary>Answer</summary>
#
# make_mesh's order: rank 13 = (pp 1, dp 1, tp 1); dp's stride is `ep · tp = 4`: {9, 13}, both
# on node 1; every dp group spans 8 ranks starting at a multiple of 8, so dp stays inside a
# node. Reversed order: pp varies fastest (stride 1), dp has stride 2: rank 13 is tp 3, dp 0,
# pp 1 and its dp group is {13, 15}, still inside node 1; but tp now has stride 4 and spans 16
# ranks: tp crosses the network.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your coordinates and groups are compared
# with what `make_mesh` builds on 8 real ranks; your links and network bytes with the course's
# traffic model on a 1024-GPU layout (no processes). Edit `student.py`, then *Kernel → Restart
# and run all*.

# %%
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.estimate.params import LLAMA3_405B
from course_lib.grading import check_close, check_equal, load_student
from course_lib.parallel import make_mesh, topology
from course_lib.parallel.hybrid import ParallelDims

student = load_student("ex09_mesh_coordinates")
NAIVE = ("tp", "ep", "dp", "pp")

# %% [markdown]
# ## Check 1: coordinates, by hand and against make_mesh on 8 ranks

# %%
SIZES = dict(pp=2, dp=2, ep=1, tp=2)
check_equal("rank 5 of pp 2 x dp 2 x tp 2", student.coordinates(5, SIZES), {"pp": 1, "dp": 0, "ep": 0, "tp": 1})
check_equal("rank 6 (make_mesh's order)", student.coordinates(6, SIZES), {"pp": 1, "dp": 1, "ep": 0, "tp": 0})
check_equal("rank 6, order (tp, ep, dp, pp): pp varies fastest", student.coordinates(6, SIZES, NAIVE),
            {"pp": 0, "dp": 1, "ep": 0, "tp": 1})


def mesh_facts(sizes):
    """Rank code: this rank's coordinates and groups, as make_mesh builds them."""
    mesh = make_mesh(**sizes)
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    ranks = {d: sorted(dist.get_process_group_ranks(mesh[d].get_group())) for d in mesh.mesh_dim_names}
    return coords, ranks


for sizes in (SIZES, dict(pp=1, dp=2, ep=2, tp=2), dict(pp=2, dp=1, ep=4, tp=1)):
    facts = run_on_ranks(mesh_facts, sizes, world_size=8, timeout_s=120)
    check_equal(f"coordinates of every rank, {sizes}", [student.coordinates(r, sizes) for r in range(8)],
                [c for c, _ in facts])

# %% [markdown]
# ## Check 2: the groups of every dimension

# %%
for sizes in (SIZES, dict(pp=1, dp=2, ep=2, tp=2), dict(pp=2, dp=1, ep=4, tp=1)):
    facts = run_on_ranks(mesh_facts, sizes, world_size=8, timeout_s=120)
    mine = student.groups(sizes)
    for dim in ("pp", "dp", "ep", "tp"):
        expected = sorted({tuple(r[dim]) for _, r in facts})
        check_equal(f"{dim} groups of {sizes}", [tuple(g) for g in mine[dim]], expected)
check_equal("groups in another order: (tp, ep, dp, pp)", student.groups(SIZES, NAIVE),
            topology.groups(SIZES, NAIVE))

# %% [markdown]
# ## Check 3: links on a 1024-GPU cluster, and the bytes that leave the node
#
# Megatron-style layout tp 8 × pp 16 × dp 8 on nodes of 8 GPUs, make_mesh's order and the
# naive one. The bytes per rank and step come from the course's traffic model for Llama 3 405B
# (bf16, 128 sequences of 8192 tokens).

# %%
BIG = dict(pp=16, dp=8, ep=1, tp=8)
dims = ParallelDims(**BIG, microbatches=16)
traffic = {d: row["bytes_per_rank"] for d, row in
           topology.traffic_per_step(LLAMA3_405B, dims, 128, seq=8192, dtype_bytes=2).items()}
for order in (topology.TOPOLOGY_AWARE, NAIVE):
    check_equal(f"links, order {order}", {d: student.link_of(d, BIG, 8, order) for d in BIG},
                {d: topology.link_of(d, BIG, 8, order) for d in BIG})
    expected = sum(r["bytes_per_rank"] for r in topology.placement(LLAMA3_405B, dims, 128, seq=8192, order=order)
                   if r["link"] == "inter")
    check_close(f"bytes per rank crossing the network, order {order}",
                student.inter_node_bytes(traffic, BIG, 8, order), expected, rtol=1e-9, atol=0)  # float64 sums

# %% [markdown]
# All checks passed? Compare your two network totals: the naive order sends about 10 times
# more bytes per rank over InfiniBand. Back in notebook 09 (§7), how many seconds per step is
# that for Llama 3 405B, and which dimension would you move off the network first?
