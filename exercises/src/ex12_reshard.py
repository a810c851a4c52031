# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex12_reshard.ipynb)

# %% [markdown]
# # Exercise 12: reshard ZeRO shards from N ranks to M ranks
#
# **Goal.** A ZeRO-3 run saved its flat shards on 4 ranks; the job must continue on 2. In
# `exercises/ex12_reshard/student.py`, write the resharding by global offsets:
#
# 1. `shard_range(numel, world_size, rank)`: the global range a rank owns in a padded flat unit.
# 2. `read_plan(numel, old_world, new_world, new_rank)`: which slice of which old shard lands
#    where in a new rank's shard. Only the overlapping old shards; never the padding.
# 3. `reshard_flat(old_shards, numel, new_world)`: all new shards, built from the plan.
#
# Draw it first: a unit of 10 elements on 4 ranks, then on 3; mark each rank's range and the
# padding; for each new rank, list the overlaps. Then a unit of 3 elements on 4 ranks: what
# does the last rank hold? **Re-read in notebook 12:** section 3 (what a sharded checkpoint
# holds), section 4 (resharding by global offsets, and its picture); in notebook 08, the flat
# padded buffer of ZeRO.
#
# **How grading works.** The checks never compare with a ready-made plan. They hold your
# functions to the rules a resharding must obey, on many sizes (including units smaller than
# the number of ranks, where whole shards are padding): the shards are equal, back to back, and
# the fewest that hold the unit; across the new ranks every real element is read exactly once,
# from the old shard where it lives, into its new rank's slot, and no padding is read. A few
# small layouts are also compared with plans worked out by hand.
# `reshard_flat` is watched as it reads: it may take from each old shard only the slices your
# plans name, each once (no whole shard, no joining them). Then real runs: made-up shards
# whose values are their global offsets, read by 3 ranks that each plan their own reads; and
# real ZeRO-3 shards (parameters and Adam's two moments) saved by 4 ranks after 3 steps,
# resharded by your `reshard_flat` for 2 ranks that train 3 more steps: their losses and
# parameters must match a run that trained all 6 steps on 4 ranks without stopping (to float
# rounding: the gradient average is summed in another order on 2 ranks). A check prints
# `PASS  ...` or raises `CheckFailed` with what broke which rule. Edit `student.py`, then
# *Kernel → Restart and run all*.
#
# Write it yourself: a `student.py` that imports the course library's own shard rule or
# resharding code is refused before any check runs.

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
from course_lib.grading import ex12_reshard as grade
from course_lib.grading import load_student

student = load_student("ex12_reshard", refuse=grade.REFUSE)

# %% [markdown]
# ## Check 1: `shard_range`

# %%
grade.check_shard_range(student)

# %% [markdown]
# ## Check 2: `read_plan`

# %%
grade.check_read_plan(student)

# %% [markdown]
# ## Check 3: `reshard_flat` on made-up shards
# Element $i$ of the unit holds $i + 1$, and the old padding holds a marker no real element has:
# a misplaced element or a read from the padding shows in the new shards' values. Each old shard
# also records what is read from it: only the slices of your read plans, once each.

# %%
grade.check_reshard_flat(student)

# %% [markdown]
# ## Check 4: each new rank reads its own shard
# At scale no process holds the whole unit: each new rank calls your `read_plan` for itself and
# opens only the old shard files it needs (4 old files of a 37-element unit, 3 new ranks).

# %%
grade.check_reads_on_ranks(student)

# %% [markdown]
# ## Check 5: real ZeRO-3 shards, 4 ranks -> 2 ranks, training continues
# Three runs of the same model and data: 6 steps on 4 ranks without stopping; 3 steps on 4
# ranks that save their flat shards; then your resharding and 3 more steps on 2 ranks.

# %%
grade.check_resume_on_fewer_ranks(student)

# %% [markdown]
# ## Having written it, compare with the library
#
# All checks passed? Then you have written the core of every resharding loader. Compare with
# the course's own code:
#
# * `course_lib/parallel/zero/flat.py`: `shard_bounds` is the course's `shard_range`, and
#   `FlatUnit` lays a unit's parameters end to end in the padded buffer.
# * `course_lib/checkpoint/reshard.py`: the same overlap in any number of dimensions
#   (`Box.intersect`), a flat range of a matrix cut into boxes (`flat_range_boxes`), and
#   `copy_overlaps`, which plays the part of your `reshard_flat` for one wanted box.
# * `course_lib/checkpoint/reader.py`: the loader that reads only the saved pieces that overlap
#   what a rank needs, at any layout and world size.
#
# Notice what none of them needs: the old world size appears only through the saved offsets.
# PyTorch's `torch.distributed.checkpoint` (notebook 12, section 7) plans its reads the same way.
