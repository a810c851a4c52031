# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex10_mesh_coordinates.ipynb)

# %% [markdown]
# # Exercise 10: mesh coordinates, groups and the links they cross
#
# **Goal.** Write the bookkeeping of a 4-D device mesh in
# `exercises/ex10_mesh_coordinates/student.py` (notebook `10_3d_parallelism` explains every
# idea used here; re-read §1 for the numbering, §2 for the groups, §6 for nodes and links):
#
# 1. `coordinates(rank, sizes, order)`: a rank's index along pp, dp, ep and tp;
# 2. `groups(sizes, order)`: the process groups of every dimension;
# 3. `link_of(dim, sizes, gpus_per_node, order)`: does that dimension stay inside a node?
# 4. `inter_node_bytes(bytes_per_rank, sizes, gpus_per_node, order)`: how much of a step's
#    traffic crosses the network;
# 5. `best_order(sizes, gpus_per_node, bytes_per_rank)`: the order of the dimensions that sends
#    the fewest bytes over the network. make_mesh's order is not always it: the checks use
#    layouts whose heaviest traffic is not tensor parallelism's.
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
# `CheckFailed` (or your own error) when it is not. Your first four functions are compared with
# three things, never with a reference answer shown here: values worked out by hand (like the
# answer above); a real device mesh on 8 ranks (make_mesh's, and torch's `init_device_mesh`
# with the dimensions listed in another order); and properties every right answer has (the
# groups of a dimension hold every rank exactly once, `sizes[dim]` ranks each, differing only
# along that dimension; a link is `"intra"` exactly when every group of the dimension sits in one
# node). Your `best_order` must send no more bytes over the network than any of the 24 orders.
# Write it yourself: a `student.py` that imports the course's own mesh bookkeeping is
# refused before any check runs. Edit `student.py`, then *Kernel → Restart and run all*.

# %%
# Google Colab only (elsewhere this cell does nothing): fetch the course at its pinned revision, set it up
import os, subprocess, sys
if "google.colab" in sys.modules:
    home = os.environ.get("COURSE_COLAB_HOME", "/content/course")
    if not os.path.isdir(home):
        subprocess.run(["git", "clone", "-q", os.environ.get("COURSE_COLAB_REPO", "https://github.com/OWNER/distributed-training-from-first-principles"), home], check=True)
        subprocess.run(["git", "-C", home, "checkout", "-q", "v0.1.0"], check=True)
    sys.path.insert(0, home); from course_lib.colab import arrive; arrive(home, "exercises")

# %%
from course_lib.grading import ex10_mesh_coordinates as grade
from course_lib.grading import load_student

student = load_student("ex10_mesh_coordinates", refuse=grade.REFUSE)

# %% [markdown]
# ## Check 1: coordinates
#
# By hand, then on layouts of 24 ranks (a size of 3 catches a modulo by the wrong size), then
# every rank against a real mesh on 8 ranks (the first check that starts processes).

# %%
grade.check_coordinates(student)

# %% [markdown]
# ## Check 2: the groups of every dimension

# %%
grade.check_groups(student)

# %% [markdown]
# ## Check 3: which link each dimension crosses
#
# The Megatron-style layout tp 8 × pp 16 × dp 8 on nodes of 8 GPUs (1024 ranks) in both
# orders, a small one on nodes of 4, and layouts whose groups fit a node in size but can
# straddle two (tp 3 on nodes of 4).

# %%
grade.check_links(student)

# %% [markdown]
# ## Check 4: the bytes that leave the node
#
# First with made-up bytes per dimension, then with the course's traffic model for Llama 3
# 405B on the 1024-GPU layout (bf16, 128 sequences of 8192 tokens, 16 micro-batches; notebook
# 09, §7 prints these bytes per dimension).

# %%
grade.check_network_bytes(student)

# %% [markdown]
# ## Check 5: the best order
#
# Three layouts on nodes of 4 with made-up bytes, the heaviest of which belong to dp, ep and pp
# in turn, then Llama 3 405B's own traffic on the 1024-GPU layout.

# %%
grade.check_best_order(student)

# %% [markdown]
# ## After the checks
#
# Put your two network totals side by side:
#
# ```python
# traffic = grade.llama3_traffic()
# student.inter_node_bytes(traffic, grade.BIG, 8, grade.NAIVE) / student.inter_node_bytes(traffic, grade.BIG, 8)
# ```
#
# How many times more bytes per rank does the naive order send over the network between nodes
# (RoCE, for Llama 3 405B: Dubey et al. 2024 §3.3.1), and which
# dimension accounts for the difference? Back in notebook 10 (§7), how many seconds per step
# is that for Llama 3 405B, and which dimension would you move off the network first?
#
# <details><summary>Answer</summary>
#
# In make_mesh's order only pp and dp leave the node; the naive order also sends tp's
# activation all-reduces over the network, so the factor is `(tp + pp + dp) / (pp + dp)` of
# the bytes above. tp's traffic is the largest of the step (notebook 10, §7, prints all
# three), so tp is the one to bring back inside the node: that is why it goes innermost.
# </details>
#
# **Having written it, compare with the library.** `course_lib.parallel.mesh.make_mesh` builds
# the same numbering with torch's `init_device_mesh` (and `mesh_groups` lists its groups
# without processes); `course_lib.parallel.topology` has `coordinates`, `groups` and
# `link_of`. Its `link_of` looks at no group: a group of a dimension is `{base + k·stride}`, so
# on a mesh that fills whole nodes every group stays in one node exactly when the span
# `stride · size` divides the GPUs per node. Where does your version look at more than it needs
# to?
