# %% [markdown]
# # Exercise 10: predict the step time of a DP x TP layout
#
# **Goal.** In `exercises/ex10_step_time/student.py`, write `step_time_dp_tp(config, cluster,
# dp, tp, micro_batch, m, pp, seq, recipe)`: one optimizer step's seconds as compute + the
# layers' fixed overhead + tensor parallelism's all-reduces + the data-parallel all-reduce that
# backward does not hide + the pipeline bubble. The docstring of the stub states every term.
#
# Work on paper first: for GPT-3 175B on 1024 A100s with dp = 16, tp = 8, pp = 8 and 16
# micro-batches of one sequence, which term is largest? Does the data-parallel all-reduce
# hide behind backward? **Re-read in notebook 10:** section 1 (the roofline: why compute is
# FLOPs over FLOP/s), section 2 (the model term by term) and section 4 (how it compares
# with measured runs). Notebook 02's alpha-beta model prices each collective; notebook 06
# derives the bubble.
#
# **How grading works.** Your function is graded two ways. First against the course's full
# model, term by term, for several layouts of two published models on published clusters:
# compute exactly, the communication within a few percent (the full model also counts the
# embedding's, the head's and the loss's all-reduces, which your model leaves out). Then
# against measured runs: with the cluster calibrated on 8 emulated ranks, your predictions
# must order the measured DDP and tensor-parallel runs as they really ran. A check prints
# `PASS  ...` or raises `CheckFailed` with what it expected. The stored outputs are what
# correct code prints. Edit `student.py`, then *Kernel → Restart and run all*.

# %%
from course_lib.estimate import GPT3_175B, LLAMA3_70B
from course_lib.estimate.clusters import gpu_cluster
from course_lib.estimate.step_time import Layout, step_time
from course_lib.estimate.validation import load_validation
from course_lib.grading import check_close, check_equal, load_student

student = load_student("ex10_step_time")

# %% [markdown]
# ## Check 1: compute, tensor parallelism and data parallelism without a pipeline
# GPT-3 175B on 1024 A100s and Llama-3 70B on 512 H100s, in bf16, for several dp x tp
# layouts: every term must equal the reference.

# %%
cases = [(GPT3_175B, gpu_cluster("A100 SXM 80 GB", 1024), 2048, dict(dp=128, tp=8, micro_batch=1, m=12)),
         (GPT3_175B, gpu_cluster("A100 SXM 80 GB", 1024), 2048, dict(dp=512, tp=2, micro_batch=2, m=1)),
         (LLAMA3_70B, gpu_cluster("H100 SXM 80 GB", 512), 4096, dict(dp=64, tp=8, micro_batch=2, m=4)),
         (LLAMA3_70B, gpu_cluster("H100 SXM 80 GB", 512), 4096, dict(dp=256, tp=2, micro_batch=1, m=2))]
for config, cluster, seq, kw in cases:
    got = student.step_time_dp_tp(config, cluster, seq=seq, **kw)
    ref = step_time(config, Layout(**kw), cluster, seq)
    name = f"{'GPT-3' if config is GPT3_175B else 'Llama-3 70B'} dp={kw['dp']} tp={kw['tp']}"
    check_close(f"{name}: compute (s)", got["compute"], ref["compute"], rtol=1e-6, atol=1e-9)  # the same formula
    # yours leaves out what the reference also counts (the loss's all-reduces, DDP's buckets): a few %
    for term in ("tp", "dp_total", "dp_exposed"):
        check_close(f"{name}: {term} (s)", got[term], ref[term], rtol=0.03, atol=1e-6)
    check_close(f"{name}: total without a pipeline (s)", got["total"],
                ref["compute"] + ref["tp"] + ref["dp_exposed"], rtol=0.03, atol=1e-6)

# %% [markdown]
# ## Check 2: with a pipeline, the bubble
# The same GPT-3 layout cut into pp = 8 stages with m = 16 micro-batches: each rank now holds
# n_layer / pp layers, and 1F1B idles a fraction (pp - 1) / (m + pp - 1) of the step.

# %%
cluster = gpu_cluster("A100 SXM 80 GB", 1024)
for m in (8, 16, 64):
    kw = dict(dp=16, tp=8, pp=8, micro_batch=1, m=m)
    got = student.step_time_dp_tp(GPT3_175B, cluster, seq=2048, **kw)
    ref = step_time(GPT3_175B, Layout(**kw), cluster, 2048)
    check_close(f"pp=8, m={m}: compute (s)", got["compute"], ref["compute"], rtol=1e-6, atol=1e-9)  # same formula
    for term in ("tp", "dp_total"):  # as in check 1, and the reference also counts the stage-boundary terms
        check_close(f"pp=8, m={m}: {term} (s)", got[term], ref[term], rtol=0.06, atol=1e-6)
    check_close(f"pp=8, m={m}: bubble fraction", got["bubble"] / (got["compute"] + got["tp"] + got["bubble"]),
                7 / (m + 7), rtol=1e-6, atol=1e-9)  # a formula: float64 rounding only

# %% [markdown]
# ## Check 3: the two measured runs, predicted
# Notebook 10, section 4 timed DDP and tensor parallelism on 8 emulated ranks (16 sequences of
# 32 tokens, fp32) and calibrated the cluster there: a fixed cost per layer, FLOP/s, and a
# table of measured all-reduce times (which `collective_time` reads). Your model, fed that
# calibration, must come within 30% of the full model's prediction (which also counts the
# optimizer, DDP's buckets and the loss) and rank the two layouts as the full model does.
# How they really ran is printed below the checks: measured times are not graded.

# %%
data = load_validation()
runs = {r["label"]: r for r in data["runs"]}
predicted, full_model = {}, {}
for label, kw in (("DDP dp8", dict(dp=8, tp=1, micro_batch=2)), ("TP tp8", dict(dp=1, tp=8, micro_batch=16))):
    predicted[label] = student.step_time_dp_tp(data["config"], data["cluster"], seq=data["seq"], recipe="fp32",
                                               **kw)["total"]
    ref = step_time(data["config"], Layout(**kw), data["cluster"], data["seq"], "fp32")
    full_model[label] = ref["total"]
    # a simpler model than the reference (no optimizer, DDP's buckets or loss): within 30% of it
    check_close(f"{label}: predicted step time without the optimizer (s)", predicted[label],
                ref["total"] - ref["optimizer"], rtol=0.3, atol=1e-6)
check_equal("layouts from fastest to slowest: yours = the full model's", sorted(predicted, key=predicted.get),
            sorted(full_model, key=full_model.get))

# %% tags=["nbval-ignore-output"]
print("as measured in notebook 10:", ", ".join(f"{k} {runs[k]['measured'] * 1e3:.0f} ms"
                                              for k in sorted(predicted, key=lambda k: runs[k]["measured"])))

# %% [markdown]
# ## Going further
#
# * Add full recomputation: which terms change, and by how much? (Recomputing the forward
#   repeats its two all-reduces per layer.)
# * Let the data-parallel all-reduce overlap with the whole backward instead of the last
#   micro-batch's: for which layouts of check 1 does the exposed time change?
# * Your model leaves out the optimizer update and the loss's all-reduces. On 8 emulated ranks,
#   which of the two measured layouts does leaving out the optimizer hurt more, and why?
#   (Notebook 10, section 4: the fixed cost per tensor.)
