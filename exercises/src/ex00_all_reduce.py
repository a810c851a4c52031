# %% [markdown]
# # Exercise 00: your first all-reduce
#
# **Goal.** Write two small functions in `exercises/ex00_all_reduce/student.py`:
#
# 1. `all_reduce_sum(value)` runs *inside a rank*: it returns the sum of `value` over all ranks,
#    using one `torch.distributed` collective.
# 2. `rank_ordered_sums(values)` runs *in the parent* (here): it starts `len(values)` ranks with
#    `course_lib.run_on_ranks`, rank `r` contributes `values[r]`, and it returns every rank's result
#    in rank order.
#
# **Re-read in notebook 00:** section 1 (ranks, `run_on_ranks`, results in rank order) and
# section 2 (all-reduce and what `CommTracer` counts).
#
# **Before you write code,** answer on paper: with 3 ranks contributing 1.0, -2.0 and 0.25,
# what does each rank return, and how many collective calls does each rank make?
#
# **How grading works.** Each check cell below prints `PASS  ...` when your code is right and
# raises `CheckFailed` (or your own error) when it is not. The outputs stored in this notebook
# are what correct code prints. Edit `student.py`, then *Kernel → Restart and run all*.

# %%
import torch
import torch.distributed as dist

from course_lib import CommTracer, run_on_ranks
from course_lib.grading import check_close, check_equal, load_student

student = load_student("ex00_all_reduce")

# %% [markdown]
# ## Check 1: `all_reduce_sum` on 2 ranks
# Rank 0 contributes 1.5 and rank 1 contributes 2.5: both must get 4.0, using exactly one collective call.

# %%
def traced_sum(values):
    with CommTracer() as tracer:
        total = student.all_reduce_sum(values[dist.get_rank()])
    calls = sum(op["calls"] for op in tracer.summary().values())
    return total, calls

results = run_on_ranks(traced_sum, [1.5, 2.5], world_size=2, timeout_s=30)
# exact: sums of these few binary fractions need no rounding, in any float format and any order
check_close("2 ranks: every rank gets 1.5 + 2.5", [r[0] for r in results], [4.0, 4.0], rtol=0, atol=0)
check_equal("2 ranks: one collective call per rank", [r[1] for r in results], [1, 1])

# %% [markdown]
# ## Check 2: `rank_ordered_sums` for 1, 3 and 4 ranks

# %%
# exact, as above: no rounding in these sums
check_close("1 rank", student.rank_ordered_sums([7.0]), [7.0], rtol=0, atol=0)
check_close("3 ranks", student.rank_ordered_sums([1.0, -2.0, 0.25]), [-0.75] * 3, rtol=0, atol=0)
check_close("4 ranks", student.rank_ordered_sums([1.0, 2.0, 3.0, 4.0]), [10.0] * 4, rtol=0, atol=0)
