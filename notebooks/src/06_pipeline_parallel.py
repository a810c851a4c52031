# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/06_pipeline_parallel.ipynb)

# %% [markdown]
# # 06 · Pipeline parallelism and its bubbles
#
# Data parallelism (notebook 03) copies the whole model to every rank. When the model does not
# fit on one device, the simplest cut is by **depth**: the first layers on one device, the
# next ones on the next, and the activations passed along. This is **pipeline parallelism**
# (PP). Its only communication is a point-to-point message of one activation (forward) or one
# gradient (backward) between neighbouring stages, which is why it is the axis that crosses
# the slow links between machines. Its cost is idle time: the **bubble**.
#
# Everything below runs real stages on real ranks (gloo processes) with real `send`/`recv`,
# and every schedule is first written down as **data** (the ordered list of actions each rank
# runs) so we can draw it before running it.
#
# **After this notebook you can**
#
# * cut a GPT into pipeline stages (blocks split as evenly as possible, embedding on the first
#   stage, head on the last, tied embeddings summed between them) and prove the pipelined
#   training equals the single-process training;
# * derive the bubble $\frac{p-1}{m+p-1}$ of GPipe and 1F1B, and $\frac{p-1}{vm+p-1}$ of the
#   interleaved schedule, and hold them against the bubble measured on real ranks;
# * explain why 1F1B bounds activation memory by $p$ micro-batches while GPipe's grows with $m$,
#   and measure both;
# * say what interleaving costs (more messages) and how splitting the backward into B and W
#   (ZB-H1) cuts the bubble to about a third at 1F1B's peak memory;
# * write a schedule as per-rank action lists and check it for missing actions and deadlocks;
# * place two chunks per rank in a V (ZB-V, DualPipeV) and weigh their bubble against their
#   memory; run PipeDream-2BW without a flush and measure what its stale update costs;
# * place PP in a 3D layout and estimate its communication with the α-β model;
# * read PyTorch's own action lists (`torch.distributed.pipelining`) and their lowered form with
#   messages and FSDP's gathers beside ours, and say where and why they differ.

# %%
# Google Colab only (elsewhere this cell does nothing): fetch the course at its pinned revision, set it up
import os, subprocess, sys
if "google.colab" in sys.modules:
    home = os.environ.get("COURSE_COLAB_HOME", "/content/course")
    if not os.path.isdir(home):
        subprocess.run(["git", "clone", "-q", os.environ.get("COURSE_COLAB_REPO", "https://github.com/OWNER/distributed-training-from-first-principles"), home], check=True)
        subprocess.run(["git", "-C", home, "checkout", "-q", "v0.1.0"], check=True)
    sys.path.insert(0, home); from course_lib.colab import arrive; arrive(home, "notebooks")

# %%
%matplotlib inline
import matplotlib.pyplot as plt
import torch

from course_lib import plot_gantt
from course_lib.comm.costmodel import CLUSTERS
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims
from course_lib.model import GPT, GPTConfig
from dataclasses import replace

from course_lib.parallel.pp import (Action, Schedule, ScheduleError, check_schedule, in_flight, make_schedule,
                                    reference_2bw, run_2bw, run_pipeline, schedule_events, simulate, split_layers,
                                    stage_of, stage_tensors)
from course_lib.parallel.pp.bubble import formula_for, measure_schedules, measured_bubble
from course_lib.parallel.pp.native import run_native, run_ours_and_native
from course_lib.parallel.pp.viz import messages_per_step, plot_schedule
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig, train_reference

DATA = CharDataset("train")
# 8 blocks so that 4 ranks x 2 chunks each get one; small enough for a laptop.
CONFIG = GPTConfig.tiny(DATA.vocab_size, n_layer=8, d_model=32, n_head=2, block_size=16)
print(f"GPT with {CONFIG.n_layer} blocks, {GPT(CONFIG).num_params():,} parameters")
# A tiny model computes in microseconds, and 4 ranks share this machine's cores. So that the
# charts show the schedule and not the operating system, every F, B and W of a micro-batch
# also waits PAD seconds, as if the model were large.
PAD = {"F": 0.02, "B": 0.02, "W": 0.02}


def simulated_bubble(name, p, m, v=1):
    """The bubble of the schedule as data, run on an idealised machine (every F, B, W of a stage
    equally long): no clock involved, so it can be asserted. The real runs' bubbles are measured
    with a clock on a shared machine: they are printed, not asserted."""
    return measured_bubble(schedule_events(make_schedule(name, p, m, v)))


def side_by_side(run, title):
    """The schedule's own chart (data) above the chart of the real run on ranks."""
    sched = make_schedule(run["schedule"], run["p"], run["m"], run["v"])
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.1 * run["p"] + 2.6))
    plot_schedule(sched, axes[0], title=f"{title}: the schedule (data)")
    plot_gantt(run["events"], ax=axes[1], title=f"{title}: the real run on {run['p']} ranks "
               f"(measured bubble {run['bubble']:.2f}, formula {run['formula']:.2f})", label_min_width=0.03)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## 1. Naive model parallelism: one device busy at a time
#
# Cut the 8 blocks into $p = 4$ **stages** of 2 blocks, one per rank. Stage 0 also embeds the
# tokens; stage 3 also holds the final norm, the head and the loss. Every stage runs the same
# GPT forward, with `nn.Identity` in place of the parts it does not own. When the block count
# does not divide, the course gives the first `n % S` stages one block more (the last already
# carries the head and the loss). Llama 3's team balanced the two ends instead: they removed
# one Transformer layer each from the first and the last stage, so that the first chunk of the
# first stage holds only the embedding and the last chunk of the last stage only the output
# projection and the loss (Dubey et al. 2024, §3.3.2); the zero-bubble authors recommend
# $kp - 2$ layers for the same reason (Qi et al.'s README, `--allow-padding-num-layers`).

# %%
for n_layer, stages in ((8, 4), (5, 2), (9, 4)):
    print(f"{n_layer} blocks on {stages} stages:", [list(r) for r in split_layers(n_layer, stages)])

# %% [markdown]
# Feed the whole batch through: rank 0 computes its forward and sends the activation to rank 1,
# which computes while rank 0 waits; the loss's gradient then travels back the same way.
# As a schedule this is every rank's list `F0 B0`, i.e. GPipe with one micro-batch:

# %%
print(make_schedule("gpipe", 4, 1).table())

# %% [markdown]
# **Predict.** With $p = 4$ stages of equal cost, what fraction of the time is each device idle?
#
# <details><summary>Answer</summary>
#
# Each rank works $t_F + t_B$ of a step that lasts $4(t_F + t_B)$: idle $\frac{p-1}{p} = 75\%$.
# </details>

# %% tags=["nbval-ignore-output"]
RUNS4 = measure_schedules(4, CONFIG, [("gpipe", 1), ("gpipe", 8), ("1f1b", 8), ("interleaved_1f1b", 8, 2),
                                      ("zero_bubble", 8), ("1f1b", 1), ("1f1b", 2), ("1f1b", 4),
                                      ("gpipe", 2), ("gpipe", 4), ("zbv", 8, 2), ("dualpipev", 8, 2)],
                            action_seconds=PAD)
BY = {(r["schedule"], r["m"]): r for r in RUNS4}
side_by_side(BY[("gpipe", 1)], "naive model parallel")
assert abs(simulated_bubble("gpipe", 4, 1) - 0.75) < 1e-12  # the schedule itself: 3/4 up to float64 rounding

# %% [markdown]
# The grey gaps are the **bubble**; red bars are the receives, which include the waiting.
# Splitting the model made it *fit*, but only one device works at a time.
#
# ## 2. GPipe: micro-batches, and the bubble formula
#
# GPipe (Huang et al. 2019) cuts the batch into $m$ **micro-batches**: while stage 1 works on
# micro-batch 0, stage 0 already computes micro-batch 1. Every rank runs all forwards, then
# all backwards. The gradients of the micro-batch losses $L_j / m$ add up to the gradient of
# the batch's mean loss, so the result is exactly gradient accumulation (notebook 04).
#
# **The bubble.** Let a stage take $t_F$ and $t_B$ per micro-batch. The first micro-batch
# reaches the last stage after $(p-1)t_F$; the last gradient leaves stage 0 only $(p-1)t_B$
# after the last stage's final backward. Each rank is busy $m(t_F+t_B)$ in a step of
# $(m+p-1)(t_F+t_B)$, so
#
# $$\text{bubble} = \frac{(p-1)(t_F+t_B)}{(m+p-1)(t_F+t_B)} = \frac{p-1}{m+p-1}.$$
#
# **Predict.** $p = 4$, $m = 8$: the bubble?
#
# <details><summary>Answer</summary>
#
# $3/11 \approx 0.27$. It falls with $m$: $m = 4p$ gives $\frac{p-1}{5p-1}$, under 16% for
# $p \le 4$ ($3/19$ at $p = 4$) but $7/39 \approx 17.9\%$ at $p = 8$: under 20% for any $p$.
# </details>

# %%
print(make_schedule("gpipe", 4, 8).table())
print(f"formula: {formula_for('gpipe', 4, 8):.3f}")

