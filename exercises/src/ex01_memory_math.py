# %% [markdown]
# # Exercise 01: memory and FLOPs arithmetic
#
# **Goal.** Put numbers on the two walls of notebook 01 yourself. Write six small functions in
# `exercises/ex01_memory_math/student.py`, using plain arithmetic:
#
# 1. `gpt_param_count(n_layer, d_model, vocab_size, block_size, tie_weights)`: the exact
#    parameter count of the course GPT.
# 2. `state_bytes_per_param(recipe, zero_stage, dp)`: bytes of parameters + gradients +
#    optimizer state one GPU holds per parameter, for a precision recipe and a ZeRO stage.
# 3. `min_gpus_zero3(n_params, recipe, gpu_bytes)`: how many GPUs ZeRO-3 needs just to hold the
#    model state.
# 4. `activation_bytes_per_layer(batch, seq, d_model, n_head)`: what one layer of the course GPT
#    saves for backward in fp32.
# 5. `training_flops(n_params, n_tokens)`: the 6·P·D rule.
# 6. `gpu_days(total_flops, peak_flops, mfu)`: how long that takes on one GPU.
#
# **How grading works.** Each check cell compares your function with `course_lib.estimate`
# (whose formulas notebook 01 holds against measurements) and prints `PASS  ...` when they agree;
# otherwise it raises `CheckFailed` with both values (or your `NotImplementedError`). The outputs
# stored in this notebook are what correct code prints. Edit `student.py`, then
# *Kernel → Restart and run all*.

# %%
from course_lib import estimate
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPTConfig

student = load_student("ex01_memory_math")

# %% [markdown]
# ## Check 1: parameter counts
# The course GPT has biases everywhere and $d_{ff} = 4d$. Three sizes: the tiny course model,
# GPT-2 small (124M) with an untied head, and GPT-3 175B.

# %%
for name, (L, d, V, T, tie) in {
    "tiny course GPT": (2, 64, 96, 64, True),
    "GPT-2 small, untied head": (12, 768, 50257, 1024, False),
    "GPT-3 175B": (96, 12288, 50257, 2048, True),
}.items():
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=4, d_model=d, tie_weights=tie)
    check_equal(f"parameters of {name}", student.gpt_param_count(L, d, V, T, tie), estimate.param_count(cfg))

# %% [markdown]
# ## Check 2: model-state bytes per parameter
# For each recipe, ZeRO stages 0-3 over 8 and 64 data-parallel GPUs.

# %%
for recipe in ("fp32", "bf16_mixed", "bf16_fp32_accum"):
    got, expected = [], []
    for dp in (8, 64):
        for stage in range(4):
            n = 1000 * dp  # divisible by dp, so the shards are exact
            got.append(student.state_bytes_per_param(recipe, stage, dp))
            expected.append(estimate.model_state_bytes(n, recipe, stage, dp)["total"] / n)
    check_close(f"{recipe}: bytes/param for ZeRO-0..3 at dp=8 and dp=64", got, expected)

# %% [markdown]
# ## Check 3: how many 80 GB GPUs does ZeRO-3 need for the model state?

# %%
def expected_min_gpus(n_params, recipe, gpu_bytes):
    dp = 1
    while estimate.model_state_bytes(n_params, recipe, 3, dp)["total"] > gpu_bytes:
        dp += 1
    return dp


for name, n_params in (("Llama-3 8B", estimate.param_count(estimate.LLAMA3_8B)),
                       ("GPT-3 175B", estimate.param_count(estimate.GPT3_175B)),
                       ("Llama-3 405B", estimate.param_count(estimate.LLAMA3_405B))):
    for recipe in ("bf16_mixed", "bf16_fp32_accum"):
        check_equal(f"{name}, {recipe}: GPUs for the ZeRO-3 state",
                    student.min_gpus_zero3(n_params, recipe, 80e9), expected_min_gpus(n_params, recipe, 80e9))

# %% [markdown]
# ## Check 4: activation bytes of one course-GPT layer (fp32)

# %%
for b, s, d, a in ((4, 64, 64, 4), (2, 128, 128, 8), (1, 2048, 12288, 96)):
    cfg = GPTConfig(vocab_size=96, block_size=s, n_layer=1, n_head=a, d_model=d)
    expected = estimate.activation_bytes(cfg, b, s, dtype_bytes=4, attention="naive")["per_layer"]
    check_equal(f"one layer, b={b} s={s} d={d} heads={a}", student.activation_bytes_per_layer(b, s, d, a), expected)

# %% [markdown]
# ## Check 5: training FLOPs and GPU-days
# GPT-3 (175e9 parameters, 300e9 tokens) and Llama-3 405B (15e12 tokens), on A100s (312 TFLOP/s
# bf16 peak) at 40 % MFU.

# %%
runs = {"GPT-3": (175e9, 300e9), "Llama-3 405B": (405.8e9, 15e12)}
for name, (p, tokens) in runs.items():
    flops = student.training_flops(p, tokens)
    check_close(f"{name}: training FLOPs", flops, estimate.training_flops(p, tokens))
    days = student.gpu_days(flops, 312e12, 0.4)
    check_close(f"{name}: GPU-days at 40% MFU", days, estimate.training_time(flops, 1, 312e12, 0.4) / 86400)
    print(f"      {name}: {days:,.0f} GPU-days = {days / 1024:.1f} days on 1024 A100s")
