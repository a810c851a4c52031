# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex01_memory_math.ipynb)

# %% [markdown]
# # Exercise 01: plan a training layout
#
# **The task.** You have to train Llama-3 70B (70.6 billion parameters) with AdamW in bf16 mixed
# precision, sequences of 4,096 tokens, micro-batch 1. First on **one node of 8 H100s**
# (80 GB each), then on **8 such nodes**. Which layouts fit, and how long will training take?
#
# In `exercises/ex01_memory_math/student.py` you write five functions:
#
# 1. `state_bytes_per_gpu(n_params, recipe, zero_stage, dp)`: the bytes of model state one GPU
#    holds, for a precision recipe and a ZeRO stage. **The step notebook 01 does not take:**
#    there the parameter count divides evenly by `dp`. Real counts rarely do (70,553,706,496 is
#    not a multiple of 48), and a GPU holds whole elements: ZeRO pads the last shard, so every
#    rank holds the same number of elements of a sharded buffer. Work out what that costs,
#    including for a model with fewer parameters than ranks.
# 2. `needs_offload(n_params, n_gpus, gpu_bytes)`: can the model state fit on these GPUs at
#    all, however it is split? (A lower bound: decide before searching.)
# 3. `plan_70b_on_8_gpus()`: a layout (dp, tp, pp, ZeRO stage, recomputation, offload) that
#    fits one node.
# 4. `plan_70b_on_64_gpus()`: a layout for 64 GPUs with no offload and tensor parallelism
#    inside a node.
# 5. `training_days(...)`: wall-clock days for 15·10¹² tokens on the 64 GPUs.
#
# Parts 1, 2 and 5 are arithmetic you write yourself (`student.py` may not import
# `course_lib.estimate`). For 3 and 4 there is no single right answer: the checks ask the
# course's estimator (notebook 01's per-GPU memory formula) whether your layout fits, with 10 %
# of each GPU left free for the CUDA context, communication buffers and fragmentation. Search
# here, in the notebook, with `breakdown(plan)` below; think first about which knob removes
# what.
#
# **Re-read in notebook 01:** section 2 (recipes, ZeRO stages), section 3 (activations,
# selective and full recomputation), section 4 and 5 (FLOPs, MFU, time to train) and section 6
# (what tp, pp, dp, ZeRO and offload each divide).
#
# **How grading works.** Each check cell prints `PASS  ...` when your answer is right;
# otherwise it raises `CheckFailed` saying which rule failed (or your `NotImplementedError`).
# Edit `student.py`, then *Kernel → Restart and run all*.

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
from course_lib import estimate, units
from course_lib.grading import load_student
from course_lib.grading import ex01_memory_math as grade

student = load_student("ex01_memory_math", refuse=grade.REFUSE)
P = estimate.param_count(grade.MODEL)
print(f"Llama-3 70B: {P:,} parameters; budget per GPU {units.fmt_bytes(grade.BUDGET)} of {units.fmt_bytes(grade.H100)}")

# %% [markdown]
# ## Check 1: model-state bytes per GPU
# For each recipe, ZeRO stages 0-3 on four sizes: one that `dp` divides, two that it does not,
# and one with fewer parameters than ranks.

# %%
grade.check_state_bytes(student)

# %% [markdown]
# ## Check 2: does the state fit at all?
# Before searching for a layout, a lower bound: the model state spread perfectly over every
# GPU. If even that exceeds a GPU, no layout fits without moving state off the GPUs.

# %%
grade.check_needs_offload(student)

# %% [markdown]
# ## Searching for a layout
# `breakdown(plan)` gives the busiest GPU's bytes for a plan `{"dp", "tp", "pp", "zero_stage",
# "recompute", "offload"}`. Here is one that does **not** fit one node: plain data parallelism.
# Try your own candidates in a new cell, then write the one you chose in `student.py`.

# %%
def show(plan):
    m = grade.breakdown(plan)
    print(", ".join(f"{k} {units.fmt_bytes(m[k])}" for k in ("params", "grads", "optimizer", "activations"))
          + f" = {units.fmt_bytes(m['total'])} (budget {units.fmt_bytes(grade.BUDGET)}); "
          + f"offloaded per GPU {units.fmt_bytes(m['cpu_offload'])}")


show({"dp": 8, "tp": 1, "pp": 1, "zero_stage": 0, "recompute": "none", "offload": "none"})

# %% [markdown]
# ## Checks 3 and 4: your layouts
# The rules: `dp * tp * pp` uses every GPU; the estimator accepts it (tp divides the heads, pp
# the layers, ...); the busiest GPU needs at most 90 % of 80 GB; what is offloaded fits the CPU
# memory of the nodes (2 TB per node). On 64 GPUs: no offload, and `tp` divides 8 (one node).

# %%
grade.check_plan("one node, 8 GPUs", student.plan_70b_on_8_gpus(), 8, allow_offload=True)
grade.check_plan("8 nodes, 64 GPUs", student.plan_70b_on_64_gpus(), 64, allow_offload=False)

# %% [markdown]
# Look at what your layouts cost (`show(student.plan_70b_on_8_gpus())`): which part of each
# GPU's memory is largest, and what you pay for it (offload moves 12 bytes per parameter over
# PCIe every step; full recomputation reruns each layer's forward; pipeline stages idle in
# their bubbles; ZeRO-3 gathers every layer's weights twice per step).
#
# ## Check 5: how long does it take?
# 15·10¹² tokens (Llama 3's training set) on your 64 H100s at 989 TFLOP/s bf16 dense peak and
# 40 % MFU, by 6·P·D; the check also tries other sizes.

# %%
grade.check_training_days(student)

# %% [markdown]
# Fitting in memory is only the first question: compare your number of days on 64 GPUs with
# how long a model generation lasts. Meta trained Llama 3 405B on up to 16,384 H100s (Llama
# Team, 2024, *The Llama 3 Herd of Models*), which is why later notebooks combine data
# parallelism with the tensor, pipeline and ZeRO sharding you just planned. Having written your
# functions, compare with `course_lib/estimate/memory.py` (`model_state_bytes`) and
# `course_lib/estimate/compute.py`.