# %% tags=["nbval-ignore-output"]
side_by_side(BY[("gpipe", 8)], "GPipe, m = 8")
assert abs(simulated_bubble("gpipe", 4, 8) - formula_for("gpipe", 4, 8)) < 1e-12  # float64 rounding only

# %% [markdown]
# ## 3. Is it still the same training?
#
# The schedule changes *when* things are computed, never *what*. Every schedule below trains
# 3 AdamW steps on 4 ranks from the same seed and batches as the single-process GPT: the
# losses and the parameters (gathered from the stages by name) must agree up to float
# rounding. The parameters are compared in RMS, against a hundredth of one AdamW step: the
# micro-batches add up the gradient in another order, and AdamW magnifies that rounding where
# a gradient is near zero, enough to move a single parameter by a visible fraction of lr
# (notebook 04). The model has tied input/output embeddings: stage 0 and stage 3 each hold a
# copy and sum their two halves of its gradient after the backward, as Megatron does.

# %%
TC = TrainConfig(steps=3, batch_size=8, grad_clip=1.0, eval_every=10**6, eval_batches=1, progress=False)
ref = train_reference(CONFIG, TC)
ref_params = dict(ref.model.named_parameters())
OURS = {}  # kept for section 8
for schedule, m, v in (("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 4, 2), ("zero_bubble", 4, 1)):
    dims = ParallelDims(pp=4, schedule=schedule, microbatches=m, virtual_stages=v)
    results = OURS[schedule] = run_pipeline(dims, CONFIG, TC)
    params = stage_tensors(results)
    diff = torch.cat([(params[k] - ref_params[k].detach()).flatten() for k in ref_params])
    loss_gap = max(abs(a - b) for a, b in zip(results[0].train_losses, ref.train_losses))
    # losses: fp32 sums in another order (~1e-7 apart); parameters: RMS against lr/100 (above)
    assert diff.pow(2).mean().sqrt() < TC.lr / 100 and loss_gap < 1e-5
    print(f"{schedule:>17}: all {len(params)} parameters within lr/100 of the single process in RMS, "
          f"losses within 1e-5 over {TC.steps} steps")

# %% [markdown]
# ## 4. The bubble, measured against the formula
#
# **Predict.** For $p = 2$, how many micro-batches does it take to bring the bubble under 10%?
# And for $p = 4$?
#
# <details><summary>Answer</summary>
#
# $\frac{p-1}{m+p-1} < 0.1 \iff m > 9(p-1)$: $m \ge 10$ for $p = 2$, $m \ge 28$ for $p = 4$.
# </details>

# %% tags=["nbval-ignore-output"]
RUNS2 = measure_schedules(2, CONFIG, [("1f1b", m) for m in (1, 2, 4, 8)], action_seconds=PAD)
ms = [1, 2, 4, 8]
fig, ax = plt.subplots(figsize=(6.5, 3.6))
for p, runs, color in ((2, RUNS2, "tab:blue"), (4, [BY[("1f1b", m)] for m in ms], "tab:orange")):
    ax.plot(ms, [formula_for("1f1b", p, m) for m in ms], "-", color=color, label=f"(p-1)/(m+p-1), p={p}")
    ax.plot(ms, [r["bubble"] for r in runs], "o", color=color, label=f"measured, p={p}")
    for m in ms:  # the formula is the schedule's own bubble (float64 rounding only); the points are measured
        assert abs(simulated_bubble("1f1b", p, m) - formula_for("1f1b", p, m)) < 1e-12
ax.set_xscale("log", base=2)
ax.set_xlabel("micro-batches m")
ax.set_ylabel("bubble (idle fraction)")
ax.set_title("1F1B on real ranks: measured bubble vs formula")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The cell asserts the formula on the schedules themselves (simulated with equal stage times);
# the points are measured with a clock, on a machine shared with other work. Where a point
# sits above the formula, the extra is time the formula does not count: a real rank also
# spends time receiving, sending and in Python between actions, which the chart counts as
# idle. A real model makes these relatively smaller.
#
# ## 5. 1F1B: the same bubble, bounded memory
#
# GPipe keeps the activations of **all** $m$ micro-batches until their backwards start, so its
# activation memory grows with $m$, exactly the lever that shrinks the bubble. **1F1B**
# starts each micro-batch's backward as early as possible: a few warm-up forwards, then one
# forward and one backward in turn, then a drain of the backwards still owed. PipeDream
# (Narayanan et al. 2019) introduced the one-forward-one-backward order for asynchronous
# training; its synchronous form, flushed at the end of every step so that the update equals
# the single-process one, is DAPPLE's early-backward schedule (Fan et al. 2021) and Megatron's
# PipeDream-Flush (Narayanan et al. 2021). A micro-batch's activations are freed by its
# backward, so what a rank holds is bounded by its warm-up, whatever $m$: the counts below.
# The bubble is unchanged: the same fill and drain. (How many warm-up forwards each rank
# needs, and why, is exercise 06: the chart shows the shape of the answer.)

# %%
for name in ("gpipe", "1f1b"):
    print(f"{name:>5}: micro-batches in flight per rank, m = 8: {in_flight(make_schedule(name, 4, 8))}")

# %% tags=["nbval-ignore-output"]
side_by_side(BY[("1f1b", 8)], "1F1B, m = 8")

# %% [markdown]
# **Predict.** Rank 0, micro-batches of 2 sequences: GPipe with $m = 8$ against 1F1B with $m = 8$:
# how many times more activation memory does GPipe hold?
#
# <details><summary>Answer</summary>
#
# Rank 0 holds $m = 8$ micro-batches under GPipe and $p = 4$ under 1F1B: twice as much.
# </details>
#
# The runs above also measured each rank's peak of saved activations (the tensors autograd
# keeps for backward, counted through saved-tensor hooks):

# %%
one = BY[("gpipe", 1)]["peak_bytes"]  # one micro-batch's activations on each stage
fig, ax = plt.subplots(figsize=(6.5, 3.4))
for name, color in (("gpipe", "tab:blue"), ("1f1b", "tab:orange")):
    peaks = [BY[(name, m)]["peak_bytes"][0] / 2**10 for m in (1, 2, 4, 8)]
    ax.plot([1, 2, 4, 8], peaks, "o-", color=color, label=f"{name}, rank 0")
    for m in (1, 2, 4, 8):
        assert BY[(name, m)]["peak_bytes"] == [k * b for k, b in zip(in_flight(make_schedule(name, 4, m)), one)]
ax.set_xscale("log", base=2)
ax.set_xlabel("micro-batches m (2 sequences each)")
ax.set_ylabel("peak saved activations (KiB)")
ax.set_title("GPipe grows with m; 1F1B stops at p micro-batches")
ax.legend()
plt.show()
for key in (("gpipe", 8), ("1f1b", 8), ("interleaved_1f1b", 8), ("zero_bubble", 8)):
    print(f"{key[0]:>17}, m = 8: peak per rank (KiB)", [round(b / 2**10) for b in BY[key]["peak_bytes"]])

# %% [markdown]
# Under GPipe and 1F1B every measured peak equals (micro-batches in flight, from the schedule's
# data) × (one micro-batch's activations on that stage), for every rank and every $m$ (the cell
# asserts it). The last stage's micro-batch is larger: it also keeps the logits for the loss.
#
# ## 6. Interleaving: a smaller bubble for more messages
#
# Megatron's **interleaved 1F1B** (Narayanan et al. 2021) gives each rank $v$ non-adjacent
# chunks: with $p = 4$, $v = 2$, rank 0 holds stages 0 and 4, rank 1 stages 1 and 5, and so on.
# A chunk's work is $1/v$ of a stage's, so the fill and drain shrink to $(p-1)/v$ stage-times:
#
# $$\text{bubble} = \frac{p-1}{vm + p-1}.$$
#
# The price: a micro-batch now crosses $pv - 1$ stage boundaries instead of $p - 1$, so there
# are about $v$ times as many messages, and each rank holds more chunks in flight.
#
# Micro-batches pass through each chunk in groups of $N$ consecutive ones before the rank turns
# to its next chunk. The course, like the original schedule, takes $N = p$, and so refuses an $m$
# that is not a multiple of $p$ (below); so did Megatron-LM for years ("number of microbatches is
# not divisible by pipeline-model-parallel-size when using interleaved schedule"). Megatron-Core
# now makes $N$ a setting, `microbatch_group_size_per_vp_stage` (default $p$, allowed from $p$ to
# $m$), and asks only that the last group be full or hold at least $p$ micro-batches
# ($m \bmod N = 0$ or $\ge p$; a shorter one leaves stages waiting on each other), in
# `megatron/core/pipeline_parallel/schedules.py`. Llama 3's team made the same change to run any
# number of micro-batches, $N = 5$ in their Figure 6 (Dubey et al. 2024, §3.3.2).

# %%
print(make_schedule("interleaved_1f1b", 4, 8, 2).table())
for v in (1, 2, 4):
    print(f"v = {v}: bubble {formula_for('interleaved_1f1b', 4, 8, v):.3f}, {messages_per_step(4, 8, v)} messages per step")
try:
    make_schedule("interleaved_1f1b", 4, 6, 2)
except ValueError as err:
    print("refused:", err)

# %% tags=["nbval-ignore-output"]
run = BY[("interleaved_1f1b", 8)]
side_by_side(run, "interleaved 1F1B, m = 8, v = 2")
sends = sum(1 for events in run["events"] for e in events if e[0].startswith("send"))
assert sends == messages_per_step(4, 8, 2)
print(f"send events in the real run: {sends} = 2 m (pv - 1)")
assert simulated_bubble("interleaved_1f1b", 4, 8, 2) < simulated_bubble("1f1b", 4, 8)  # the schedules themselves
print(f"measured bubble: interleaved {run['bubble']:.2f}, 1F1B {BY[('1f1b', 8)]['bubble']:.2f} "
      f"(formulas {formula_for('interleaved_1f1b', 4, 8, 2):.2f} and {formula_for('1f1b', 4, 8):.2f})")

# %% [markdown]
# ## 7. Zero bubble: split the backward
#
# A layer's backward computes two things: the gradient of its **input** (B), which the previous
# stage is waiting for, and the gradient of its **weights** (W), which nobody waits for until
# the optimizer step. Qi et al. (2023) split them, so that B can travel back up the pipeline
# at once and the W's can be moved into time that would otherwise be idle. Here every
# `nn.Linear` computes only $dY\,W$ in B and stashes $(X, dY)$; W adds $dY^\top X$ to the
# weight's gradient.
#
# Their memory-efficient schedule **ZB-H1** (§2.1) keeps 1F1B's order of F and B, so each rank
# holds as many whole graphs as under 1F1B, and moves only the W's: the fewer warm-up
# forwards a rank has, the later its W's start. Rank $r$ keeps up to $r$ W's waiting (rank 0
# none, the last rank $p-1$), and runs the waiting ones at the end, where 1F1B's drain leaves
# it idle. So no rank ever has more than $p$ micro-batches whose W has not run: $p - r$ whole
# graphs plus $r$ stashes, and a stash (inputs and output gradients of the Linears) is smaller
# than a graph. Their Table 2, in the time of one micro-batch's F, B and W on one stage
# ($T_F$, $T_B$, $T_W$) and the activation memory $M_B$ one micro-batch holds until its B:
#
# | schedule | bubble (idle time per rank) | peak activation memory |
# |---|---|---|
# | 1F1B | $(p-1)(T_F+T_B+T_W)$ | $p\,M_B$ |
# | ZB-H1 | $(p-1)(T_F+T_B-T_W)$ | $p\,M_B$ |
#
# With $T_F = T_B = T_W$ a step lasts $3m$ actions plus the idle time, so ZB-H1's bubble is
# $\frac{p-1}{3m+p-1}$ ($m \ge p$), about a third of 1F1B's. Their **ZB-H2** runs more warm-up
# forwards, up to a peak of $(2p-1)\,M_B$, and fills every gap: its row of Table 2 is
# $(p-1)(T_F+T_B-2T_W)$, zero at equal times (not run here). That zero, like ZB-V's in section 9,
# also takes a change at the end of the step that the course's schedules do not make
# (**post-validation**, at the end of this section). Below, how many whole graphs each rank holds:

# %%
zb, ref_1f1b = make_schedule("zero_bubble", 4, 8), make_schedule("1f1b", 4, 8)
print("whole graphs held per rank (F done, B not yet):", in_flight(zb), "   1F1B:", in_flight(ref_1f1b))
print("micro-batches whose W has not run, per rank:  ", in_flight(zb, until="W"))


def idle_per_rank(sched, t_f, t_b, t_w):
    ranks = simulate(sched, t_f, t_b, t_w)
    span = max(e for rank in ranks for *_, e in rank) - min(s for rank in ranks for _, s, _ in rank)
    return [span - sum(e - s for _, s, e in rank) for rank in ranks]


for t_f, t_b, t_w in ((1, 1, 1), (1, 2, 1), (1, 1.5, 0.5)):
    row = []
    for sched, table2 in ((ref_1f1b, 3 * (t_f + t_b + t_w)), (zb, 3 * (t_f + t_b - t_w))):
        idle = idle_per_rank(sched, t_f, t_b, t_w)
        assert all(abs(i - table2) < 1e-9 for i in idle)  # sums of binary fractions: float64 rounding only
        row.append(f"{sched.name} {idle[0]:g}")
    print(f"T_F, T_B, T_W = {t_f}, {t_b}, {t_w}: idle time on every rank: " + ", ".join(row))
print(f"bubble at equal times: {formula_for('zero_bubble', 4, 8):.3f} (1F1B: {formula_for('1f1b', 4, 8):.3f})")

# %% [markdown]
# **Predict.** Against 1F1B with the same $p = 4$, $m = 8$: whose measured peak of saved
# activations stays exactly the same under ZB-H1, and whose grows?
#
# <details><summary>Answer</summary>
#
# Rank 0 defers no W: its peak is 1F1B's, to the byte. Rank $r > 0$ adds up to $r$ stashes to
# its $p - r$ graphs, so it holds more than under 1F1B, but never more than $p$ micro-batches
# of its own stage, which is what 1F1B's peak is ($p\,M_B$, on rank 0).
# </details>

# %%
one = BY[("gpipe", 1)]["peak_bytes"]  # one micro-batch's graph on each stage (M_B of that stage)
zb_peak, ref_peak = BY[("zero_bubble", 8)]["peak_bytes"], BY[("1f1b", 8)]["peak_bytes"]
assert zb_peak[0] == ref_peak[0] == 4 * one[0]  # rank 0 defers no W
for r in range(4):  # p - r graphs plus r stashes, each smaller than a graph: at most p graphs of the stage
    assert ref_peak[r] <= zb_peak[r] <= 4 * one[r]
    print(f"rank {r}: ZB-H1 {zb_peak[r] / 2**10:5.0f} KiB, 1F1B {ref_peak[r] / 2**10:5.0f} KiB, "
          f"p x one micro-batch of this stage {4 * one[r] / 2**10:5.0f} KiB")

# %% [markdown]
# Every rank stays within $p\,M_B$ of its own stage, and rank 0, the one 1F1B loads most, is
# unchanged. The paper's $p\,M_B$ assumes equal stages; here the last stage's micro-batch also
# keeps the logits (and its stash their gradient), which is why its bound is the largest.

# %% tags=["nbval-ignore-output"]
side_by_side(BY[("zero_bubble", 8)], "ZB-H1, m = 8")
assert abs(simulated_bubble("zero_bubble", 4, 8) - formula_for("zero_bubble", 4, 8)) < 1e-12  # float64 rounding
zb_run, f1b_run = BY[("zero_bubble", 8)], BY[("1f1b", 8)]
print(f"measured bubble: ZB-H1 {zb_run['bubble']:.2f} (formula {zb_run['formula']:.2f}), "
      f"1F1B {f1b_run['bubble']:.2f} (formula {f1b_run['formula']:.2f})")

# %% [markdown]
# The formula assumes $T_F = T_B = T_W$ and nothing between the actions. On this CPU neither
# holds. W is replayed by Python after autograd has finished: one matrix product and one sum
# per stashed Linear, each a separate call with a fixed cost that a tiny model cannot hide, so
# the W's are not the equal third of the work the schedule was laid out for. And every action
# pays the runner's fixed cost between the timed spans (posting receives, sending, bookkeeping),
# which the chart counts as idle; ZB-H1 runs $3m$ actions per rank where 1F1B runs $2m$, so it
# pays that more often. Both costs shrink relative to the work as the model grows, which is
# where the paper measures its gains.
#
# **The end of the step: post-validation.** Every schedule in this notebook ends its step with a
# synchronisation across the stages: the clip at norm 1 of section 3 needs the global gradient
# norm, a sum over every stage's gradients (in mixed precision, so does the check for inf and
# NaN), so no stage may update its weights before the slowest stage's last W, and the next
# step's first forward waits for that update. Rank $r$ starts its first action $r$ time units
# after rank 0 (the warm-up stagger) and the ranks finish at different times too; with a
# synchronous end of step that stagger is idle time, and it is what remains of ZB-H2's bubble
# and nearly all of ZB-V's (section 9). Qi et al. (2023, §4) remove the synchronisation. Each
# stage steps its optimizer as soon as its own W's are done, *assuming* that no clip is needed
# and no gradient is inf or NaN, and the assumption is checked afterwards, against the global
# state reduced from all stages: that is **post-validation**. When the check fails (the norm is
# above the clip, or a value is not finite), every stage rolls back: it restores its weights
# and optimizer state from before the step and redoes the step with the clipped gradients, or
# skips it. In stable training clipping and overflow are rare, so rollbacks are too; the
# authors' README reports about 8% less throughput without it. With it, rank $r$ starts the next
# step's forwards right after its own last W, each step's chart is a parallelogram that fits
# into the next one's, and the stagger stops being idle. The course keeps the synchronous end
# of step, so every bubble it computes or measures counts the stagger.
#
# ## 8. The same stages in PyTorch
#
# `torch.distributed.pipelining` ships the same schedules. Wrapping our stage chunks in its
# `PipelineStage` and driving them with `ScheduleGPipe`, `Schedule1F1B` and
# `ScheduleInterleaved1F1B` trains to the same losses as our runs of section 3. (Its zero-bubble
# schedules for two chunks per rank, `ScheduleZBVZeroBubble` and `ScheduleDualPipeV`, are
# compared with ours in section 9.)

# %%
for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
    theirs = run_native(ParallelDims(pp=4, schedule=schedule, microbatches=4, virtual_stages=v), CONFIG, TC)
    gap = max(abs(a - b) for a, b in zip(OURS[schedule][0].train_losses, theirs[0].train_losses))
    assert gap < 1e-5  # the same sums in another order: fp32 rounding (~1e-7 on a loss of ~4)
    print(f"{schedule:>17}: torch.distributed.pipelining's losses within 1e-5 of ours over {TC.steps} steps")

# %% [markdown]
# ## 9. Two chunks in a V: ZB-V and DualPipeV
#
# Interleaving (section 6) gives rank $r$ the stages $r, r+p, \dots$: a loop. Qi et al. (2024)
# place exactly two chunks per rank in a **V**: rank $r$ holds stage $r$ on the way down and
# stage $2p-1-r$ on the way back. Rank 0 then holds the first and the last stage, so the
# embedding and the loss sit on one rank (a tied embedding needs no exchange), and the turn
# from stage $p-1$ to stage $p$ never leaves rank $p-1$. With the B/W split of section 7 their
# **ZB-V** schedule fills the pipeline at 1F1B's peak memory.
#
# DeepSeek's DualPipe (DeepSeek-AI 2024, §3.2.1) feeds micro-batches in from both ends of the
# pipeline, so every stage sits on two ranks and the parameters are held twice. **DualPipeV**
# runs on the V instead: Qi, Wan, Huang and Lin (Sea AI Lab, 2025) noticed that DualPipe's ranks
# come in mirrored pairs with the same stages and the same schedule, kept one half of the ranks
# and grafted the other direction's micro-batches onto them ("cut in half"); DeepSeek's DualPipe
# README gives the result as DualPipeV and credits them. Its mark is the steady state: each rank
# runs the forward of one micro-batch together with the backward of another as one unit
# (`F7&B0.1` in the lists below, a whole backward whose W follows at once), so that on GPUs the
# communication of one (the experts' all-to-all of notebook 07, the pipeline's messages) hides
# behind the compute of the other. It holds one micro-batch more than ZB-V, as DeepSeek's
# Table 2 says of DualPipe ($PP + 1$).
#
# The course's DualPipeV is a simplified variant of torch's `ScheduleDualPipeV`. Torch writes
# the order out phase by phase: warm-up forwards, a stretch where B and W are split as in
# ZB-V, the steady F&B pairs, then a cool-down whose second half splits B from W again. The
# course's comes from ZB-V's list scheduler with one rule added: when an F and a B of another
# micro-batch can both start, they go together as a pair and that B runs whole. Both train to
# the same numbers (the cell at the end of this section; section 14 puts the two lists side by
# side). Our ranks are single-threaded CPU
# processes: a pair runs F, then B, and nothing overlaps. The simulator starts a pair when both
# halves can start and times it as $t_F + t_B$, so on its ideal clock (equal times, free
# messages) the pairs gain nothing and DualPipeV ties with ZB-V; off that clock the two differ
# (below).

# %%
P, M = 4, 8
print("V:           stages of each rank", [[stage_of("v", P, r, c) for c in (0, 1)] for r in range(P)])
print("interleaved: stages of each rank", [[stage_of("loop", P, r, c) for c in (0, 1)] for r in range(P)])
ZBV, DUAL = make_schedule("zbv", P, M, 2), make_schedule("dualpipev", P, M, 2)
print("\nZB-V, rank 0:     ", ZBV.table().splitlines()[0][8:])
print("DualPipeV, rank 0:", DUAL.table().splitlines()[0][8:])

# %% [markdown]
# Rank 0 opens ZB-V with $2p - 1 = 7$ forwards of its first chunk, the warm-up of Qi et al.'s
# drawing, and then runs F, B and W of the last stage in turn (`F0.1 B0.1 W0.1`): micro-batch 0
# has come down the V and back up to rank 0 by then.
#
# **Predict.** $p = 4$, $m = 8$, every F, B and W of one chunk equally long. ZB-H1's bubble is
# $\frac{p-1}{3m+p-1} = 0.111$. Is ZB-V's smaller or larger, and how many chunks whose W has not
# run does a rank hold at most, against 1F1B's $p$ micro-batches?
#
# <details><summary>Answer</summary>
#
# Smaller: a rank's chunk is half a stage, so its fill and drain cost $p - 1$ chunk-times, half
# of ZB-H1's $p - 1$ stage-times, in a step of $6m$ chunk-times of work:
# $\frac{p-1}{6m+p-1} = \frac{3}{51} \approx 0.059$. At most $2p = 8$ chunks: $p$ micro-batches
# of both chunks, 1F1B's peak. DualPipeV: the same bubble here, one micro-batch (2 chunks) more.
# </details>

# %%
fig, axes = plt.subplots(2, 1, figsize=(10, 5.2))
for ax, sched in zip(axes, (ZBV, DUAL)):
    plot_schedule(sched, ax, title=f"{sched.name}: p={P}, m={M}, 2 chunks per rank in a V (the schedule as data)")
fig.tight_layout()
plt.show()
for sched in (ZB_LOOP := make_schedule("zero_bubble", P, M), ZBV, DUAL):
    sim = simulated_bubble(sched.name, P, M, sched.virtual_stages)
    assert abs(sim - formula_for(sched.name, P, M)) < 1e-12  # ratio of tick counts: float64 rounding only
    unit = "micro-batches" if sched.virtual_stages == 1 else "chunks"
    print(f"{sched.name:>11}: bubble {sim:.3f}, at most {max(in_flight(sched, until='W'))} {unit} "
          f"whose W has not run per rank")

# %% [markdown]
# **Where the idle time sits.** Each rank's idle chunk-times in that simulation, split into the
# **stagger** (before the rank's first action and after its last, within the step) and the
# **gaps** between its actions:

# %%
def idle_split(sched):
    """Per rank (stagger, gaps) in chunk-times, from the simulation at equal times."""
    sim, chunk = simulate(sched), 1 / sched.virtual_stages
    span = max(rank[-1][2] for rank in sim) - min(rank[0][1] for rank in sim)
    out = []
    for rank in sim:
        first, last, busy = rank[0][1], rank[-1][2], sum(end - start for _, start, end in rank)
        out.append(((span - (last - first)) / chunk, (last - first - busy) / chunk))
    return out


for sched in (ZBV, DUAL):
    split = idle_split(sched)
    print(f"{sched.name:>9}: " + ", ".join(f"rank {r} stagger {a:g} gaps {g:g}" for r, (a, g) in enumerate(split)))
    assert all(abs(a + g - (P - 1)) < 1e-12 for a, g in split)  # p - 1 idle chunk-times per rank (float64 sums)
gap_total = {sched.name: sum(g for _, g in idle_split(sched)) for sched in (ZBV, DUAL)}
print(f"gaps between actions, all ranks: ZB-V {gap_total['zbv']:g} chunk-time(s) of {P * (P - 1)} idle, "
      f"DualPipeV {gap_total['dualpipev']:g}")

# %% [markdown]
# So the course's $\frac{p-1}{6m+p-1}$ is, nearly all of it, the warm-up stagger that a
# synchronous end of step leaves idle. Qi et al. call ZB-V zero-bubble (their README's table,
# at $T_F = T_B = T_W$; Qi et al. 2024) because they end the step with post-validation
# (section 7): rank $r$'s next step starts right after its own last action, and the stagger
# becomes work. Both statements hold; they count the end of the step differently.
#
# **Off the ideal clock.** On the simulator's clock the pairs gain nothing and the two V
# schedules tie. Let messages cost time, or W take longer or shorter than F and B (on this CPU
# both happen: section 7), and the same lists give:

# %%
CLOCKS = [("equal times, free messages", {}), ("a message costs 0.1", dict(t_comm=0.1)),
          ("W takes half as long", dict(t_weight=0.5)), ("W takes twice as long", dict(t_weight=2.0))]
for label, times in CLOCKS:
    z, d = (measured_bubble(schedule_events(s, **times)) for s in (ZBV, DUAL))
    print(f"{label:>27}: ZB-V {z:.3f}, DualPipeV {d:.3f}")
    assert d <= z + 1e-12  # the simulated schedules themselves (float64 rounding only)

# %% [markdown]
# DualPipeV never does worse here and usually better: it may hold one micro-batch more (two
# chunks), slack that lets a rank run ahead while a message or a long W holds up a neighbour.
# ZB-V's lists were laid out for the ideal clock, and any departure from it opens gaps that
# ZB-V's tighter memory cap cannot fill. The pairing itself buys nothing on one CPU thread.
#
# ZB-V's lists on the 4 real ranks (they ran in the first measurement of this notebook;
# DualPipeV's run is in the figure after it):

# %% tags=["nbval-ignore-output"]
side_by_side(BY[("zbv", 8)], "ZB-V, m = 8")

# %% [markdown]
# **One figure: bubble against memory.** The five synchronous schedules at $p = 4$, $m = 8$:
# the bubble of each schedule's formula (checked on its simulation above and in section 4)
# next to the bubble measured on the real ranks, and each rank's measured peak of saved
# activations (graphs until B, stashes until W).

# %% tags=["nbval-ignore-output"]
FIVE = [("1f1b", "1F1B"), ("interleaved_1f1b", "interleaved v=2"), ("zero_bubble", "ZB-H1"),
        ("zbv", "ZB-V"), ("dualpipev", "DualPipeV")]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
xs = range(len(FIVE))
ax1.bar([x - 0.2 for x in xs], [BY[(s, 8)]["formula"] for s, _ in FIVE], 0.4, label="formula")
ax1.bar([x + 0.2 for x in xs], [BY[(s, 8)]["bubble"] for s, _ in FIVE], 0.4, label="measured")
ax1.set_xticks(list(xs), [n for _, n in FIVE], fontsize=8)
ax1.set_ylabel("bubble (idle fraction)")
ax1.legend(fontsize=8)
for r in range(4):
    ax2.bar([x + (r - 1.5) * 0.2 for x in xs], [BY[(s, 8)]["peak_bytes"][r] / 2**10 for s, _ in FIVE], 0.2,
            label=f"rank {r}")
ax2.set_xticks(list(xs), [n for _, n in FIVE], fontsize=8)
ax2.set_ylabel("peak saved activations (KiB)")
ax2.legend(fontsize=8)
fig.suptitle(f"p = 4, m = 8 on real ranks: the bubble and the memory it costs")
fig.tight_layout()
plt.show()
for s, n in FIVE:
    run = BY[(s, 8)]
    print(f"{n:>15}: bubble measured {run['bubble']:.2f} (formula {run['formula']:.3f}), peak per rank "
          + " ".join(f"{b / 2**10:.0f}" for b in run["peak_bytes"]) + " KiB")
z_run, d_run = BY[("zbv", 8)]["bubble"], BY[("dualpipev", 8)]["bubble"]
print(f"measured on this run: DualPipeV {d_run:.2f} is {'below' if d_run < z_run else 'not below'} ZB-V {z_run:.2f} "
      f"(formulas: both {formula_for('zbv', 4, 8):.3f})")

# %% [markdown]
# The formulas order the schedules: 1F1B, then interleaving, ZB-H1 and the V schedules. The
# measured bubbles carry the costs the formula does not count (section 7): every action pays the
# runner's fixed cost, and the V schedules run $6m$ actions per rank where 1F1B runs $2m$. Those
# costs take the real ranks off the ideal clock, as in section 9's simulation: the fixed cost
# per action acts like a message that costs time, and a W is not a third of the work. That is
# where DualPipeV's extra micro-batch in flight can put it below ZB-V (the last line says
# whether it did on this run) although the formulas tie. The
# memory panel is the price: interleaving and the V keep more activations in flight than 1F1B's
# $p - r$ on rank $r$, and the V puts the loss's logits on rank 0 beside its $2p - 1$ warm-up
# forwards.
#
# Are they still the same training, and the same as PyTorch's? Each V schedule trained for 3
# steps on the 4 ranks, ours and torch's `ScheduleZBVZeroBubble` / `ScheduleDualPipeV` on the
# same stages, against the single process of section 3 (DualPipeV needs $m \ge 2p$ micro-batches,
# as torch's does):

# %%
for schedule, m_v in (("zbv", 4), ("dualpipev", 8)):
    dims = ParallelDims(pp=4, schedule=schedule, microbatches=m_v, virtual_stages=2)
    ours, theirs = run_ours_and_native(dims, CONFIG, TC)  # both on the same 4 ranks, in turn
    for who, results in (("ours", ours), ("torch", theirs)):
        params = stage_tensors(results)
        diff = torch.cat([(params[k] - ref_params[k].detach()).flatten() for k in ref_params])
        loss_gap = max(abs(a - b) for a, b in zip(results[0].train_losses, ref.train_losses))
        assert diff.pow(2).mean().sqrt() < TC.lr / 100 and loss_gap < 1e-5  # as in section 3
    print(f"{schedule:>9}: ours and torch's both within lr/100 of the single process in RMS, losses within 1e-5")

# %% [markdown]
# ## 10. No flush at all: PipeDream-2BW
#
# Every schedule so far is **synchronous**: a step's backwards all finish before the optimizer
# runs, and the next step's first forward waits for it. That flush is where the bubble comes
# from. PipeDream (Narayanan et al. 2019) drops it: the next step's forwards start while the
# last step's backwards still drain. A micro-batch must then run its backward with the weights
# its forward used (**weight stashing**), and different stages would see different weights.
# PipeDream-2BW (Narayanan et al. 2021) makes it consistent with one rule for every stage:
#
# * every micro-batch of batch $t$ runs with the weights $W_{t-1}$ (batch 0 with $W_0$);
# * a stage updates on its own when batch $t$'s last backward has run on it:
#   $W_{t+1} = W_t - \text{lr}\cdot\nabla f_t(W_{t-1})$ with SGD (here AdamW is applied to the
#   same one-step-old gradient).
#
# With $m \ge p$ micro-batches per batch a stage needs only two versions: $W_{t-1}$ for the
# batch in flight and $W_t$ for the next. The reference to compare with is no longer
# ordinary training but the same delayed update computed in one process.
#
# **Predict.** $p = 4$ stages, $m = 4$. With which weights do batches 0, 1, 2 and 3 run?
# And is the loss after 6 steps higher or lower than synchronous training's?
#
# <details><summary>Answer</summary>
#
# $W_0, W_0, W_1, W_2$: each batch sees the weights of one update fewer than synchronous
# training would give it. Usually higher: every update follows a gradient one step old. Early
# in training, where the gradient changes fastest, the delay costs most (the paper's
# experiments find the final accuracy unchanged at scale).
# </details>

# %% tags=["nbval-ignore-output"]
UNTIED = replace(CONFIG, tie_weights=False)  # 2BW's rules: no tied head across stages, no global clip
TC6 = replace(TC, steps=6, grad_clip=0.0)
two_bw = run_2bw(ParallelDims(pp=4, schedule="pipedream_2bw", microbatches=4), UNTIED, TC6)
delayed, sync = reference_2bw(UNTIED, TC6, 4), train_reference(UNTIED, TC6)
for t in range(TC6.steps):
    print(f"step {t + 1}: 2BW {two_bw[0].train_losses[t]:.4f} (weights W_{two_bw[0].version_used[t]})   "
          f"delayed single process {delayed.train_losses[t]:.4f}   synchronous {sync.train_losses[t]:.4f}")
gap = max(abs(a - b) for a, b in zip(two_bw[0].train_losses, delayed.train_losses))
assert gap < adamw_loss_atol(TC6.lr)  # fp32 sums in another order, magnified by 6 AdamW steps (notebook 04)
stale_cost = two_bw[0].train_losses[-1] - sync.train_losses[-1]
print(f"\n2BW equals its delayed single process (largest gap {gap:.1e}); after {TC6.steps} steps its loss is "
      f"{stale_cost:+.3f} against synchronous training: the price of the stale gradient")

# %%
for r, res in enumerate(two_bw):
    at_updates = [res.versions_held[i] for i in range(len(res.versions_held))
                  if i == 0 or res.versions_held[i] != res.versions_held[i - 1]]
    assert max(len(v) for v in res.versions_held) <= 2
    print(f"stage {r}: weight versions held over the run {at_updates}; one version "
          f"{res.version_bytes / 2**10:.0f} KiB")
print(f"bubble: once per run {formula_for('pipedream_2bw', 4, 4, steps=TC6.steps):.3f} "
      f"against 1F1B's every step {formula_for('1f1b', 4, 4):.3f}")

# %% [markdown]
# Each stage holds two versions at a time, and moves on by one at each of its updates: the
# memory 2BW pays is one more copy of the stage's weights (printed above per stage; on a large
# model, as many bytes again as the stage's weights), in exchange for a bubble paid once per run instead of
# once per step. The price is the staleness, measured above against synchronous training on
# the same batches.

# %% [markdown]
# ## 11. Explore the schedules
#
# Pick the schedule, the number of ranks $p$, micro-batches $m$ and chunks $v$. The chart is the
# schedule's data with unit times; the caption gives its bubble, the micro-batches in flight
# per rank (the activation memory) and the messages per step.

# %%
from course_lib.parallel.pp.viz import schedule_view, schedule_widget
from course_lib.widgets import show_interactive

show_interactive(lambda: schedule_view("interleaved_1f1b", 4, 8, 2), lambda: schedule_widget("interleaved_1f1b", 4, 8, 2))

# %% [markdown]
# ## 12. Writing a schedule yourself, and what can go wrong
#
# A schedule is just lists. Rank 0 below insists on its first backward before the forwards
# that the last stage needs, while rank 1 waits for micro-batch 1 first: a real run would
# hang forever. The checker simulates the lists and names the wait instead:

# %%
bad = Schedule("mine", 2, 2, 1, [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                                 [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]])
try:
    check_schedule(bad)
except ScheduleError as err:
    print(err)

# %% [markdown]
# `run_pipeline` and `run_schedule` check every schedule this way, and every other rule (blocks
# ≥ stages × chunks, a batch that divides into the micro-batches, interleaved's multiple of
# $p$) before any rank starts to wait.
#
# ## 13. Where pipelining sits in 3D parallelism
#
# Tensor parallelism (notebook 05) all-reduces activations inside every layer; data
# parallelism all-reduces the gradients once per step; pipelining sends one activation per
# micro-batch per stage boundary, point to point. So the usual layout (Narayanan et al. 2021)
# puts TP inside a node (NVLink) and PP and DP across nodes. Which of those two is outermost
# (its groups spread over the machines farthest apart) is a choice, and both are in use:
# Megatron-LM orders its groups tp-cp-ep-dp-pp, pipeline outermost, the order notebook 10
# uses; Llama 3 orders them [TP, CP, PP, DP], data parallel outermost, because its sharded
# data parallelism prefetches parameters ahead of use and so tolerates the longest latency
# (Dubey et al. 2024, §3.3.2). With the α-β model
# (notebook 02), the message of a GPT-3-sized stage boundary (hidden 12288, 2048 tokens,
# one sequence per micro-batch, bf16) against the compute it must hide behind:

# %%
d, T, b, layers, p = 12288, 2048, 1, 96, 8
message = b * T * d * 2  # bf16 activation of one micro-batch
layer_params = 12 * d * d
stage_flops = 2 * layer_params * (layers // p) * b * T  # forward of one micro-batch on one stage
for name, link in CLUSTERS.items():
    print(f"{name:>38}: one {message / 2**20:.0f} MiB message {link.message_time(message) * 1e3:6.2f} ms")
print(f"forward of one micro-batch on a {layers // p}-layer stage at 400 TFLOP/s: {stage_flops / 400e12 * 1e3:.0f} ms")

# %% [markdown]
# Even over InfiniBand a stage boundary costs about a millisecond against a forward of
# hundreds of milliseconds, so PP tolerates slow links. What it cannot tolerate is few
# micro-batches: the bubble $\frac{p-1}{m+p-1}$ is why large runs use $m \gg p$, which the
# global batch (and DP's share of it) must allow.

# %% [markdown]
# ## 14. PyTorch's own action lists beside ours
#
# `torch.distributed.pipelining` (sections 8 and 9), the library you will use at work, writes its
# schedules as data too. Every rank computes, for every rank, the ordered list of actions it runs
# (`pipeline_order`, actions such as `2F0`: stage 2, forward, micro-batch 0), and the multi-stage
# schedules lower that list into one with the messages and FSDP's gathers in it
# (`pipeline_order_with_comms`). Torch's own chart maker,
# `torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`, builds a schedule on a mock
# stage and returns both lists without a rank, a message or a tensor.
# `course_lib.parallel.pp.torch_order` reads them that way and translates torch's words into ours:
#
# | torch | what it is | ours |
# |---|---|---|
# | `F` | forward | `F` |
# | `I` (`BACKWARD_INPUT`) | the input gradient only | `B` of a split backward |
# | `W` (`BACKWARD_WEIGHT`) | the weight gradient | `W` |
# | `B` (`FULL_BACKWARD`) | the whole backward | `B`, followed at once by its `W` in a schedule that splits others |
# | `OVERLAP_F_B` | an F and a B run as one unit | an `F&B` pair |
# | `SEND_F` `RECV_F` `SEND_B` `RECV_B` | the messages | derived from the lists (`p2p_plan`) |
# | `UNSHARD` `RESHARD` `REDUCE_GRAD` | FSDP's gather and free of a stage, the gradient reduction | not in our lists |
#
# A stage index becomes a rank and a chunk through the placement: the loop for interleaving, the
# V for ZB-V and DualPipeV. GPipe and 1F1B hold one stage per rank, and torch's `step` runs them
# with a loop of its own, not from the list; `traced_order` runs that loop on a stand-in stage that
# writes down each forward and backward it is asked for and sends nothing.
#
# All five schedules that both libraries ship, at $p = 4$ ranks and $m = 8$ micro-batches (two
# chunks per rank where there are chunks): for each rank our list above torch's, blue F, green B,
# orange W (paler for chunk 1), a black frame where torch's list first parts from ours.

# %%
import numpy as np
from matplotlib.colors import to_rgba

from course_lib.parallel.pp.p2p_plan import plan_messages
from course_lib.parallel.pp.torch_order import (check_lowered, comm_counts, compare, to_course, torch_lacks,
                                                torch_order, traced_order)

NATIVE_FIVE = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
TORCH = {}  # name -> (ours, torch's, the comparison per rank)
for name, v in NATIVE_FIVE:
    if why := torch_lacks(name):
        print(f"{name}: left out, {why}")
        continue
    ours, theirs = make_schedule(name, P, M, v), to_course(name, P, M, torch_order(name, P, M))
    TORCH[name] = (ours, theirs, compare(ours, theirs))

COLOURS = {"F": "tab:blue", "B": "tab:green", "W": "tab:orange"}
fig, axes = plt.subplots(len(TORCH), 1, figsize=(11, 1.45 * len(TORCH) + 0.6), squeeze=False)
for ax, (name, (ours, theirs, cmp)) in zip(axes[:, 0], TORCH.items()):
    width = max(len(a) for s in (ours, theirs) for a in s.actions)
    grid = np.ones((3 * P - 1, width, 4))  # per rank a row of ours, a row of torch's, a white gap
    for r in range(P):
        for row, sched in ((3 * r, ours), (3 * r + 1, theirs)):
            for i, a in enumerate(sched.actions[r]):
                grid[row, i] = to_rgba(COLOURS[a.kind], 1.0 if a.chunk == 0 else 0.45)
        if cmp[r].first is not None:
            ax.add_patch(plt.Rectangle((cmp[r].first, 3 * r), 1, 2, fill=False, edgecolor="black", linewidth=1.5))
    ax.imshow(grid, aspect="auto", interpolation="nearest", extent=(0, width, 3 * P - 1, 0))
    ax.set_yticks([3 * r + k + 0.5 for r in range(P) for k in (0, 1)],
                  [f"rank {r} {who}" for r in range(P) for who in ("ours", "torch")], fontsize=5.5)
    ax.set_title(f"{name}: p = {P}, m = {M}", fontsize=8)
    ax.tick_params(axis="x", labelsize=6)
axes[-1, 0].set_xlabel("position in the rank's list")
fig.tight_layout()
plt.show()
for name, (ours, theirs, cmp) in TORCH.items():
    same = [c.rank for c in cmp if c.agree]
    print(f"{name:>16}: {len(ours.actions[0])} actions on rank 0; " + (
        "every rank's list the same" if len(same) == P else "; ".join(str(c) for c in cmp)))
for name in ("gpipe", "interleaved_1f1b"):
    if name in TORCH:
        assert all(c.agree for c in TORCH[name][2])  # the same actions in the same order, exactly
for name in ("zbv", "dualpipev"):
    if name in TORCH:
        assert all(c.same_actions for c in TORCH[name][2]) and TORCH[name][2][0].first != 0

# %% [markdown]
# GPipe and interleaved 1F1B are the same lists on every rank: torch's `Interleaved1F1B` is
# Megatron's order, as ours is (Narayanan et al. 2021), and its `None` idle steps, which only
# its chart uses, drop out. 1F1B deserves a closer look at its last rank:

# %%
if "1f1b" in TORCH:
    ours, theirs, cmp = TORCH["1f1b"]
    traced = to_course("1f1b", P, M, traced_order("1f1b", P, M))
    print(f"rank {P - 1}, ours:                  ", " ".join(map(str, ours.actions[P - 1])))
    print(f"rank {P - 1}, torch's pipeline_order:", " ".join(map(str, theirs.actions[P - 1])))
    print(f"rank {P - 1}, torch's step (traced): ", " ".join(map(str, traced.actions[P - 1])))
    try:
        check_schedule(theirs)
        print("our checker passes torch's list")
    except ScheduleError as err:
        print(f"our checker on torch's list: {err}")
    assert all(c.agree for c in compare(ours, traced))  # what torch runs is our 1F1B, exactly
    if "gpipe" in TORCH:
        assert all(c.agree for c in compare(TORCH["gpipe"][0], to_course("gpipe", P, M, traced_order("gpipe", P, M))))
    shifted = [Action(a.kind, a.microbatch + (a.kind == "F"), a.chunk) for a in ours.actions[P - 1]]
    assert all(c.agree for c in cmp[:-1]) and theirs.actions[P - 1] in (ours.actions[P - 1], shifted)
    if theirs.actions[P - 1] == shifted:
        print(f"torch's list numbers the last rank's forwards from 1 (F1 to F{M}: there is no micro-batch {M}, "
              f"and F0 is missing), while the loop its step runs is ours on every rank, and so is its GPipe")
    else:
        print("torch's list and the loop its step runs are both ours on every rank, as is its GPipe")

# %% [markdown]
# So `pipeline_order` of a single-stage schedule is a drawing of the schedule, which torch's
# chart maker and exports read, while `step` runs a loop written separately; where the two part,
# the checker of section 12 finds it in one line. For the multi-stage schedules the list is what
# runs: their `step` walks the lowered list.
#
# **The V schedules.** Their lists differ from ours in order but hold the same actions. The
# simulator of section 9 times both on the same clocks (`CLOCKS`: equal times, then messages that
# cost time, then a W shorter or longer than F and B). Both pass the checker:

# %%
print(f"{'':>17} {'peak':>5} {'pairs per rank':>15}  bubble: " + "; ".join(label for label, _ in CLOCKS))
V_SIDE = {}
for name in ("zbv", "dualpipev"):
    if name not in TORCH:
        continue
    for who, sched in zip(("ours", "torch's"), TORCH[name][:2]):
        check_schedule(sched)  # every action once, no deadlock
        bubbles = [measured_bubble(schedule_events(sched, **times)) for _, times in CLOCKS]
        V_SIDE[(name, who)] = (max(in_flight(sched, until="W")), [len(sched.pairs(r)) for r in range(P)], bubbles)
        peak, pairs, _ = V_SIDE[(name, who)]
        print(f"{name:>9} {who:>7} {peak:>5} {str(pairs):>15}  " + ", ".join(f"{b:.3f}" for b in bubbles))
        assert abs(bubbles[0] - formula_for(name, P, M)) < 1e-12  # (p-1)/(6m+p-1) at equal times (float64 only)

# %%
def part_from(cmp):
    """The first position at which any rank's two lists part."""
    return min(c.first for c in cmp if c.first is not None)


def who_wins(mine, theirs):
    """Per clock off the ideal one: 'ours', "torch's" or 'tie' (the lower simulated bubble)."""
    return ["tie" if abs(a - b) < 1e-12 else ("ours" if a < b else "torch's") for a, b in zip(mine[2][1:], theirs[2][1:])]


if "zbv" in TORCH:
    ours, theirs, cmp = TORCH["zbv"]
    n, first = len(ours.actions[0]), part_from(cmp)
    zb_ours, zb_torch = V_SIDE[("zbv", "ours")], V_SIDE[("zbv", "torch's")]
    assert zb_ours[0] == zb_torch[0] == 2 * P  # both at 1F1B's peak of p micro-batches, 2p chunks
    print(f"ZB-V: the same {n} actions per rank; "
          + ", ".join(f"rank {c.rank} " + ("identical" if c.agree else f"parts at position {c.first}") for c in cmp)
          + f", all within the last {n - first} of {n} actions, around the drain where W's fill the gaps. Peak "
          f"{zb_ours[0]} chunks both; the same bubble at equal times ({zb_ours[2][0]:.3f}); lower off that "
          "clock: " + ", ".join(f"{label}: {w}" for (label, _), w in zip(CLOCKS[1:], who_wins(zb_ours, zb_torch))))

if "dualpipev" in TORCH:
    ours, theirs, cmp = TORCH["dualpipev"]

    def whole(sched, r):
        """How many backwards of rank r are whole (their W right after them) and where the first F&B pair sits."""
        acts = sched.actions[r]
        return (sum(a.kind == "B" and i + 1 < len(acts) and acts[i + 1] == Action("W", a.microbatch, a.chunk)
                    for i, a in enumerate(acts)), min(sched.pairs(r)))

    dp_ours, dp_torch = V_SIDE[("dualpipev", "ours")], V_SIDE[("dualpipev", "torch's")]
    for r in range(P):
        (w_o, p_o), (w_t, p_t) = whole(ours, r), whole(theirs, r)
        print(f"DualPipeV rank {r}: first F&B pair at position {p_o} (ours) / {p_t} (torch's); "
              f"{dp_ours[1][r]} / {dp_torch[1][r]} pairs; of its {2 * M} backwards {w_o} / {w_t} whole")
    print(f"DualPipeV peak: ours {dp_ours[0]} chunks whose W has not run, torch's {dp_torch[0]} "
          f"(ZB-V's {2 * P}); the same bubble at equal times ({dp_ours[2][0]:.3f}); lower off that clock: "
          + ", ".join(f"{label}: {w}" for (label, _), w in zip(CLOCKS[1:], who_wins(dp_ours, dp_torch))))
    assert dp_torch[0] < dp_ours[0] <= 2 * P + 2  # torch's holds fewer chunks; ours stays within its cap of 2p + 2
    assert all(whole(ours, r)[0] < whole(theirs, r)[0] for r in range(P))  # ours splits more backwards, every rank

# %% [markdown]
# For ZB-V both libraries follow Qi et al.'s layout (Qi et al. 2023, §6; torch writes it out
# phase by phase, ours comes from the list scheduler of section 9), and they part only where the
# cool-down's W's are placed; the lines above say where and what that costs on each clock. For
# DualPipeV the course's list is the simplified one. Torch's `ScheduleDualPipeV` follows the
# eight phases of DeepSeek's `dualpipev.py` step for step (DeepSeek-AI 2025, DualPipe repository):
# forwards of chunk 0, forwards of both chunks, a stretch of split backwards (I, then W) with
# forwards between them, the steady F&B pairs, one more stretch of whole B's each with a pair,
# and a cool-down whose second half splits I from W again. Ours has one rule instead: whenever
# an F and a B of another micro-batch can both start, they go as a pair and that B runs whole;
# outside the pairs its W's wait to fill idle time. So the pairs fall at other places (the lines
# above give each rank's first pair and their number), ours runs fewer backwards whole (a W right
# after its B, as torch runs an I followed at once by its W) on every rank, and it lets a rank
# keep more chunks in flight (its cap is $2p + 2$ chunks, DeepSeek's $PP + 1$ micro-batches),
# where torch's phases hold fewer at this $p$ and $m$. On the ideal clock the two tie; off it the
# last line above says which order comes out lower on each clock.
#
# **The lowered list.** Torch runs its multi-stage schedules from the lowered list, with every
# message and FSDP's gathers in place.
#
# **Predict.** In torch's lowered ZB-V list at $p = 4$, $m = 8$, how many sends (`SEND_F` plus
# `SEND_B`) are there over all ranks, and how many in our own plan of the same schedule's messages?
#
# <details><summary>Answer</summary>
#
# A micro-batch crosses $2p - 1 = 7$ stage boundaries on the way down the V and back, and one of
# them, the turn from stage $p-1$ to stage $p$, stays on rank $p - 1$: 6 messages forward and 6
# backward per micro-batch, $2 \cdot 8 \cdot 6 = 96$ sends, as many receives. Ours moves the same
# 96 tensors (section 6's count, `messages_per_step`); the libraries differ in when each is posted.
# </details>

# %%
if "zbv" in TORCH:
    LOWERED = torch_order("zbv", P, M, with_comms=True)
    print("rank 1, lowered ZB-V, its first 26 entries:\n ", " ".join(map(str, LOWERED[1][:26])))
    counts = comm_counts(LOWERED)
    for r, c in enumerate(counts):
        print(f"rank {r}: " + ", ".join(f"{c[k]} {k}" for k in ("F", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
                                                                  "UNSHARD", "RESHARD", "REDUCE_GRAD")))
    sends = sum(c["SEND_F"] + c["SEND_B"] for c in counts)
    ours_sends = sum(op == "send" for batches in plan_messages(TORCH["zbv"][0]).batches
                     for _, batch in batches for op, _, _ in batch)
    assert sends == sum(c["RECV_F"] + c["RECV_B"] for c in counts) == messages_per_step(P, M, 2, "v") == ours_sends
    assert all(c["UNSHARD"] == c["RESHARD"] == c["REDUCE_GRAD"] == 2 for c in counts)  # one each per local stage
    print(f"{sends} sends and as many receives in torch's list; {ours_sends} sends in our plan of the same schedule")
    for sentence in check_lowered(LOWERED):
        print(sentence)
    names = [str(a) for a in LOWERED[1]]
    ahead = {n: names.index(n.replace("RECV_", "")) - i for i, n in enumerate(names) if "RECV_F" in n}
    early = max(ahead, key=ahead.get)
    print(f"rank 1's earliest receive: {early}, {ahead[early]} entries before {early.replace('RECV_', '')}")

# %% [markdown]
# What the lowering adds, read off that list:
#
# * **Messages.** After each compute whose tensor another rank needs comes its send (`1SEND_F0`
#   after `1F0`). Torch steps all ranks' lists in turn, and when a sender's action is placed it
#   places the matching receive in the receiver's list at that point: a receive is posted as soon
#   as the compute that makes its tensor has a place, before the compute that waits for it,
#   sometimes several entries earlier (the last line above). Our runner
#   derives the same messages from the same lists and issues them in the batches of
#   `p2p_plan.py`, in an order both ends agree on, as NCCL requires. The turn of the V, stage 3 to stage 4 on rank 3,
#   has no message in either.
# * **FSDP.** `UNSHARD` gathers a stage's sharded parameters before its first compute and
#   `RESHARD` frees them after its last; torch keeps up to three stages gathered, so with two
#   stages per rank both are gathered at the start of the step and freed at its end (notebook 08's
#   ZeRO-3 gathers per layer instead).
# * **`REDUCE_GRAD`**, once per stage after its last backward or W: where data parallelism's
#   gradient reduction goes (notebook 03), after the micro-batches have all added their share.

# %% [markdown]
# ## What to remember
#
# * PP cuts the model by depth; stages exchange one activation/gradient per micro-batch,
#   point to point. Tied embeddings need one extra exchange between the first and last stage.
# * Bubble $\frac{p-1}{m+p-1}$ for GPipe and 1F1B; $\frac{p-1}{vm+p-1}$ interleaved (for $v$
#   times the messages); ZB-H1 (B/W split) $\frac{p-1}{3m+p-1}$ at equal F, B, W times, with
#   1F1B's peak memory $p\,M_B$.
# * GPipe holds $m$ micro-batches of activations, 1F1B at most $p - r$ on rank $r$.
# * A schedule is data: per-rank lists of F, B, W. It runs without deadlock exactly when each
#   rank can run its list in order under the dependencies F(j,s-1) → F(j,s), B(j,s+1) → B(j,s).
# * A V (stages $r$ and $2p-1-r$ on rank $r$) puts embedding and loss on rank 0; ZB-V halves
#   ZB-H1's idle time, $\frac{p-1}{6m+p-1}$, at 1F1B's peak. That idle time is nearly all the
#   warm-up stagger a synchronous end of step leaves; with post-validation (step first, check
#   the global norm and inf/NaN after, roll back when the check fails) it becomes work, and ZB-V
#   and ZB-H2 are zero-bubble at equal F, B, W times. DualPipeV (DualPipe cut in half) pairs the
#   F of one micro-batch with the B of another, which pays off where communication can overlap,
#   and holds one micro-batch more.
# * `torch.distributed.pipelining` writes its schedules as per-rank lists too (`pipeline_order`),
#   and lowers the multi-stage ones with sends, receives, FSDP's unshard/reshard and the gradient
#   reduction in place. Read without running, its GPipe, 1F1B (the loop it runs) and interleaved
#   lists are ours; its ZB-V and DualPipeV are other valid orders of the same actions, with the same
#   bubble at equal times.
# * PipeDream-2BW drops the flush: bubble once per run, two weight versions per stage,
#   $W_{t+1} = W_t - \text{lr}\cdot\nabla f_t(W_{t-1})$; its reference is that delayed update.
#
# ## Self-check
#
# 1. $p = 8$, $m = 8$: what is the bubble of 1F1B? Of interleaved with $v = 4$?
# 2. Why does raising $m$ at a fixed global batch eventually stop helping?
# 3. Rank 2 of 4 runs 1F1B with $m = 16$. How many micro-batches' activations does it hold at most?
# 4. In the zero-bubble schedule, why can W wait but B cannot?
# 5. You forget to sum the tied embedding's gradient between the first and last stage. What
#    happens to the two copies after one optimizer step?
# 6. Under ZB-H1, why does rank 0 defer no W at all, while the last rank defers $p - 1$?
# 7. In a V on $p = 4$ ranks, which rank holds stage 5, and which stage boundary never leaves a rank?
# 8. Why does PipeDream-2BW need $m \ge p$ micro-batches per batch to manage with two weight versions?
# 9. Under post-validation a stage updates its weights before the global gradient norm is known.
#    What must it keep, what happens when the norm turns out above the clip, and why does that
#    rarely cost anything?
# 10. Torch's lowered ZB-V list at $p = 4$, $m = 8$ holds 96 sends. How many would its lowered
#     interleaved 1F1B list ($v = 2$) hold at the same $p$ and $m$, and why more?
#
# <details><summary>Answers</summary>
#
# 1. $7/15 \approx 0.47$; interleaved $7/39 \approx 0.18$.
# 2. Smaller micro-batches make each F and B less efficient on a GPU and add per-message
#    latency, while the bubble gains shrink like $1/m$.
# 3. $p - r = 2$.
# 4. The previous stage needs B's input gradient to continue; W's result is needed only by the
#    optimizer at the end of the step.
# 5. Each copy is updated with only its own half of the gradient: they drift apart, and
#    neither equals the single-process model.
# 6. Rank 0 already holds $p$ graphs at 1F1B's peak: a deferred W would add a stash on top of
#    them. The last rank holds one graph, so it has room for $p - 1$ stashes within $p\,M_B$,
#    and deferring its W's lets every B travel back without waiting behind a W.
# 7. Rank $2p - 1 - 5 = 2$; the turn from stage 3 to stage 4, both on rank 3.
# 8. A stage holds at most $p$ micro-batches in flight. With $m \ge p$ they belong to at most
#    two consecutive batches, which use two versions; with $m < p$ three batches would be in
#    flight at once, each with its own version.
# 9. Its weights and optimizer state from before the step (or enough to undo it). When the norm
#    is above the clip (or a gradient is inf or NaN), every stage rolls back and redoes the step
#    with the clipped gradients, or skips it. In stable training that rarely happens, while the
#    synchronisation it replaces would idle the stagger on every step.
# 10. $2 \cdot 8 \cdot 7 = 112$: a micro-batch crosses $pv - 1 = 7$ stage boundaries each way and
#     in the loop placement every one of them is between two ranks; the V keeps its turn on one rank.
# </details>
#
# ## References
#
# * Huang et al. (2019), *GPipe: Efficient Training of Giant Neural Networks using Pipeline
#   Parallelism*, NeurIPS: micro-batches and the bubble $\frac{p-1}{m+p-1}$.
# * Narayanan et al. (2019), *PipeDream: Generalized Pipeline Parallelism for DNN Training*,
#   SOSP: the one-forward-one-backward order and weight stashing.
# * Fan et al. (2021), *DAPPLE: A Pipelined Data Parallel Approach for Training Large Models*,
#   PPoPP: synchronous pipelining with early backward (1F1B with a flush).
# * Narayanan et al. (2021), *Efficient Large-Scale Language Model Training on GPU Clusters
#   Using Megatron-LM*, SC: PipeDream-Flush, the interleaved schedule, 3D layouts.
# * Qi et al. (2023), *Zero Bubble Pipeline Parallelism* (arXiv:2401.10241, ICLR 2024): the B/W
#   split, ZB-H1 and ZB-H2 (§2, Table 2), post-validation of the optimizer step (§4); ZB-V in the
#   arXiv version, §6. The authors' repository (sail-sg/zero-bubble-pipeline-parallelism), README:
#   the bubble of each schedule at equal F, B, W times, post-validation, `--allow-padding-num-layers`.
# * Qi et al. (2024), *Pipeline Parallelism with Controllable Memory* (NeurIPS): the V placement
#   and ZB-V at 1F1B's memory (first in Qi et al. 2023, §6).
# * DeepSeek-AI (2024), *DeepSeek-V3 Technical Report*, §3.2.1 and Table 2: DualPipe, forward
#   and backward chunks overlapped in pairs, $PP + 1$ micro-batches of activations.
# * Qi, Wan, Huang and Lin (2025), *DualPipe could be better without the Dual* (Sea AI Lab, Hugging
#   Face blog): the "cut-in-half" derivation of DualPipeV, credited in DeepSeek's DualPipe README.
# * Megatron-LM, `megatron/core/pipeline_parallel/schedules.py` and `model_parallel_config.py`:
#   `microbatch_group_size_per_vp_stage` and the rule on the number of micro-batches.
# * Narayanan et al. (2021), *Memory-Efficient Pipeline-Parallel DNN Training*, ICML:
#   PipeDream-2BW, double-buffered weights and the one-step-delayed update.
# * Dubey et al. (2024), *The Llama 3 Herd of Models*, §3.3.2: 4D parallelism, the [TP, CP, PP, DP]
#   order, a pipeline schedule with a flexible number of micro-batches, and one layer fewer on
#   the first and the last stage.
# * PyTorch, `torch.distributed.pipelining` (documentation, and `schedules.py` and
#   `_schedule_visualizer.py` in torch 2.13): `pipeline_order`, `get_schedule_ops`, the lowering
#   passes `_add_unshard_reshard`, `_add_reduce_grad` and `_add_send_recv`; `ScheduleZBVZeroBubble`
#   after Qi et al. (2023, §6), `ScheduleDualPipeV` after DeepSeek's `dualpipev.py` (pytorch/pytorch
#   pull request 159591).
# * DeepSeek-AI (2025), DualPipe repository (github.com/deepseek-ai/DualPipe), `dualpipe/dualpipev.py`:
#   DualPipeV's eight phases, which torch's schedule follows.
#
# Further reading:
#
# * Qi et al. (2024), as above, §3-4: schedules as a repeated building block, and memory below 1F1B's.
# * DeepSeek-AI's DualPipe repository, as above: DualPipe and DualPipeV side by side.
#
# Next: write the 1F1B schedule yourself, and a variant under a memory cap per rank, in
# `exercises/ex06_pipeline_schedule.ipynb`. Having written it, compare with the library's
# `course_lib/parallel/pp/schedules.py`.
