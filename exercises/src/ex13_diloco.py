# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex13_diloco.ipynb)

# %% [markdown]
# # Exercise 13: DiLoCo's outer step, with a replica missing from the round
#
# **Goal.** In `exercises/ex13_diloco/student.py`, write `outer_step`: what each of R
# replicas does when they meet after H inner AdamW steps, in DiLoCo (Douillard et al. 2023,
# Algorithm 1). Each replica is one rank; they meet on a process group. Two things your step
# must handle:
#
# 1. **It runs on the ranks.** Each replica holds only its own parameters theta_r, its copy of
#    the outer state (theta_0, the parameters every replica started the round from, and the
#    outer momentum b), and a process group. Nothing else is shared: the average over the
#    replicas is yours to compute with collectives.
# 2. **A round may have a quorum.** With fault-tolerant replica groups, a replica can miss a
#    round (it was restarted, or its steps came too late): its H steps do not count. It still
#    calls `outer_step`, with `present=False`, and it must leave the round exactly like the
#    others, at the new theta_0. Each replica knows only whether *it* is present.
#
# The stub's docstring states the contract (arguments, what must hold on return). Keep it
# small: one collective per round is enough.
#
# **Re-read in notebook 13:** "LocalSGD and DiLoCo" (the pseudo-gradient, and the outer
# Nesterov step that uses it), "Fault-tolerant replica groups" (the quorum, and the mean over
# the quorum only) and, in "Stragglers", the quorum that drops a late replica's work. In
# notebook 02, the all-reduce.
#
# **Think first.** Take the paper's outer optimizer, lr_out = 0.7 and mu = 0.9, and a first
# round (b = 0). Replicas that all moved the same way, by a delta D (theta_r = theta_0 - D):
# where do LocalSGD and DiLoCo put the new theta_0? Then a round of 3 replicas where only 2
# count: which number divides the sum of their deltas, and how does the replica outside the
# quorum learn it?
#
# <details><summary>Answer to the first question</summary>
#
# LocalSGD averages the parameters: theta_0 - D, exactly where the replicas are. DiLoCo's first
# Nesterov step with b = 0 first sets b = D, then steps by lr_out (D + mu b) = 0.7 × 1.9 D =
# 1.33 D: it goes a third *past* the replicas, and further still in later rounds as b builds up
# (the momentum is what lets the outer step take big strides). With lr_out = 1 and mu = 0 the
# two coincide, which is why the checks use the paper's values. The second question is yours.
#
# </details>
#
# **How grading works.** First, made-up rounds on 2 and 3 ranks: each replica's parameters
# are set to theta_0 minus a random delta of its own, in float64, for 4 rounds, some of them with
# a replica outside the quorum. After every round each replica must hold the new theta_0 in its
# parameters, and every replica the same theta_0 and b; the sequence of theta_0 must be DiLoCo's,
# computed while the check runs by `torch.optim.SGD(momentum=mu, nesterov=True)` given the
# quorum's mean delta as its gradient. When your sequence matches a known mistake, the message
# names it. Then real training: a tiny GPT trained by 2 and 3 replicas on separate ranks (2
# AdamW steps per round, 3 rounds) with your step between the rounds, against the same
# algorithm computed in one process, the replicas in turn (also with replica 1 outside the
# second round's quorum). A check prints `PASS  ...` or raises `CheckFailed` with what broke.
# Edit `student.py`, then *Kernel → Restart and run all*.
#
# Write it yourself: a `student.py` that imports the course library's own outer step (or the
# code built on it) is refused before any check runs.

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
from course_lib.grading import ex13_diloco as grade
from course_lib.grading import load_student

student = load_student("ex13_diloco", refuse=grade.REFUSE)

# %% [markdown]
# ## Check 1: made-up rounds, some with a replica outside the quorum
# Every replica, present or not, calls your `outer_step` in every round. What each rank holds
# after each round is compared across the ranks (it must be identical) and with DiLoCo's
# outer step evaluated in one process.

# %%
grade.check_made_up_rounds(student)

# %% [markdown]
# ## Check 2: real training between the rounds
# Each replica trains its own copy of a tiny GPT on its share of every batch, with AdamW (its
# state kept by the replica across rounds), and calls your step every 2 steps. The replicas'
# parameters after 3 rounds must be identical, and equal to the one-process computation up to
# float rounding: the all-reduce adds the deltas in another order, and AdamW and the outer
# momentum magnify such differences a little.

# %%
grade.check_training(student)

# %% [markdown]
# ## Having written it, compare
#
# All checks passed? Compare with the course's own code, which notebook 13 ran:
#
# * `course_lib/parallel/diloco/outer.py`: `NesterovOuter`, the outer copy and its momentum for
#   one fragment of the model; Streaming DiLoCo (Douillard et al. 2025) syncs the fragments at
#   staggered steps, each with its own theta_0 and b.
# * `course_lib/parallel/diloco/training.py`: `average`, the mean across replicas in one
#   collective on a flat buffer, also with the deltas sent in bfloat16 and summed in fp32.
# * `course_lib/parallel/diloco/simulate.py`: the one-process reference, with torch's own
#   Nesterov SGD as the outer optimizer.
#
# Two questions to take back. Your step handles a quorum with the same collective on every
# replica: what does a replica outside the quorum still send each round, and could it send
# less? And when a replica misses many rounds in a row, what should its AdamW state (the inner
# optimizer's) be when it comes back?
