# %% [markdown]
# # Exercise 01: plan a training layout
#
# **The task.** You have to train Llama-3 70B (70.6 billion parameters) with AdamW in bf16 mixed
# precision, sequences of 4,096 tokens, micro-batch 1. First on **one node of 8 H100s**
# (80 GB each), then on **8 such nodes**. Which layouts fit, and how long will training take?
#
# In `exercises/ex01_memory_math/student.py` you write five functions:
#
# 1. `state_bytes_per_param(recipe, zero_stage, dp)`: model-state bytes one GPU holds per
#    parameter, for a precision recipe and a ZeRO stage.
# 2. `needs_offload(n_params, n_gpus, gpu_bytes)`: can the model state fit on these GPUs at
#    all, however it is split? (A lower bound: decide before searching.)
# 3. `plan_70b_on_8_gpus()`: a layout (dp, tp, pp, ZeRO stage, recomputation, offload) that
#    fits one node.
# 4. `plan_70b_on_64_gpus()`: a layout for 64 GPUs with no offload and tensor parallelism
#    inside a node.
# 5. `training_days(...)`: wall-clock days for 15·10¹² tokens on the 64 GPUs.
#
# For 3 and 4 there is no single right answer: the checks ask `course_lib.estimate` (notebook
# 01's per-GPU memory formula) whether your layout fits, with 10 % of each GPU left free for
# the CUDA context, communication buffers and fragmentation. You may try candidates with
# `estimate.per_gpu_memory` yourself; think first about which knob removes what.
#
# **Re-read in notebook 01:** section 2 (recipes, ZeRO stages), section 3 (activations,
# selective and full recomputation), section 4 and 5 (FLOPs, MFU, time to train) and section 6
# (what tp, pp, dp, ZeRO and offload each divide).
#
# **How grading works.** Each check cell prints `PASS  ...` when your answer is right;
# otherwise it raises `CheckFailed` saying which rule failed (or your `NotImplementedError`).
# The outputs stored in this notebook are what a correct answer prints. Edit `student.py`,
# then *Kernel → Restart and run all*.

# %%
from course_lib import estimate, units
from course_lib.grading import CheckFailed, check_close, check_equal, load_student, passed

student = load_student("ex01_memory_math")
H100 = units.from_spec_gb(80)          # the spec sheet's 80 GB = 80e9 bytes = 74.5 GiB
BUDGET = 0.9 * H100                    # leave 10% for the CUDA context, buffers, fragmentation
HOST_MEMORY = 2 * 10**12               # CPU memory of one 8-GPU node (e.g. a DGX H100: 2 TB)
MODEL = estimate.LLAMA3_70B
P = estimate.param_count(MODEL)
print(f"Llama-3 70B: {P:,} parameters; budget per GPU {units.fmt_bytes(BUDGET)} of {units.fmt_bytes(H100)}")

# %% [markdown]
# ## Check 1: model-state bytes per parameter
# For each recipe, ZeRO stages 0-3 over 8 and 64 data-parallel GPUs.

# %%
for recipe in ("fp32", "bf16_mixed", "bf16_fp32_accum", "bf16_autocast"):
    got, expected = [], []
    for dp in (8, 64):
        for stage in range(4):
            n = 1000 * dp  # divisible by dp, so the shards are exact
            got.append(student.state_bytes_per_param(recipe, stage, dp))
            expected.append(estimate.model_state_bytes(n, recipe, stage, dp)["total"] / n)
    # the same float64 arithmetic in another order: equal to ~1e-16 relative
    check_close(f"{recipe}: bytes/param for ZeRO-0..3 at dp=8 and dp=64", got, expected, rtol=1e-9, atol=0)

# %% [markdown]
# ## Check 2: does the state fit at all?
# Before searching for a layout, a lower bound: the model state (16 bytes per parameter with
# AdamW in mixed precision) spread perfectly over every GPU. If even that exceeds a GPU, no
# layout fits without moving state off the GPUs.

# %%
def lower_bound_says_offload(n_params, n_gpus, gpu_bytes):
    return estimate.model_state_bytes(n_params, "bf16_mixed", 3, n_gpus)["total"] > gpu_bytes

for name, n_params in (("Llama-3 8B", estimate.param_count(estimate.LLAMA3_8B)), ("Llama-3 70B", P),
                       ("Llama-3 405B", estimate.param_count(estimate.LLAMA3_405B))):
    for n_gpus in (8, 64):
        check_equal(f"{name} on {n_gpus} x 80 GB: needs offload or more GPUs?",
                    student.needs_offload(n_params, n_gpus, H100), lower_bound_says_offload(n_params, n_gpus, H100))

