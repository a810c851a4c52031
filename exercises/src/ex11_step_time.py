# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex11_step_time.ipynb)

# %% [markdown]
# # Exercise 11: predict the step time of a DP x TP (x PP) layout
#
# **Goal.** In `exercises/ex11_step_time/student.py`, write `step_time_dp_tp(config, cluster,
# dp, tp, micro_batch, m, pp, v, seq, recipe)`: how many seconds one optimizer step of a layout
# takes, term by term: the compute, the layers' fixed launch cost, tensor parallelism's
# all-reduces, the data-parallel all-reduce (all of it, and the part the step waits for) and
# the pipeline's idle time. The stub's docstring says what each term is and which inputs you
# have; how to compute it is yours to work out. Two terms need a short derivation:
#
# * **the exposed data-parallel traffic.** The gradient all-reduce can run beside backward,
#   but only once the gradients are final: which backward work is left by then, and how long
#   is it?
# * **the bubble in seconds.** Notebook 06 gives the fraction of a step that a pipeline rank
#   idles. Turn it into seconds from the work the rank does.
#
# **Re-read:** notebook 01 (FLOPs per token; how a step's FLOPs split between forward and
# backward), notebook 02 (the cost of an all-reduce), notebook 03 (gradient accumulation
# without synchronising), notebook 05 (Megatron's f and g), notebook 06 (the bubble
# fraction), notebook 10 (the mesh's order: which ranks form a group, and their stride) and
# notebook 11, sections 1 to 4.
#
# **Work on paper first.** GPT-3 175B on 1024 A100s, dp = 16, tp = 8, pp = 8, 16
# micro-batches of one sequence: which term is the largest? Double the micro-batches at the same
# micro-batch size: what happens to the bubble in seconds, and to its share of the step?
#
# <details><summary>Answer</summary>
#
# Compute is the largest term. Doubling m doubles the work of every rank (compute and the
# all-reduces of every micro-batch) but not the bubble in seconds: the pipeline still fills
# and drains once per step. So the bubble's share of the step falls as m grows; check 2
# tests that before it compares any values.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` naming the term that differs (and a question to ask yourself) when it is not.
# Your terms are compared, term by term, with the course's for layouts of two published models on
# published clusters (some on just two nodes, where which ranks form a group decides which link
# it crosses, and some with a fixed cost per layer), and with properties any correct model has;
# then, fed the calibration of notebook 10, your model must order four measured runs as they
# really ran. Edit `student.py`, then
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
from course_lib.grading import ex11_step_time as ex11, load_student

student = load_student("ex11_step_time", refuse=ex11.REFUSED)

# %% [markdown]
# ## Check 1: compute, tensor and data parallelism, no pipeline
# GPT-3 175B on 1024 A100s and Llama-3 70B on 512 H100s, in bf16, for four dp x tp layouts,
# then Llama-3 70B on two nodes of 8 H100s with a fixed cost of 20 µs per layer and
# micro-batch: every term.

# %%
ex11.check_no_pipeline(student.step_time_dp_tp)

# %% [markdown]
# ## Check 2: the bubble
# The GPT-3 layout with dp = 16, tp = 8, pp = 8 and a fixed cost of 20 µs per layer and
# micro-batch: 1F1B with 8, 16 and 64 micro-batches, and interleaved 1F1B with v = 2 chunks per
# rank at 16.

# %%
ex11.check_pipeline(student.step_time_dp_tp)

# %% [markdown]
# ## Check 3: the exposed data-parallel all-reduce
# Llama-3 70B, dp = 64, tp = 8, the same 8 sequences per replica in one micro-batch or in
# eight, with backward able to hide traffic fully (overlap 1), a quarter of the time, or not
# at all.

# %%
ex11.check_exposed_dp(student.step_time_dp_tp)

# %% [markdown]
# ## Check 4: the measured runs
# Notebook 11, section 4 calibrated 8 emulated ranks (16 sequences of 32 tokens, fp32): a
# fixed cost per layer, FLOP/s, and a table of measured all-reduce times that
# `collective_time` reads. Your model, fed that calibration, predicts DDP, tensor parallelism
# and two mixes of both; the check also requires that it order them as they were measured.

# %%
ex11.check_measured(student.step_time_dp_tp)

# %% [markdown]
# ## Having written it, compare
#
# The course's full model is `course_lib.estimate.step_time` (notebook 11, section 2): compare
# its `step_time` with yours. It also counts what your model leaves out: the embedding's, the
# head's and the loss's all-reduces, DDP's gradient buckets, the pipeline's point-to-point
# sends, ZeRO, recomputation, expert parallelism, the optimizer's update, and ranks that share
# CPU cores. On the 8 emulated ranks yours predicts every run too fast: which left-out term
# explains most of the gap for DDP?
#
# ## Going further
#
# * Add full recomputation: which terms change, and by how much? (Recomputing the forward
#   repeats its two all-reduces per layer.)
# * Let the data-parallel all-reduce overlap with the whole backward instead of the last
#   micro-batch's: in check 1, which layouts' exposed time changes, and is that still a model
#   of gradient accumulation?
# * Add ZeRO-1: the all-reduce becomes a reduce-scatter of the gradients and an all-gather of
#   the updated parameters. Do the bytes on the wire change?
