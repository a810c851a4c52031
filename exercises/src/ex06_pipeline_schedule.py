# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex06_pipeline_schedule.ipynb)

# %% [markdown]
# # Exercise 06: pipeline schedules as data
#
# **Goal.** In `exercises/ex06_pipeline_schedule/student.py`, write two pipeline schedules as
# data, one ordered list of `Action("F", j)` / `Action("B", j)` per rank, then watch your lists
# train a GPT on 4 real ranks:
#
# 1. `one_f_one_b(p, m)`: the 1F1B schedule. Rank r may hold at most p - r micro-batches in
#    flight (forward done, backward not yet), whatever m is, and the step may be no longer
#    than GPipe's.
# 2. `capped_1f1b(p, m, caps)`: the same pattern on a machine whose memory is tighter on some
#    ranks: rank r may hold at most `caps[r]` micro-batches in flight. The caps need not fall
#    with r, and some are tighter than 1F1B's own counts; the step must still be as short as
#    the pattern allows under them.
# 3. Follow-up, `snake_placement(p, v)`: place vp stages on p ranks, v per rank, so that every
#    pass of the forward runs over all the ranks and no activation travels more than one rank.
#
# **The rules** (notebook 06, sections 2, 5 and 12). Rank r holds stage r. It can run F(j)
# only after rank r-1 ran F(j), and B(j) only after its own F(j) and rank r+1's B(j); every
# rank runs its list strictly in order and waits in each receive, so lists that ask for
# something nobody will send deadlock.
#
# Work on paper first: draw 4 ranks and 8 micro-batches on a time grid (a forward takes one
# square, a backward two). When does rank 0 receive the gradient of micro-batch 0, and how
# many forwards can it run before then? Then give rank 1 a cap of 1 and rank 2 a cap of 3:
# what can rank 2 actually hold, and what happens if it tries to warm up with more forwards
# than rank 1 sends before rank 1 waits for a gradient?
#
# **How grading works.** Your lists are graded as data: every action present exactly once, no
# deadlock when every rank runs its list in order (the course's simulator), the in-flight
# bound on every rank, and the step time on an idealised machine (a forward 1 unit, a
# backward 2). Then on real ranks: your schedules run the pipelined training of a GPT, whose
# gradients and parameters must equal the single-process training. A check prints `PASS  ...`
# or raises `CheckFailed` with what it expected. The stored outputs are what correct code
# prints. The library's own schedule generators are off limits: a `student.py` that imports
# them is refused before it runs. Edit `student.py`, then *Kernel → Restart and run all*.

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
from course_lib.grading import load_student
from course_lib.grading.ex06_pipeline_schedule import (REFUSE, check_capped, check_one_f_one_b,
                                                      check_snake_placement, check_training)

# REFUSE: the library's schedule generators and every module that builds a schedule from a name
student = load_student("ex06_pipeline_schedule", refuse=REFUSE)

# %% [markdown]
# ## Check 1: 1F1B as data
# For p = 2, 3, 4 ranks and m = 1 to 9 micro-batches (fewer micro-batches than ranks included):
# every F and B of every micro-batch exactly once per rank, no deadlock, at most p - r in
# flight on rank r, and a step no longer than (m + p - 1)(t_F + t_B), so the bubble is
# GPipe's (p-1)/(m+p-1).

# %%
check_one_f_one_b(student.one_f_one_b)

# %% [markdown]
# ## Check 2: 1F1B under a memory cap per rank
# First, caps that cannot be caps must be refused with a `ValueError`. Then, for ten settings
# of p, m and caps (some caps rising with r, some above 1F1B's own counts, one of 1 on every
# rank): valid lists, at most `caps[r]` in flight on rank r, and a step exactly as short as
# the 1F1B pattern can be under the same caps (its best warm-ups).

# %%
check_capped(student.capped_1f1b)

# %% [markdown]
# ## Check 3: your schedules train a GPT on 4 real ranks
# The same 5-block GPT (blocks split 2-1-1-1, tied embeddings) trained for 3 AdamW steps with
# your lists: 1F1B with 8 micro-batches and with 2 (fewer than the ranks), and the capped
# schedule with caps [2, 3, 1, 2]. Losses, gradients and parameters must equal the
# single-process training.

# %%
check_training(student.one_f_one_b(4, 8), 8, "1F1B, m=8")
check_training(student.one_f_one_b(4, 2), 2, "1F1B, m=2")
check_training(student.capped_1f1b(4, 8, [2, 3, 1, 2]), 8, "capped, m=8")

# %% [markdown]
# ## Check 4 (follow-up): v chunks per rank
# Notebook 06 section 9 ran schedules with two chunks per rank. Now take v chunks per rank, any
# v >= 1. For p = 1 to 6 ranks and v = 1 to 4, place the vp stages: each rank holds v, stage 0
# is on rank 0, pass k of the forward (stages kp ... kp + p - 1) visits every rank once, and
# stages s and s + 1 are on the same rank or on neighbouring ranks. On paper first: for p = 3
# and v = 3, where does stage 3 go, where does the loss (stage 8) end up, and how many of the
# 8 stage boundaries need no message?

# %%
check_snake_placement(student.snake_placement)

# %% [markdown]
# ## Going further
#
# * Give your 1F1B one warm-up forward more than it needs on every rank. Which check fails,
#   and why does the real run still give the right gradients?
# * With caps [2, 2, 2, 2] and m = 8, how much longer is the step than 1F1B's, and which rank
#   sets the pace? Work it out on the time grid, then compare with `step_time` from
#   `course_lib.grading.ex06_pipeline_schedule`.
# * Megatron's interleaving puts stage s on rank s mod p. For v = 2, how many of the 2p - 1
#   stage boundaries cross a rank there, and how many in your placement with v = 2? Where does
#   the loss sit for odd v, and what does that cost a model with tied embeddings?
# * Notebook 06's ZB-H1 splits each B into B and W. Where would you put the W's in your 1F1B
#   lists to fill the drain without holding more than p micro-batches on any rank?
#
# Having written them, compare with the library's `course_lib/parallel/pp/schedules.py`
# (1F1B; there is no capped variant there) and `course_lib/parallel/pp/actions.py` (the V).
