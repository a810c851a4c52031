# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex08_zero2_step.ipynb)

# %% [markdown]
# # Exercise 08: a ZeRO-2 step with AdamW
#
# **Goal.** Write, in `exercises/ex08_zero2_step/student.py`, the optimizer of ZeRO stage 2
# (Rajbhandari et al. 2020) for a plain model whose parameters are the same on every rank:
#
# 1. `shard_bounds(numel, world_size, rank)`: rank r's piece of a flat tensor padded to a
#    multiple of N;
# 2. `Zero2AdamW(params, lr, betas, weight_decay, eps, group)`: keeps the fp32 master weights
#    and AdamW's state of its own pieces only;
# 3. its gradients: rank r ends each backward with piece r of the **mean** gradient of every
#    parameter, and at no moment holds more than those pieces plus the one full gradient
#    backward has just produced;
# 4. `Zero2AdamW.step()`: AdamW on the pieces, every parameter whole again on every rank, and
#    no gradient left behind.
#
# **Part 2** (about 20 minutes) shards a different optimizer, Muon (Jordan et al. 2024), which
# needs each weight matrix whole (notebook 08, §13):
#
# 5. `assign_owners(shapes, world_size)`: which rank orthogonalises which matrix, with the
#    Newton-Schulz work balanced over the ranks;
# 6. `muon_owner_step(...)`: each rank holds a row block of every matrix's momentum; the
#    matrix's owner gathers the blocks, runs Newton-Schulz once, and sends each rank its rows.
#
# The stub's docstring states the rules. Re-read notebook 08 first: §2 (the flat buffer and
# its padding), §3 (one sharded step, checked against one process), §4 (what each rank should
# hold), §5 (why stage 2 must act *during* backward) and §7 (why a reduce-scatter plus an
# all-gather cost what DDP's all-reduce costs).
#
# **Think first.** The model below has 40 parameter tensors, 108,413 elements in all; the
# largest, an attention `qkv.weight`, has 12,288. In fp32 on 4 ranks: how many gradient bytes
# does a rank hold at the end of backward under stage 1? And at most, at any moment of
# backward, under stage 2? (Per-tensor padding adds 3 elements in all on 4 ranks.)
#
# <details><summary>Answer</summary>
#
# Stage 1 holds every gradient until backward ends: $4P = 4 \times 108{,}413 = 433{,}652$
# bytes. Stage 2 holds its shards, $S = \sum_i \lceil P_i/4 \rceil = 27{,}104$ elements at most,
# plus the one full gradient in flight, at most the largest tensor:
# $4\,(27{,}104 + 12{,}288) = 157{,}568$ bytes, about 36% of stage 1. On N ranks the shards
# shrink as $P/N$; the tensor in flight does not, which is why real implementations cap it
# with a bucket size.
# </details>
#
# **Think first, too.** `mlp.fc.bias` has 127 elements. On 4 ranks, how many of rank 3's
# elements are padding, and what value must the padding have so that AdamW never moves it?
#
# <details><summary>Answer</summary>
#
# $S = \lceil 127/4 \rceil = 32$: the padded tensor has 128 elements, so rank 3's last element
# is padding. Zero value and zero gradient: AdamW's m and v stay 0, the update
# $m/(\sqrt v + \epsilon)$ is 0 and weight decay scales 0 to 0.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your optimizer runs on 2 and 4 real ranks
# and is compared with `torch.optim.AdamW` in one process on the whole batch; the bytes each
# rank holds are measured while backward runs. Part 2's step runs on 2 and 3 real ranks against
# the single-process Muon. Edit `student.py`, then *Kernel → Restart and run all*.

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
from course_lib.grading import ex08_muon
from course_lib.grading import ex08_zero2_step as ex08
from course_lib.grading import load_student

student = load_student("ex08_zero2_step", refuse=ex08.REFUSE)

# %% [markdown]
# ## Check 1: `shard_bounds`

# %%
ex08.check_shard_bounds(student.shard_bounds)

# %% [markdown]
# ## Check 2: the gradient shards are the mean gradient
# One backward on a fixed batch: every rank back-propagates its half (or quarter), then calls
# `step()`; the pieces the ranks return, laid side by side, must be the gradient of the whole
# batch computed in one process, and zero in the padding. A step that forgets to divide by N,
# or hands a rank another rank's piece, fails here.

# %%
from course_lib import run_on_ranks

for n in ex08.WORLD_SIZES:
    ex08.check_gradient_shards(run_on_ranks(ex08.rank_gradient_shards, student.Zero2AdamW, world_size=n,
                                            **ex08.RANKS))

# %% [markdown]
# ## Checks 3-6: three training steps on real ranks
# Each rank trains 3 steps (zero_grad, forward, backward, `step()`) on its share of the same
# batches as the single process. Meanwhile the checker measures, on each rank, the bytes of
# every tensor it can reach from the parameters' gradients, from your optimizer and from the
# hooks you put on the parameters, and records the collectives of each step.

# %%
runs = {n: ex08.run_training(student.Zero2AdamW, n) for n in ex08.WORLD_SIZES}

# %% [markdown]
# **Check 3: the same training as one process.** Every rank must end with the single
# process's parameters, and the mean of the ranks' losses must be the whole batch's loss, step
# by step.

