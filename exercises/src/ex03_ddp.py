# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex03_ddp.ipynb)

# %% [markdown]
# # Exercise 03: bucketed, overlapped data parallelism whose buckets learn the backward order
#
# **Goal.** Write a reduced `DistributedDataParallel` in `exercises/ex03_ddp/student.py`
# (notebook `03_data_parallel` explains the ideas: re-read §1 for why the average of the
# shards' gradients is the right one, and §5 for buckets, hooks, in-order launches and
# `finish`). Its contract is at the top of `student.py`:
#
# 1. `build_buckets(order, sizes_bytes, bucket_cap_bytes)`: group parameter indices into
#    buckets, walking them in a given `order` (PyTorch's rule for closing a bucket).
# 2. `SimpleDDP(module, bucket_cap_mb, group)`: replicas that start equal, one asynchronous
#    all-reduce per bucket launched from gradient hooks while backward runs, and
#    `finish_gradient_synchronization()` after backward, leaving the average in every `p.grad`.
# 3. **The step notebook 03 does not take.** Its DDP buckets the parameters in the reverse of
#    their registration order, a guess at the order backward produces their gradients. The
#    guess can be wrong: a module registered first may run last (a shared embedding, layers
#    reordered in `forward`, branches). Then the bucket with the last-registered parameters is
#    complete only at the very end of backward, and since buckets leave in index order, every
#    bucket waits for it: no overlap at all. Your `SimpleDDP` measures instead of guessing:
#    during the first step it notes the order in which the gradients actually arrive, and from
#    the second step on its buckets follow that order.
#
# You may assume every trainable parameter gets a gradient in every step (no unused
# parameters) and no gradient accumulation.
#
# **Think first.** The ranks run the same model, but not necessarily the same graph: a model
# whose control flow depends on the data (or on the rank) produces its gradients in a different
# order on different ranks. What goes wrong if every rank rebuilds its buckets from what *it*
# observed? What must the ranks agree on after the first step, and how can they come to agree?
# And with one agreed layout, what keeps a rank whose gradients arrive in another order from
# launching its buckets in another order?
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your DDP is trained on 2 and 4 ranks and
# compared with `torch.nn.parallel.DistributedDataParallel` on the same data, then run for a
# few steps on a small model whose layers run in a rank-dependent order, with every all-reduce
# watched: when it starts, when it is waited for, what it carries. Edit `student.py`, then
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
import torch

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.grading import check_close, check_equal, load_student
from course_lib.grading import ex03_ddp as grade
from course_lib.model import GPTConfig
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.train import TrainConfig

student = load_student("ex03_ddp", refuse=grade.REFUSE)
CONFIG = GPTConfig.tiny(CharDataset("train").vocab_size)
# No clipping: AdamW and clipping both ignore the gradient's scale, so a DDP that forgets to
# divide by N would still produce the right parameters. Comparing raw gradients catches it.
TRAIN = TrainConfig(steps=4, batch_size=8, grad_clip=0.0, progress=False)
CAP_MB = 0.05  # MiB: small buckets, so the tiny GPT's 0.42 MiB of gradients make several

# %% [markdown]
# ## Check 1: `build_buckets`
# Sizes are in bytes; orders that are not the reverse of the registration order, a bucket
# that meets the cap exactly, a parameter larger than the cap, and an order that is not a
# permutation of the parameters.

# %%
grade.check_build_buckets(student)

# %% [markdown]
# ## Check 2: same training as torch's DDP, on 2 and 4 ranks
# Both runs start from the same model and see the same data; after 4 AdamW steps the
# parameters and the last averaged gradients must agree (up to float rounding), and every rank
# must hold the same replica. (Torch's DDP also rebuilds its buckets after the first step.)

# %%
def wrap_student(model, group):
    return student.SimpleDDP(model, bucket_cap_mb=CAP_MB, group=group)


def both(config, cfg):
    mine = train_data_parallel(config, cfg, wrap_student)
    theirs = train_data_parallel(config, cfg, "torch", bucket_cap_mb=CAP_MB)
    return mine, theirs


for world_size in (2, 4):
    res = run_on_ranks(both, CONFIG, TRAIN, world_size=world_size, backend="gloo", timeout_s=60)
    mine, theirs = res[0]
    # Compared in norm, not element by element: on 4 ranks gloo adds in an order set by the bucket layout, and
    # AdamW magnifies that rounding where a gradient is near zero (notebook 04), up to ~lr for a single
    # parameter. So: the last gradients to 1e-4 of their norm (a DDP that forgets to divide by N is off by
    # N - 1), the parameters in RMS to a hundredth of one AdamW step (a wrong gradient moves most by ~lr).
    check_close(f"{world_size} ranks: last averaged gradients = torch DDP's (|difference| / |gradient|)",
                ((mine.final_grads - theirs.final_grads).norm() / theirs.final_grads.norm()).item(), 0.0,
                rtol=0, atol=1e-4)
    check_close(f"{world_size} ranks: parameters after {TRAIN.steps} steps = torch DDP's (RMS of the difference)",
                (mine.final_params - theirs.final_params).pow(2).mean().sqrt().item(), 0.0, rtol=0, atol=TRAIN.lr / 100)
    check_equal(f"{world_size} ranks: every replica identical",
                all(torch.equal(r[0].final_params, mine.final_params) for r in res), True)

# %% [markdown]
# ## Check 3: every all-reduce watched, on ranks whose gradients arrive in different orders
# A small model of four square layers: on even ranks they run last-registered first, on odd
# ranks in registration order. Its replicas start from different values. For 3 steps on 2 and
# on 3 ranks the check records each all-reduce (when it starts, when it is waited for, how many
# elements it carries) and compares every `p.grad` with the average computed one parameter at
# a time.

# %%
grade.check_steps_on_ranks(student)

# %% [markdown]
# All checks passed? Then you have written the heart of PyTorch's DDP, and one of its
# refinements: its reducer also rebuilds its buckets once, after the first iteration, from the
# order the gradients arrived, and broadcasts rank 0's order so that every rank holds the same
# layout (a rank's observation is its own; layouts that differ add unrelated tensors, or hang
# when their sizes differ). Launching strictly in index order is what lets a rank whose
# gradients arrive in another order still issue the same collectives in the same order. Having
# written it, compare with `course_lib/parallel/dp/ddp.py` (which keeps the reverse-order
# guess), and take two questions back to notebook 03: what must a DDP do for a parameter that
# gets no gradient on one rank in some step (§5, step 5), and why does PyTorch give its *first*
# bucket a smaller cap (§8)?
