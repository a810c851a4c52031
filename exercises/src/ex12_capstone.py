# %% [markdown]
# # Exercise 12: choose the capstone's layout, and prove it
#
# **Goal.** An open capstone: no fixed answer, four checks. In
# `exercises/ex12_capstone/student.py`, write `choose_layout(config, cluster, global_batch, seq)`
# returning the layout you would run: a `Layout` of the model on the cluster's 8 devices.
# Here the device memory is tight on purpose (120 KiB per rank, a scaled-down version of the
# real problem), so the planner's fastest layouts do not all fit.
#
# Work it out first: list a few layouts by hand, estimate their memory and step time with
# `memory_per_rank` and `step_time`, then ask `plan` and read `.explain()`. Which constraint
# binds? **Re-read:** notebook 10, sections on the step-time model and the planner (what each
# term means, why memory binds); notebook 09 on what dp, tp and pp split; notebook 12, section 2
# (choosing a layout and saying why).
#
# **How grading works.**
#
# 1. *Runnable here:* the course's 3D trainer composes dp x tp x pp with the 1F1B schedule,
#    ZeRO 0 or 1, and recomputation of whole blocks or none; all 8 devices used; the global
#    batch is respected.
# 2. *Fits:* the estimator's memory per rank is within the device's memory.
# 3. *Runs and matches:* your layout trains 2 steps on 8 real ranks, and its losses equal the
#    single process's on the same batches (to float rounding).
# 4. *Fast:* its predicted step time is within `1 / FRACTION` of the planner's best (fitting)
#    layout, i.e. it reaches at least `FRACTION` of the best predicted throughput.
#
# A check prints `PASS  ...` or raises `CheckFailed`. Edit `student.py`, then *Kernel → Restart
# and run all*.

# %% tags=["nbval-ignore-output"]
from dataclasses import replace

from course_lib.data import CharDataset
from course_lib.estimate.planner import plan
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.estimate.validation import load_validation
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPTConfig
from course_lib.parallel.hybrid import ParallelDims, run_hybrid, train_single
from course_lib.train import TrainConfig
from course_lib.units import fmt_bytes

student = load_student("ex12_capstone")
SEQ, BATCH, FRACTION = 16, 16, 0.8
MODEL = GPTConfig(vocab_size=CharDataset("train", SEQ).vocab_size, block_size=SEQ, n_layer=2, n_head=2, d_model=16)
CLUSTER = replace(load_validation()["cluster"], memory_bytes=120 * 1024)  # 8 gloo ranks, tight memory
best = plan(MODEL, CLUSTER, BATCH, SEQ, "fp32").best
print(f"{CLUSTER.n_gpus} devices of {fmt_bytes(CLUSTER.memory_bytes)}; the planner's best: {best.layout.label()}, "
      f"{best.time['total'] * 1e3:.3g} ms")

# %% [markdown]
# ## Check 1: your layout is one the course's 3D trainer runs

# %% tags=["nbval-ignore-output"]
layout = student.choose_layout(MODEL, CLUSTER, BATCH, SEQ, "fp32")
print("your layout:", layout.label())
check_equal("all 8 devices: dp * tp * pp * ep", layout.n_gpus, CLUSTER.n_gpus)
check_equal("global batch: dp * m * micro_batch", layout.dp * layout.m * layout.micro_batch, BATCH)
check_equal("composed here: (ep, v, schedule, sequence_parallel)",
            (layout.ep, layout.v, layout.schedule, layout.sequence_parallel), (1, 1, "1f1b", False))
check_equal("ZeRO stage 0 or 1", layout.zero_stage in (0, 1), True)
check_equal("recompute 'none' or 'full' (whole blocks)", layout.recompute in ("none", "full"), True)
dims = ParallelDims(dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=layout.zero_stage, microbatches=layout.m,
                    activation_checkpointing=layout.recompute == "full")
dims.check(CLUSTER.n_gpus, MODEL, BATCH)

# %% [markdown]
# ## Check 2: it fits, by the estimator

# %% tags=["nbval-ignore-output"]
memory = memory_per_rank(MODEL, layout, SEQ, "fp32")["total"]
print(f"{fmt_bytes(memory)} per rank of {fmt_bytes(CLUSTER.memory_bytes)}")
check_equal("memory per rank <= device memory", memory <= CLUSTER.memory_bytes, True)

# %% [markdown]
# ## Check 3: it runs on 8 real ranks and matches the single process

# %%
train = TrainConfig(steps=2, batch_size=BATCH, lr=1e-2, progress=False)
ranks = run_hybrid(dims, MODEL, train, timeout_s=240)
check_close("losses of 2 steps on 8 ranks = the single process's", ranks[0].train_losses,  # fp32 summation order
            train_single(MODEL, train, activation_checkpointing=dims.activation_checkpointing).train_losses,
            rtol=0, atol=1e-4)

# %% [markdown]
# ## Check 4: it reaches the throughput asked for

# %% tags=["nbval-ignore-output"]
ratio = best.time["total"] / step_time(MODEL, layout, CLUSTER, SEQ, "fp32")["total"]
print(f"predicted throughput: {ratio:.0%} of the planner's best")
check_equal(f"at least {FRACTION:.0%} of the best predicted throughput", ratio >= FRACTION, True)