# %%
for n, out in runs.items():
    ex08.check_same_as_one_process(out)

# %% [markdown]
# **Check 4: what a rank keeps between steps.** With $S = \sum_i \lceil P_i/N \rceil$ shard
# elements: 4 bytes of fp32 master weight and 8 of AdamW moments per element, 12S bytes, and
# no gradient at all.

# %%
for n, out in runs.items():
    ex08.check_state_after_step(out)

# %% [markdown]
# **Check 5: never the whole gradient.** The gradient bytes a rank holds at any moment of
# backward: at most its shards plus one full gradient, $4(S + \max_i P_i)$, where stage 1
# holds $4P$.

# %%
for n, out in runs.items():
    ex08.check_peak_gradient_bytes(out)

# %% [markdown]
# **Check 6: DDP's bytes.** Per step, a reduce-scatter of every padded gradient ($4NS$ bytes
# in, one call per parameter) and all-gathers bringing back every piece ($4NS$ bytes out):
# on a ring, $2\frac{N-1}{N}\cdot 4NS$ bytes, what DDP's all-reduce sends.

# %%
for n, out in runs.items():
    ex08.check_collectives(out)

# %% [markdown]
# ## Part 2: Muon's owner step
#
# **Think first.** A model's hidden matrices, in the order it lists them, are per layer
# `qkv` (48 x 16), `proj` (16 x 16), `fc` (64 x 16) and `fc2` (16 x 64). Newton-Schulz's work
# on a matrix is proportional to $\min(d_0, d_1)^2 \max(d_0, d_1)$: here 48, 16, 64 and 64 units
# per layer. On 2 ranks, dealing the matrices out in turn (matrix $i$ to rank $i \bmod 2$):
# how much work does each rank get over 3 layers, and how much would the busiest rank have at best?
#
# <details><summary>Answer</summary>
#
# In turn: rank 0 gets every `qkv` and `fc`, $3(48 + 64) = 336$ units; rank 1 every `proj` and
# `fc2`, $3(16 + 64) = 240$. The total is 576, so the best possible is 288 each, and 336 is 17%
# more, and the step waits for the busiest rank. A split of 288 each exists: three `fc2` and
# two `qkv` on one rank ($3 \cdot 64 + 2 \cdot 48$), the rest on the other.
# </details>
#
# **Think first, too.** The "gather" way runs Newton-Schulz on every rank: each all-gathers the
# whole momentum matrix. For a $d_0 \times d_1$ fp32 matrix on $N$ ranks, how many bytes does a
# rank receive per step that way, and how many when only the owner gathers it and sends back
# bf16 rows (for a rank that is not the owner)?
#
# <details><summary>Answer</summary>
#
# Gather everywhere: $4 N c\, d_1$ bytes into every rank ($c = \lceil d_0/N \rceil$ rows each).
# Owner-compute: the owner receives $4 N c\, d_1$; every other rank only its rows of the
# update, $2 c\, d_1$: $2N$ times fewer bytes, and Newton-Schulz runs once instead of $N$ times.
# </details>

# %% [markdown]
# ## Check 7: `assign_owners`
# Every matrix has one owner, and the busiest rank's work stays within
# $\sum_i w_i / N + (1 - 1/N) \max_i w_i$ on model-like lists of shapes.

# %%
ex08_muon.check_assign_owners(student.assign_owners)

# %% [markdown]
# ## Checks 8-9: the owner step on real ranks
# Four matrices (one tall, one whose 17 rows leave padding, one wide, one square), 3 steps on
# 2 and 3 ranks, with the owners spread over the ranks and then all on the last rank. The rows
# the ranks end with, side by side, must be the single-process Muon's weights and momentum
# after the same 3 steps. With every matrix on the last rank, the other ranks may receive
# their own rows of each update and no more.

# %%
muon_runs = {n: ex08_muon.run_muon(student.muon_owner_step, n) for n in ex08_muon.MUON_WORLD_SIZES}
for n, out in muon_runs.items():
    ex08_muon.check_muon_same_as_one_process(out)

# %%
for n, out in muon_runs.items():
    ex08_muon.check_muon_bytes(out)

# %% [markdown]
# ## Having written it, compare
#
# All checks passed? Then you have written ZeRO's core. Now compare with the course's own
# implementation, which notebook 08 ran:
#
# * `course_lib/parallel/zero/flat.py`: one flat, padded buffer for a whole unit of
#   parameters (fewer, larger collectives than one per tensor);
# * `course_lib/parallel/zero/stage2.py`: the same hooks, but gradients gathered into
#   **buckets** and reduce-scattered asynchronously while backward goes on, with a cap on
#   buckets in flight;
# * `course_lib/parallel/zero/sharded_optimizer.py`: the sharded step for any element-wise
#   optimizer;
# * `course_lib/parallel/zero/muon.py` and `course_lib/estimate/muon.py`: sharded Muon three
#   ways (gather everywhere, owners in turn, owners balanced by size), its bytes and its load
#   imbalance.
#
# Two questions to take back: your hook blocks backward until each reduce-scatter returns;
# what would you change so that it overlaps with the rest of backward, and what does that cost
# in memory? And what does stage 3 add to this step (notebook 08, §6)? For part 2: your owner
# step does one matrix after another, each waiting for its gather; how would you overlap one
# matrix's Newton-Schulz with the next one's gather?
