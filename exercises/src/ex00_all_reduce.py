# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex00_all_reduce.ipynb)

# %% [markdown]
# # Exercise 00: your first all-reduce
#
# **Goal.** Write three small functions in `exercises/ex00_all_reduce/student.py`:
#
# 1. `all_reduce_sum(value)` runs *inside a rank*: it returns the sum of `value` over all ranks,
#    using one `torch.distributed` collective.
# 2. `rank_ordered_sums(values)` runs *in the parent* (here): it starts `len(values)` ranks with
#    `course_lib.run_on_ranks`, rank `r` contributes `values[r]`, and it returns every rank's result
#    in rank order.
# 3. `global_mean(values)` runs inside a rank, and is the step notebook 00 does not take: each
#    rank holds a list of numbers, of different lengths on different ranks (some may be empty),
#    and every rank must return the mean of *all* the numbers together, with exactly one
#    collective call. (A data-parallel run whose ranks hold batches of different sizes must
#    average its loss the same way.)
#
# **Re-read in notebook 00:** section 1 (ranks, `run_on_ranks`, results in rank order) and
# section 2 (all-reduce and what `CommTracer` counts).
#
# **Before you write code,** answer on paper: with 3 ranks contributing 1.0, -2.0 and 0.25,
# what does each rank return, and how many collective calls does each rank make? And for
# `global_mean`: if rank 0 holds `[1, 2, 3]` and rank 1 holds `[5]`, what must both return? What
# would averaging the two ranks' own means give, and what does one all-reduce need to carry to
# get it right?
#
# **How grading works.** Each check cell below prints `PASS  ...` when your code is right and
# raises `CheckFailed` (or your own error) when it is not. Edit `student.py`, then *Kernel →
# Restart and run all*.

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
from course_lib.grading import ex00_all_reduce as grade

student = load_student("ex00_all_reduce", refuse=grade.REFUSE)

# %% [markdown]
# ## Check 1: `all_reduce_sum` on 2 ranks
# Rank 0 contributes 1.5 and rank 1 contributes 2.5: both must get their sum, using exactly one
# collective call.

# %%
grade.check_all_reduce_sum(student)

# %% [markdown]
# ## Check 2: `rank_ordered_sums` for 1, 3 and 4 ranks

# %%
grade.check_rank_ordered_sums(student)

# %% [markdown]
# ## Check 3: `global_mean` on ranks holding different numbers of values
# On 2, 3 and 4 ranks; one of the 3 ranks holds no number at all.

# %%
grade.check_global_mean(student)
