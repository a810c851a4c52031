# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex15_capstone.ipynb)

# %% [markdown]
# # Exercise 15: choose the capstone's layout, and say why
#
# **Goal.** A layout is a decision, and a decision comes with reasons. For the problem printed
# below (a model, 8 devices and their memory, a global batch, a throughput budget), write three
# functions in `exercises/ex15_capstone/student.py`:
#
# 1. `choose_layout(...)`: the layout you would run, one the course's 3D trainer composes,
#    within this problem's limits (dp x tp x pp, 1F1B, ZeRO 0 or 1, whole-block recomputation
#    or none). It must fit each
#    device's memory and reach at least `FRACTION` of the predicted throughput of the best
#    layout that fits.
# 2. `binding_constraint(...)`: what stops *any* layout from being faster than the best one
#    that fits, with the number that binds (memory: the bytes per device at which it would stop
#    binding; otherwise the largest group of step-time terms and its seconds).
# 3. `rejected_layout(...)`: one layout you considered and rejected, the reason ("memory" or
#    "throughput") and by how much it fails.
#
# Your functions take the problem as arguments, and the checks ask them more than the stated
# problem: the same model with twice the batch on 160 KiB devices, and on devices of 1 GiB,
# where memory no longer decides. So reason from the arguments: what binds when memory does
# not, and which layout do you reject when every faster one fits? Work with the estimator's
# formulas, `memory_per_rank` and `step_time`, in a loop of your own; the stub's docstrings
# give the exact definitions. The planner is not allowed:
# it answers the first question by itself, and the checks refuse a module that uses it.
#
# **Re-read:** notebook 11, section 2 (the step-time model, term by term) and section 5 (what a
# search must cover); notebook 10, sections 1 and 9 (what dp, tp and pp split, and the layouts
# that cannot work); notebook 04 (what recomputation saves and costs); notebook 08 (what ZeRO-1
# shards).
#
# **How grading works.** Every check prices layouts with the same estimator, over every layout
# the 3D trainer can run for this problem; the last one trains your layout for real.
#
# 1. *Runnable:* your layout is one the 3D trainer runs on all devices with the global batch.
# 2. *Fits:* the estimator's bytes per rank are within the device's memory.
# 3. *Fast enough:* its predicted throughput is at least `FRACTION` of the best fitting layout's.
# 4. *The other problems:* checks 1 to 3 for the layouts you choose there.
# 5. *Binding constraint:* the name and the number match the estimator's, on every problem.
# 6. *Rejected layout:* on every problem, a layout of it, other than the one you choose, that
#    fails for the reason you give, by the amount you give.
# 7. *Trains:* your layout trains 2 steps on 8 real ranks, and its losses equal the single
#    process's on the same batches (to float rounding).
#
# A check prints `PASS  ...` or stops with a short message saying what is wrong (never the
# answer). Edit `student.py`, then *Kernel → Restart and run all*.

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
from course_lib.grading import ex15_capstone as grade
from course_lib.grading import load_student

student = load_student("ex15_capstone", refuse=grade.REFUSE)
problem = grade.stated_problem()
FRACTION = problem.fraction
print(problem.describe())

# %% [markdown]
# ## Check 1: the 3D trainer runs your layout

# %%
layout = grade.ask(student.choose_layout, problem)
grade.check_runnable(layout, problem)

# %% [markdown]
# ## Check 2: it fits, by the estimator

# %%
grade.check_fits(layout, problem)

# %% [markdown]
# ## Check 3: it is fast enough

# %%
grade.check_fast(layout, problem)

# %% [markdown]
# ## Check 4: your choice on the other problems

# %%
grade.check_choices(student.choose_layout, problem)

# %% [markdown]
# ## Check 5: what binds, and at which number

# %%
grade.check_bindings(student.binding_constraint, problem)

# %% [markdown]
# ## Check 6: a layout you rejected, and why

# %%
grade.check_rejections(student.rejected_layout, student.choose_layout, problem)

# %% [markdown]
# ## Check 7: it trains on 8 real ranks and matches the single process

# %%
grade.check_trains(layout, problem)

# %% [markdown]
# ## Having chosen: compare with the planner
#
# Once every check passes, set your reasoning beside notebook 11's planner, in a new cell:
#
# ```python
# from course_lib.estimate.planner import plan
# p = plan(*problem.args())
# print(p.table(5)); print(p.explain())
# ```
#
# Does it name the same binding constraint? Its best layout may be one you could not choose:
# the planner also searches selective recomputation, ZeRO-2 and 3, interleaved schedules and
# sequence parallelism, which the course's 3D trainer does not compose. How much faster does it
# predict that layout to be, and which of its features buys the difference? Then call your own
# `binding_constraint` on a cluster whose devices hold exactly the number you gave
# (`dataclasses.replace(problem.cluster, memory_bytes=...)`): what binds now, and why?