# %% [markdown]
# ## Checks 3 and 4: your layouts
# The rules, for a plan `{"dp", "tp", "pp", "zero_stage", "recompute", "offload"}`:
# `dp * tp * pp` uses every GPU; the estimator accepts it (tp divides the heads, pp the
# layers, ...); the busiest GPU needs at most 90 % of 80 GB; what is offloaded fits the CPU
# memory of the nodes. On 64 GPUs: no offload, and `tp` divides 8 (one node).

# %%
KEYS = {"dp", "tp", "pp", "zero_stage", "recompute", "offload"}


def check_plan(label, plan, n_gpus, allow_offload):
    if not isinstance(plan, dict) or set(plan) != KEYS:
        raise CheckFailed(f"{label}: return a dict with exactly the keys {sorted(KEYS)}, got {plan!r}")
    if plan["dp"] * plan["tp"] * plan["pp"] != n_gpus:
        raise CheckFailed(f"{label}: dp * tp * pp = {plan['dp'] * plan['tp'] * plan['pp']} must use all {n_gpus} GPUs")
    if not allow_offload and plan["offload"] != "none":
        raise CheckFailed(f"{label}: offload={plan['offload']!r}, but this plan must keep everything on the GPUs")
    if n_gpus > 8 and 8 % plan["tp"]:
        raise CheckFailed(f"{label}: tp={plan['tp']} must divide 8: tensor parallelism stays inside one node")
    try:
        m = estimate.per_gpu_memory(MODEL, 1, 4096, "bf16_mixed", **plan)
    except ValueError as err:
        raise CheckFailed(f"{label}: the estimator rejects this layout: {err}") from None
    parts = ", ".join(f"{k} {units.fmt_bytes(m[k])}" for k in ("params", "grads", "optimizer", "activations"))
    if m["total"] > BUDGET:
        raise CheckFailed(f"{label}: the busiest GPU needs {units.fmt_bytes(m['total'])} ({parts}), "
                          f"more than the budget of {units.fmt_bytes(BUDGET)}")
    offloaded = m["cpu_offload"] * n_gpus
    if offloaded > HOST_MEMORY * (n_gpus // 8):
        raise CheckFailed(f"{label}: {units.fmt_bytes(offloaded)} offloaded is more than the nodes' CPU memory")
    passed(f"{label}: fits")


check_plan("one node, 8 GPUs", student.plan_70b_on_8_gpus(), 8, allow_offload=True)
check_plan("8 nodes, 64 GPUs", student.plan_70b_on_64_gpus(), 64, allow_offload=False)

# %% [markdown]
# Look at what your layouts cost: which part of each GPU's memory is largest, and what you
# pay for it (offload moves 12 bytes per parameter over PCIe every step; full recomputation
# reruns each layer's forward; pipeline stages idle in their bubbles; ZeRO-3 gathers every
# layer's weights twice per step).

# %% tags=["nbval-ignore-output"]
for label, plan in (("8 GPUs", student.plan_70b_on_8_gpus()), ("64 GPUs", student.plan_70b_on_64_gpus())):
    m = estimate.per_gpu_memory(MODEL, 1, 4096, "bf16_mixed", **plan)
    print(f"{label}: {plan}\n   busiest GPU: " + ", ".join(
        f"{k} {units.fmt_bytes(m[k])}" for k in ("params", "grads", "optimizer", "activations"))
        + f" = {units.fmt_bytes(m['total'])}; offloaded per GPU {units.fmt_bytes(m['cpu_offload'])}")

# %% [markdown]
# ## Check 5: how long does it take?
# 15·10¹² tokens (Llama 3's training set) on your 64 H100s at 989 TFLOP/s bf16 dense peak and
# 40 % MFU, by 6·P·D. And for comparison the 8-GPU node.

# %%
H100_BF16 = 989e12
for n_gpus in (64, 8):
    days = student.training_days(P, 15e12, n_gpus, H100_BF16, 0.4)
    check_close(f"{n_gpus} GPUs: days to train", days,  # float64, in another order: ~1e-16 relative
                estimate.training_time(estimate.training_flops(P, 15e12), n_gpus, H100_BF16, 0.4) / 86400,
                rtol=1e-9, atol=0)
    print(f"      {n_gpus} H100s: {days:,.0f} days = {days / 365.25:.1f} years")

# %% [markdown]
# Fitting in memory is only the first question: 64 GPUs would need years. Meta trained
# Llama 3 70B on up to 16,384 H100s, which is why later notebooks combine data parallelism
# with the tensor, pipeline and ZeRO sharding you just planned.
