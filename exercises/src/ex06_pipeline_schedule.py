# %% [markdown]
# # Exercise 06: write the 1F1B schedule
#
# **Goal.** In `exercises/ex06_pipeline_schedule/student.py`, write `one_f_one_b(p, m)`: the
# 1F1B pipeline schedule as data, one ordered list of `Action("F", j)` / `Action("B", j)` per
# rank. Then watch your lists train a GPT on 4 real ranks.
#
# Work on paper first: draw 4 ranks and 8 micro-batches on a time grid (a forward takes one
# square, a backward two). When does rank 0 receive the gradient of micro-batch 0? How many
# forwards can it run before then, and what would more cost? **Re-read in notebook 06:**
# section 2 (the bubble and its derivation), section 5 (1F1B and why it bounds memory) and
# section 10 (a schedule as lists, and how one deadlocks).
#
# **How grading works.** Your lists are graded two ways. First as data: every action present
# exactly once, no deadlock when every rank runs its list in order, at most p - r micro-batches
# in flight on rank r, and the bubble of GPipe, (p-1)/(m+p-1), on an idealised machine.
# Then on real ranks: your schedule runs the pipelined training of a GPT, whose gradients and
# parameters must equal the single-process training. A check prints `PASS  ...` or raises
# `CheckFailed` with what it expected. The stored outputs are what correct code prints. Edit
# `student.py`, then *Kernel → Restart and run all*.

# %%
import torch

from course_lib.data import CharDataset
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPTConfig
from course_lib.parallel.pp import Schedule, ScheduleError, check_schedule, in_flight, run_pipeline, stage_tensors
from course_lib.parallel.pp.bubble import formula_for, measured_bubble
from course_lib.parallel.pp.schedules import schedule_events
from course_lib.train import TrainConfig, train_reference

student = load_student("ex06_pipeline_schedule")


def learner_schedule(p, m):
    return Schedule("1f1b (yours)", p, m, 1, student.one_f_one_b(p, m))

# %% [markdown]
# ## Check 1: every action once, and no deadlock
# For p = 2, 3, 4 ranks and m = 1 to 9 micro-batches (including fewer micro-batches than
# ranks), the lists must contain each F and B of each micro-batch exactly once per rank, and
# the ranks must be able to run them in order without waiting forever.

# %%
problems = {}
for p in (2, 3, 4):
    for m in range(1, 10):
        try:
            check_schedule(learner_schedule(p, m))
        except ScheduleError as err:
            problems[f"p={p}, m={m}"] = str(err)
check_equal("p = 2..4, m = 1..9: schedules with a missing or repeated action, or a deadlock", problems, {})

# %% [markdown]
# ## Check 2: bounded memory and the smallest bubble
# Rank r may hold at most p - r micro-batches in flight (this is what makes 1F1B's memory
# independent of m), and on a machine where a forward takes 1 and a backward 2 time units the
# bubble must be GPipe's, (p-1)/(m+p-1): no rank waits longer than the pipeline forces it to.

# %%
for p, m in ((2, 8), (4, 2), (4, 8), (4, 16)):
    sched = learner_schedule(p, m)
    check_equal(f"p={p}, m={m}: at most p - r in flight on rank r",
                [k <= p - r for r, k in enumerate(in_flight(sched))], [True] * p)
    bubble = measured_bubble(schedule_events(sched, t_forward=1.0, t_backward=1.0, t_weight=1.0))
    check_close(f"p={p}, m={m}: bubble", bubble, formula_for("1f1b", p, m), rtol=1e-9, atol=1e-9)  # float64 rounding

# %% [markdown]
# ## Check 3: your schedule trains a GPT on 4 real ranks
# The same 5-block GPT (blocks split 2-1-1-1, tied embeddings) trained for 3 AdamW steps with
# your schedule, once with 8 micro-batches and once with 2 (fewer than the ranks): losses,
# gradients and parameters must equal the single-process training.

# %%
config = GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=5, d_model=32, n_head=2, block_size=16)
cfg = TrainConfig(steps=3, batch_size=16, grad_clip=0.0, eval_every=10**6, eval_batches=1, progress=False)
ref = train_reference(config, cfg)
ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
ref_grads = {n: p.grad for n, p in ref.model.named_parameters()}
for m in (8, 2):
    results = run_pipeline(4, config, cfg, learner_schedule(4, m), m, timeout_s=60)
    # losses: fp32 sums in another order (the micro-batches), ~1e-7 apart
    check_close(f"m={m}: losses of the 3 steps", results[0].train_losses, ref.train_losses, rtol=1e-5, atol=1e-5)
    grads, params = stage_tensors(results, "final_grads"), stage_tensors(results, "final_params")
    # Gradients and parameters after 3 AdamW steps, compared in norm: AdamW magnifies the rounding of gradients
    # near zero (notebook 04) and can move a single parameter by up to ~lr, which a wrong schedule does to most.
    for name in ("tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.4.mlp.proj.weight", "ln_f.weight"):
        check_close(f"m={m}: gradient of {name} (|difference| / |gradient|)",
                    ((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()).item(), 0.0, rtol=0, atol=1e-4)
    diff = torch.cat([(params[n] - ref_params[n]).flatten() for n in ref_params])
    check_close(f"m={m}: parameters after 3 steps (RMS of the difference)", diff.pow(2).mean().sqrt().item(), 0.0,
                rtol=0, atol=cfg.lr / 100)

# %% [markdown]
# ## Going further
#
# * Change your generator so the warm-up has one forward more than needed. Which check fails,
#   and why does the real run still give the right gradients?
# * Write GPipe as lists (all F, then all B) and compare `in_flight` with yours for m = 16.
# * Notebook 06's zero-bubble schedule splits each B into B and W: where would you put the W's
#   in your lists to fill the bubble?
