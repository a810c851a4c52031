# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex05_tensor_parallel.ipynb)

# %% [markdown]
# # Exercise 05: Megatron's f and g, column- and row-parallel layers
#
# **Goal.** Write the core of tensor parallelism yourself, in
# `exercises/ex05_tensor_parallel/student.py`: two operators and two layers that let `tp` ranks
# share every linear layer of a transformer block and still compute exactly what one process
# computes. Each stub's docstring says what it must do; how is up to you.
#
# 1. **f** (`CopyToGroup`) and **g** (`ReduceFromGroup`), as `torch.autograd.Function`s: f
#    opens a tensor-parallel region, g closes it. Their forward and backward are each other's
#    transpose (notebook 05, section 2).
# 2. `qkv_rows_for_rank(d_model, n_head, tp, rank)`: which rows of the fused QKV weight a rank
#    keeps so that attention, unchanged, runs on whole heads (section 3).
# 3. `ColumnParallelLinear(full, group=None, rows=None)`: a rank's share of a layer, split by
#    output features.
# 4. `RowParallelLinear(full, group=None)`: a rank's share, split by input features, whose
#    output is the full layer's.
# 5. `uneven_mlp(fc, proj, group=None)`: the MLP `proj(GELU(fc(X)))` split over `tp` ranks when
#    `tp` does **not** divide its hidden width, which notebook 05 never does (the vocabulary is
#    padded there instead; here nothing may be padded). Decide which hidden features each rank
#    takes, what its `proj` shard must hold to match, and what the one all-reduce then sums.
#
# **Think first**, on paper, for `Z = GELU(X A) B` on 2 ranks: which matrix is split by columns,
# which by rows, where the one all-reduce of the forward pass goes, and where the one of the
# backward pass goes. Then: after your row-parallel layer, every rank holds the same `Z` and
# computes the same loss. What gradient does each rank's partial result need?
#
# <details><summary>Answer</summary>
#
# $A$ by columns (GELU then acts on complete values), $B$ by rows. Forward: one all-reduce of
# the partial products $\mathrm{GELU}(XA_r)B_r$, after $B$ (that is g). Backward: $X$ fed every
# rank's columns, so its gradient is the sum over ranks of $\partial L/\partial Y_r A_r^\top$: one
# all-reduce before $A$ (that is f's backward). Each partial product is a term of the sum $Z$, so
# its gradient is $\partial L/\partial Z$ itself, which every rank already holds: g's backward
# sends nothing.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your code runs on 2 and 4 real ranks and is
# compared with values worked out by hand (f and g), with what the attention module needs
# (the QKV rows), and with the same layers and the same GPT run in a single process (your
# layers): outputs, input gradients and weight gradients. Edit `student.py`, then
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
from course_lib.grading import ex05_tensor_parallel as checks
from course_lib.grading import ex05_uneven
from course_lib.grading import load_student

# Your module may not import the library's tensor parallelism (checks.REFUSE lists it):
# the checks must pass on your own code.
student = load_student("ex05_tensor_parallel", refuse=checks.REFUSE)

# %% [markdown]
# ## Check 1: f and g
# Rank `r` holds `x = [r+1, r+1, r+1]` and weights its output by `r+1` in the loss, so the
# answer on every rank follows from the rules by hand: work out what f and g must return forward
# and backward on 2 ranks before you run it. (If it fails, re-read notebook 05's section 2:
# which of the two sums in forward?)

# %%
checks.check_f_and_g(student)

# %% [markdown]
# ## Check 2: whole heads of the fused QKV weight
# For several shapes (up to 12 heads over 4 ranks): the ranks together keep every fused row
# once, and each rank's rows are the Q, K and V rows of whole heads, the heads whose outputs its
# row-parallel `attn.proj` reads. (Section 3 of notebook 05 draws the fused rows.)

# %%
checks.check_qkv_rows(student)

# %% [markdown]
# ## Check 3: a column-then-row MLP equals the full one
# `Z = proj(GELU(fc(X)))` with `fc` column-parallel and `proj` row-parallel, on 2 and 4 ranks:
# each shard holds its slice of the full layer; the output and the gradient of `X` equal the
# single-process ones; each rank's weight gradients are its slice of the full gradients; and
# the pair costs exactly one all-reduce forward and one backward, each of X's size.

# %%
checks.check_mlp(student)

# %% [markdown]
# ## Check 4: your layers inside the course GPT
# Every block's `qkv` (your rows: whole heads), `attn.proj`, `mlp.fc` and `mlp.proj` are
# replaced by your layers on 2 ranks; the embeddings and the head stay whole. The loss must be
# the single-process loss on both ranks and every shard's gradient the matching slice.

# %%
checks.check_gpt(student)

# %% [markdown]
# ## Check 5: a hidden width `tp` does not divide
# `uneven_mlp` on a hidden width of 7 on 2 ranks and 10 on 4. What each rank's shards hold is
# read off them by comparing them with the full layers: every hidden feature on exactly one
# rank, shares that differ by at most one feature, `proj`'s columns the features `fc`
# computes. Then the output, the gradient of `X` and every weight and bias gradient against
# the single process, and one all-reduce forward and one backward.

# %%
ex05_uneven.check_uneven_mlp(student)

# %% [markdown]
# All checks passed? Then you have written Megatron's tensor parallelism for the transformer
# block. Having written it, compare with the library's version: `course_lib/comm/autograd.py`
# (`copy_to_group` and `reduce_from_group`, your f and g), `course_lib/parallel/tp/layers.py`
# (the layers, which also handle sequence parallelism and the padded vocabulary) and
# `qkv_rows` in `course_lib/parallel/tp/apply.py`.
#
# Two questions to think about (notebook 05, sections 2 and 7 discuss them):
#
# * Your `proj` bias is whole on every rank and added after g. What would go wrong if each
#   rank added it *before* g?
# * With sequence parallelism, f becomes an all-gather along the sequence and g a
#   reduce-scatter. What happens to the bias then, and to its gradient?
#
# <details><summary>Answers</summary>
#
# * g sums over the ranks, so a bias added before it would be counted `tp` times.
# * After the reduce-scatter each rank holds only its share of the sequence, so each rank adds
#   the (replicated) bias to its tokens only, and its gradient on one rank covers only those
#   tokens: the bias enters through f, whose backward sums the ranks' parts into the whole
#   gradient.
# </details>
