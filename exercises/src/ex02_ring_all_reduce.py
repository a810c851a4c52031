# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex02_ring_all_reduce.ipynb)

# %% [markdown]
# # Exercise 02: ring all-reduce from send and receive, both ways round
#
# **Goal.** In `exercises/ex02_ring_all_reduce/student.py`, write the ring all-reduce of
# notebook 02 yourself, with nothing but point-to-point messages, and then the step notebook 02
# does not take: a ring that runs **both ways** at once.
#
# 1. `ring_reduce_scatter(tensor, direction)`: N-1 steps; afterwards rank r holds the full sum
#    of chunk r. `direction=+1` is notebook 02's ring (send right, receive from the left);
#    `direction=-1` is its mirror image (send left, receive from the right), and rank r must
#    still end with chunk r.
# 2. `ring_all_gather(tensor, direction)`: N-1 steps; rank r starts with its piece in chunk r,
#    ends with all, in either direction.
# 3. `ring_all_reduce(tensor)`: a link between two neighbours carries data both ways at once
#    (full duplex), but notebook 02's ring uses only one way of each link. Send half of the
#    elements around the ring to the right and the other half to the left: each rank then
#    sends each neighbour (N-1)/N of the tensor's bytes instead of sending one neighbour
#    2(N-1)/N.
#
# Chunks are `torch.tensor_split(tensor.view(-1), N)`; the stub states the contract. Draw the
# 4-rank ring of notebook 02 on paper, then its mirror image: in the mirrored ring, which chunk
# does rank r send at step k, which chunk arrives, and where must it go? **Re-read in notebook
# 02:** section 3 (the ring, its schedule table and step-by-step picture, and why sizes that N
# does not divide need care).
#
# **How grading works.** Each check runs your functions on real ranks and compares them with
# `torch.distributed`'s built-ins, on several world sizes (including odd ones), tensor sizes
# (including ones N does not divide and ones smaller than N) and both directions; it also counts
# your bytes, neighbour by neighbour, with `CommTracer`. A check prints `PASS  ...` or raises
# `CheckFailed` (or your own error, with the failing rank's traceback). Edit `student.py`, then
# *Kernel → Restart and run all*.

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
from course_lib.grading import ex02_ring_all_reduce as grade

student = load_student("ex02_ring_all_reduce", refuse=grade.REFUSE)

# %% [markdown]
# ## Check 1: `ring_reduce_scatter`, both directions
# On 3 ranks with 10 elements (3 does not divide 10), 4 ranks with 3 elements (fewer than
# ranks) and 5 ranks with 12: rank r's returned chunk must equal chunk r of the built-in
# all-reduce and be a view into the tensor, and only point-to-point calls to and from the
# neighbours of the direction may be used.

# %%
grade.check_reduce_scatter(student)

# %% [markdown]
# ## Check 2: `ring_all_gather`, both directions
# Rank r puts its piece (the value r + 1, in chunk r) into a tensor of zeros; afterwards every
# rank must hold what the built-in all-gather gives.

# %%
grade.check_all_gather(student)

# %% [markdown]
# ## Check 3: `ring_all_reduce` against `dist.all_reduce`
# World sizes 2, 3 (odd) and 4; sizes 1 (smaller than N), 10 (not divisible), 64 (divisible);
# float64 and int64. Every rank must also end with bit-identical values.

# %%
grade.check_all_reduce(student)

# %% [markdown]
# ## Check 4: the bytes, neighbour by neighbour
# With 4 ranks and 1,024 float32 values (4,096 bytes): each phase of a one-way ring sends
# (N-1)/N of the bytes, all to the neighbour in its direction; the two-way all-reduce sends
# (N-1)/N of them to each neighbour.

# %%
grade.check_bytes(student)

# %% [markdown]
# All checks pass? Questions to take back to notebook 02:
#
# 1. Write the chunk rank r sends at step k of the mirrored ring as one formula, and compare it
#    with notebook 02's. What single change turns one into the other?
# 2. With the α-β model of notebook 02, what does the two-way all-reduce save on a full-duplex
#    link, in the bandwidth term and in the latency term? (Count the sequential steps if your
#    two halves take turns, and if they travel at the same time.)
# 3. What would happen if every rank did a blocking `dist.send` before its `dist.recv`?
#
# Having written it, compare with `course_lib/comm/collectives.py` (one direction only).
