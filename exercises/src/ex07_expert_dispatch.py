# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex07_expert_dispatch.ipynb)

# %% [markdown]
# # Exercise 07: expert parallelism's dispatch and combine
#
# **Goal.** Write the communication of an expert-parallel MoE layer in
# `exercises/ex07_expert_dispatch/student.py` (notebook `07_mixture_of_experts` explains every
# idea used here: §2 for the router's output, §5 for the two all-to-alls). One thing differs
# from the notebook: the experts are dealt round-robin, expert e on rank e mod ep (rank 0 of 2
# holds experts 0, 2, 4, ...), so the notebook's layout of the rows no longer fits as it is.
#
# 1. `sort_for_dispatch(expert, n_experts, ep)`: the stable permutation that lays the
#    assignments out for the dispatch, and the count per expert;
# 2. `rows_per_rank(counts, ep)`: how many rows go to each rank;
# 3. `expert_parallel_moe(x, token, expert, gate, local_experts, n_experts, group)`: the whole
#    layer on this rank's tokens, with three all-to-alls.
#
# The routing itself (router, top-k, capacity) is given: each rank passes you its kept
# assignments in a shuffled order.
#
# **Predict.** With 4 experts on 2 ranks, a rank routes to experts [2, 0, 3, 1, 2, 1]. In
# notebook 07 the rows sorted by expert are already grouped by destination rank. Are they
# still, with the round-robin placement? In which order must the six rows leave?
#
# **Think first.** In the dispatch, rank 0 sends 5 rows to rank 1 and rank 1 sends 3 rows to
# rank 0. In the combine, how many rows does rank 0 send to rank 1? And in the backward of the
# dispatch?
#
# <details><summary>Answer</summary>
#
# 3 both times. In the combine rank 0 returns the expert outputs of the 3 rows it received
# from rank 1; in the backward of the dispatch it returns the gradients of those same 3 rows.
# A transpose swaps the input and output splits: what a rank sends in it is what it received
# in the original.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your sort is checked property by property,
# your layer on 2 and 4 real ranks, each with a different number of tokens: its outputs and
# gradients against the single-process MoE layer on the same tokens, and the bytes its
# all-to-alls carry. Edit `student.py`, then *Kernel → Restart and run all*.

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
from course_lib.grading import ex07_expert_dispatch as checks
from course_lib.grading import load_student

# Your module may not import the library's expert parallelism (checks.REFUSE names it).
student = load_student("ex07_expert_dispatch", refuse=checks.REFUSE)

# %% [markdown]
# ## Check 1: `sort_for_dispatch` and `rows_per_rank`
# The six assignments of the prediction above on 2 ranks, then 50 random assignments to 8
# experts on 2 and on 4 ranks: a permutation, grouped by destination rank, then by local
# expert, ties in their input order, and the counts per expert.

# %%
checks.check_sort(student)
checks.check_rows_per_rank(student)

# %% [markdown]
# ## Check 2: outputs and gradients equal the single-process layer
#
# Every rank builds the same layer (same seed), keeps its experts `r, r + ep, ...` and runs your
# `expert_parallel_moe` on its own tokens; the test loss is `Σ_r Σ (y_r · w_r)`. The
# single-process layer computes the same loss from every rank's tokens. Compared: each rank's
# `y`, the gradient of its tokens `x`, of the router (through the gates, on every rank: it
# is a replicated weight, so each rank's gradient is that of its own tokens) and of each
# expert (on its owner, where the backward all-to-alls bring every rank's rows). Three
# settings: ep = 2 with top-1 and no capacity, ep = 2 with top-2 and drops, ep = 4.

# %%
checks.check_layer(student)

# %% [markdown]
# ## Check 3: only the routed rows travel, in three all-to-alls
#
# One forward on 2 ranks, traced: the count exchange (`E` int64 per rank), the dispatch (the
# rank's `M` kept assignments, `M · d · 4` bytes) and the combine (the rows it received back).
# A layer that sends every token to every rank, or pads to the capacity, fails here.

# %%
checks.check_traffic(student)

# %% [markdown]
# All checks passed? Then you have written the communication of GShard and Switch's expert
# layer (Lepikhin et al. 2021; Fedus et al. 2022), for a placement the library does not use.
# Compare with `course_lib/parallel/ep/dispatch.py`: what changes there for the round-robin
# placement, and what stays? Two questions to take back to notebook 07: why can the gates stay
# on the sending rank instead of travelling with the rows (§5), and what must
# `reduce_gradients` still do with the expert gradients you just computed when each rank's loss
# is a *mean* (§5, the proof)?
