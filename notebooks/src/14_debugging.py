# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/14_debugging.ipynb)

# %% [markdown]
# # 14 · Debugging distributed training
#
# The strategies of notebooks 03-12 each came with a proof: the parallel run equals the single
# process. Real runs break that promise in two ways, and practitioners lose more days to them
# than to any missing strategy:
#
# * the run **hangs**: one rank waits in a collective that another rank never enters, and
#   nothing says which (until a timeout, often ten minutes later, names only the waiting ranks);
# * the run **finishes with wrong numbers**: a loss curve slightly above where it should be, a
#   gradient that is four times too large, replicas that quietly drift apart. No error at all.
#
# This notebook treats both as detective work on a catalogue of real broken runs, each a small
# function with its one-line bug and its mended twin: first the **symptom** (predict the
# cause), then the **evidence** a tool gives, then the **fix**, held against the reference.
#
# **After this notebook you can**
#
# * turn any hang into a bounded timeout, and read the flight recorder's analysis to name the
#   rank and the call where the ranks diverged;
# * use gloo's `monitored_barrier` to name a rank that never arrives, and say what the
#   course's collective checks and `TORCH_DISTRIBUTED_DEBUG=DETAIL` catch before a hang;
# * find a silent bug from its evidence: a gradient norm N times the reference's, per-rank
#   checksums that disagree, a loss that departs from the single process at step 1;
# * hold your own strategy against the single process with a loss-parity test whose tolerance
#   comes from the precision, not from trial and error;
# * analyse a torchrun job's hang from the files its ranks dumped, from the command line;
# * run PyTorch's own flight recorder and its analyser `fr_trace` on the same hang, and say what
#   each sees that the other does not; pick the PyTorch, NCCL and Python switches a real hang or
#   memory problem calls for;
# * name the bug behind each of twelve symptoms and its fix.

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
import datetime
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from IPython.display import Markdown, display

from course_lib.data import VOCAB_SIZE, CharDataset
from course_lib.debugging import BUGS, hangs, run_bug, silent
from course_lib.debugging.torch_recorder import ANALYSER, Verdict, compare_recorders, torch_recorder_missing
from course_lib.model import GPT, GPTConfig
from course_lib.observe.parity import loss_parity, parity_rtol
from course_lib.runtime import HangAnalysed, RankError, run_on_ranks, run_recorded, shutdown_pools
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import StepHooks, TrainConfig, make_optimizer, share_rows, train_loop

torch.manual_seed(0)
WORLD, BAD = 4, 2  # 4 gloo ranks; the bug sits on rank 2
TIMEOUT_S = 5  # a hang is given up after 5 s; then each rank still running writes its last calls
# Start the ranks and import the catalogue there once, so that TIMEOUT_S times the hang alone
run_on_ranks(hangs.skip_collective, True, BAD, world_size=WORLD, timeout_s=120)


def show_source(fn):
    """Print a catalogue entry's code: the bug and its mended twin side by side (`fixed`)."""
    print(inspect.getsource(fn))

# %% [markdown]
# ## 1. How a distributed run fails, and which tool finds what
#
# Every rank runs the same program on its own data. They meet only in collectives (all-reduce,
# all-gather, broadcast, all-to-all) and point-to-point messages, and a collective on a group
# completes only when **every** member has entered the **same** call. Two families of bugs follow:
#
# | family | what you see | what finds it |
# |---|---|---|
# | a rank skips a call, calls another one, or calls it on another group | a hang, then a timeout naming the ranks that *waited* | the flight recorder (each rank's last calls, lined up; the course's, or PyTorch's own, section 9); `monitored_barrier` (which rank never arrived); collective checks before each call (the course's, or `TORCH_DISTRIBUTED_DEBUG=DETAIL`) |
# | every rank calls the same collectives, on wrong data | a run that finishes: a loss a little off, a gradient norm off by a factor, replicas that drift | the single process (loss parity, step by step); the gradient norm; per-rank checksums of the gradients; the tracer's call counts |
#
# Rule one, which makes the rest possible: **nothing may wait forever**. Every run here has a
# timeout (notebook 00's `run_on_ranks(..., timeout_s=...)`; under torchrun, the process
# group's timeout), so a hang becomes an error in seconds.
#
# ## 2. Case 1: three ranks wait, one finished
#
# Four ranks all-reduce a gradient at each of three steps. At step 3, rank 2's batch happened to
# be all padding: its gradient is zero. The run stops printing.
#
# *Predict first:* the timeout below names the ranks that did not finish: 0, 1 and 3. Which
# rank has the bug?
#
# <details><summary>Answer</summary>
#
# Rank 2, the one the timeout does **not** name. The ranks that wait are the innocent ones:
# they entered all-reduce #3 and wait for a partner. The culprit left the collective out and
# went on (here it even returned). A timeout that lists stuck ranks points away from the bug;
# the evidence has to say who never arrived.
# </details>

# %% [markdown]
# The run below is bounded: after `TIMEOUT_S` seconds the ranks are stopped and the notebook
# gets an error. It also runs under the course's **flight recorder** (evidence 1, below).

# %%
hang_1 = None
try:
    run_recorded(hangs.skip_collective, False, BAD, world_size=WORLD, timeout_s=TIMEOUT_S)
except HangAnalysed as err:  # a RankTimeout, with the flight recorder's analysis
    hang_1 = err
    print(f"timeout after {TIMEOUT_S} s; the ranks that did not finish: {err.stuck_ranks}")
assert hang_1 is not None and hang_1.stuck_ranks == [0, 1, 3]

# %% [markdown]
# **Evidence 1: the flight recorder.** Each rank kept a ring buffer of its last calls (op,
# group, shape, dtype, a sequence number per group, issued or completed). The members of a group
# must issue their collectives on it in the same order, so their k-th calls must be the same
# call. When the timeout passed, the parent asked every rank still running for its buffer, and
# each wrote it to a file, showing where it was at that moment; a rank that left had written its
# own on leaving. `run_recorded` then lined the dumps up and named the culprit, the rank that
# never entered a call the others wait in:

# %%
print(hang_1.analysis)
assert hang_1.analysis.startswith("rank 2 never entered all_reduce #3 on group [0, 1, 2, 3] that ranks 0, 1, 3")

# %% [markdown]
# Read it culprit first: rank 2 never entered the group's third all-reduce, the one ranks 0, 1
# and 3 wait in, and its last call was the second one, completed. So rank 2 skipped a call
# between its second and third all-reduce: exactly where to look in its code. The timeout named
# the three that waited; the recorder names the one that did not.
#
# **Evidence 2: `monitored_barrier`.** gloo has a barrier that does not just wait: rank 0 waits
# for every other rank with a timeout and then reports who did not arrive. Placed after a step,
# it turns "the run is stuck" into "rank 2 did not reach this point". Below, rank 2 takes the same
# skipping branch and never reaches the barrier:

# %%
def barrier_after_the_step():
    if dist.get_rank() == BAD:
        return "skipped the barrier"
    # gloo also writes its message to the process's stderr, with a timestamp: silence that copy
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
        return "passed"
    except RuntimeError as err:
        return str(err).strip().splitlines()[0]
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# check_collectives=False: the course's per-call check is itself a collective, which rank 2 would skip too
said = run_on_ranks(barrier_after_the_step, world_size=WORLD, timeout_s=30, check_collectives=False)
print("rank 0:", said[0])
for rank in (1, 3):
    print(f"rank {rank}:", said[rank].split(",")[0], "(and an error from rank 0)")
assert "Ranks 2 failed to pass monitoredBarrier" in said[0]
shutdown_pools()  # ranks 0, 1 and 3 gave up mid-barrier: their connections are in no state to reuse

# %% [markdown]
# Rank 0, the barrier's coordinator, names rank 2; the other ranks only learn that rank 0
# reported an error. (`monitored_barrier` is gloo's: on NCCL one keeps a gloo group beside the
# NCCL one for it.) Now the code, and the fix:

# %%
show_source(hangs.skip_collective)
fixed = run_on_ranks(hangs.skip_collective, True, BAD, world_size=WORLD, timeout_s=60)
assert fixed == [hangs.skip_collective_expected(WORLD, BAD)] * WORLD
print("mended twin: every rank holds the expected sums:", fixed[0]["sums"])

# %% [markdown]
# The fix is a rule, not a patch: **every rank calls every collective**, with zeros when it has
# nothing to add. A rank with nothing to say still takes part; a data-dependent branch may
# decide *what* a rank contributes, never *whether* it calls.
#
# ## 3. Case 2: two ranks stuck in two different calls
#
# Four ranks form a 2 × 2 mesh (notebook 10): tensor-parallel pairs [0, 1] and [2, 3],
# data-parallel pairs [0, 2] and [1, 3]. Each rank gathers its activations over its
# tensor-parallel pair. This time the timeout names ranks 2 and 3.
#
# *Predict first:* rank 3 waits in the all-gather on [2, 3]. What is rank 2 doing?
#
# <details><summary>Answer</summary>
#
# Something other than the all-gather on [2, 3], or rank 3 would not wait. Rank 2 picked the
# other dimension's group: it is in an all-reduce on its data-parallel pair [0, 2], waiting for
# rank 0, which has finished its own all-gather on [0, 1] and left. Two ranks stuck in two
# different calls on two different groups: the flight recorder lines them up.
# </details>

# %%
hang_2 = None
try:
    run_recorded(hangs.wrong_group, False, BAD, world_size=WORLD, timeout_s=TIMEOUT_S)
except HangAnalysed as err:
    print("stuck ranks:", err.stuck_ranks)
    print(err.analysis)
    hang_2 = err
assert hang_2 is not None and hang_2.analysis.splitlines()[0].startswith(
    "rank 2 never entered all_gather #1 on group [2, 3] that rank 3 waits in (it is in all_reduce #1 on group [0, 2])")

# %% [markdown]
# Two culprits, one waiter each. The first line names the one that went somewhere else: rank 2
# never entered the all-gather rank 3 waits in, because it is in an all-reduce on [0, 2]. The
# second line is its consequence: rank 0 never entered that all-reduce, having finished its own
# all-gather on [0, 1] and left. A culprit stuck in another call comes before one that left with
# every call matched, because a rank that left only did what its program said. Reading only the
# timeout (ranks 2 and 3 stuck) one would debug the wrong pair. The fix takes the group from the mesh
# by name on every rank, never by a rank's own arithmetic:

# %%
show_source(hangs.wrong_group)
fixed = run_on_ranks(hangs.wrong_group, True, BAD, world_size=WORLD, timeout_s=60)
assert fixed == hangs.wrong_group_expected(WORLD, BAD)
print("mended twin: rank 2 gathered", fixed[BAD]["gathered"])

# %% [markdown]
# **A mismatch caught before it hangs.** A rank that issues the right calls in the wrong order
# (`reorder_collectives`: rank 2 broadcasts where the others all-reduce) hangs the same way
# under NCCL. The course's ranks check, before every collective, that the group's members call
# the same op with the same dtype and shape (notebook 00); that check is a small collective of
# its own, so the bug becomes an error naming each rank's call, before anything waits:

# %%
try:
    run_on_ranks(hangs.reorder_collectives, False, BAD, world_size=WORLD, timeout_s=30)
except RankError as err:
    print("\n".join(err.failures[0].strip().splitlines()[-5:]))

# %% [markdown]
# PyTorch has the same check built in: with `TORCH_DISTRIBUTED_DEBUG=DETAIL` set before the
# process group starts, every collective is preceded by a fingerprint exchange, and a mismatch
# raises an error naming both ranks' ops (section 8 runs it under torchrun). Both cost an extra
# small collective per call: a debugging mode, not a production one. The flight recorder only
# writes a few fields to the rank's own memory per call (`benchmarks/bench_runtime.py` measures
# its cost against one 1 MiB all-reduce), so it can stay on for the whole run: that is why
# large runs keep it.
#
# ## 4. Case 3: the loss looks fine
#
# From here on nothing hangs. Four ranks train a small regression model with data parallelism,
# each on its quarter of a batch of 48, SGD with learning rate 0.1, three steps; the single
# process trains on the whole batch. Every step records the loss (mean over the ranks), the
# gradient norm and a checksum of the gradient.
#
# *Predict first:* the ranks all-reduce their gradients with `dist.all_reduce(p.grad)` and step.
# By what factor does the gradient norm differ from the single process's, and which step's loss
# is still right?
#
# <details><summary>Answer</summary>
#
# `all_reduce` sums by default (gloo has no `ReduceOp.AVG`), so every rank holds the **sum** of
# 4 gradients, each the gradient of a quarter-batch mean: 4 times the whole batch's gradient,
# norm ×4. The loss of step 1 is computed before any update, so it is right; from step 2 on SGD
# has taken a step 4 times too long. Under AdamW the loss would look right almost everywhere
# (Adam divides by the gradient's own scale); the norm never does.
# </details>

# %%
reference = silent.reference(WORLD)
broken = run_on_ranks(silent.sum_not_avg, False, None, world_size=WORLD, timeout_s=60)[0]
print("step   loss (ref)   loss (run)   grad norm (ref)   grad norm (run)   ratio")
for k in range(silent.STEPS):
    print(f"{k + 1:>4} {reference['losses'][k]:>12.4f} {broken['losses'][k]:>12.4f} "
          f"{reference['grad_norms'][k]:>17.4f} {broken['grad_norms'][k]:>17.4f} "
          f"{broken['grad_norms'][k] / reference['grad_norms'][k]:>7.2f}")
report = loss_parity(broken, reference, precision="fp32", terms=silent.B)
print(f"loss parity: departs at step {report.first_step}, first in the {report.quantity}")

# %% [markdown]
# The ratio of the first step's norms is 4.00: the world size, the signature of a sum where a
# mean was meant. `loss_parity` (section 7) names the first quantity that departs: the gradient
# norm of step 1, while the loss of step 1 agrees. The fix divides by the world size:

# %%
show_source(silent.sum_not_avg)
mended = run_on_ranks(silent.sum_not_avg, True, None, world_size=WORLD, timeout_s=60)[0]
report = loss_parity(mended, reference, precision="fp32", terms=silent.B)
assert report.ok and loss_parity(broken, reference, terms=silent.B).first_step == 1
print(f"mended twin: parity holds over {report.steps} steps, losses and gradient norms")

# %% [markdown]
# ## 5. Case 4: every rank tells a different story
#
# Gradient accumulation (notebook 04) over 2 micro-batches per step. The gradients should be
# averaged across the ranks once per step, after the last micro-batch. The run below finishes,
# its loss is near the reference's. The gradient checksums of each rank:
#
# *Predict first:* what does it mean when four replicas of one data-parallel model hold
# gradients with four different checksums?
#
# <details><summary>Answer</summary>
#
# That they never exchanged them: after an all-reduce every rank holds bitwise the same sum
# (the backend sends the reduced chunks to everyone), so equal checksums are the minimum a
# data-parallel step must show. Four different ones: the average never ran. Each replica
# trains on its own quarter of the data and they drift apart.
# </details>

# %%
runs = run_on_ranks(silent.never_sync, False, None, world_size=WORLD, timeout_s=60)
for step in range(silent.STEPS):
    sums = [r["checksums"][step] for r in runs]
    print(f"step {step + 1}: {len(set(sums))} different gradient checksums over {WORLD} ranks")
print("all-reduce calls per rank:", [r["all_reduce_calls"] for r in runs])
assert all(len({r["checksums"][k] for r in runs}) == WORLD for k in range(silent.STEPS))

# %% [markdown]
# (A checksum here is 8 hex digits of a hash of the gradient's bytes: equal exactly when the
# tensors are bitwise equal. The digits themselves change with the CPU's summation order, so
# compare them between ranks of one run, never between machines.)
#
# The tracer's count says the same: 3 all-reduces in 3 steps, the loss means the run records,
# and none of the gradients'. The bug is an off-by-one in the condition that should fire after
# the last micro-batch. Its opposite twin, `sync_every_microbatch`, fires after every
# micro-batch: the numbers are right, the traffic is doubled, and only a count shows it.

# %%
show_source(silent.never_sync)
calls = {}
for name in ("never_sync", "sync_every_microbatch"):
    for fix in (False, True):
        r = run_on_ranks(getattr(silent, name), fix, None, world_size=WORLD, timeout_s=60)
        same = len({tuple(x["checksums"]) for x in r}) == 1
        parity = loss_parity(r[0], reference, precision="fp32", terms=silent.B)
        calls[name, fix] = r[0]["all_reduce_calls"]
        print(f"{name:>22} {'mended' if fix else 'broken':>6}: all-reduce calls {r[0]['all_reduce_calls']:>2}, "
              f"replicas agree {same!s:>5}, parity with the single process {parity.ok}")
params = len(list(silent.tiny_model().parameters()))  # 4 tensors, one all-reduce each per sync
assert calls["never_sync", True] == silent.STEPS * (params + 1)  # one sync a step + the loss mean
assert calls["sync_every_microbatch", False] == silent.STEPS * (silent.ACCUM * params + 1)

# %% [markdown]
# ## 6. Case 5: everything agrees, and it is still wrong
#
# The same data-parallel run, on 4 ranks laid out as 2 nodes of 2. It finishes; the gradient
# checksums agree on every rank; every all-reduce is there.
#
# *Predict first:* which tool can still find a bug here?
#
# <details><summary>Answer</summary>
#
# Only the single process. The replicas agree with each other because they average the same
# (wrong) gradients; the counts are right because the communication is right. What is wrong
# is the data: each rank picked its shard with its *local* rank (its index on its node) where
# the global rank was meant, so ranks 0 and 2 train on the same rows and half the batch is
# never seen. Loss parity against the single process departs at step 1.
# </details>

# %%
runs = run_on_ranks(silent.overlapping_shards, False, None, world_size=WORLD, timeout_s=60)
print("rows each rank trains on:", [r["rows"] for r in runs])
print("replicas agree:", len({tuple(r["checksums"]) for r in runs}) == 1)
report = loss_parity(runs[0], reference, precision="fp32", terms=silent.B)
print(f"loss parity: departs at step {report.first_step}, {report.quantity} {report.got:.4f} against the "
      f"single process's {report.expected:.4f}")
assert report.first_step == 1 and report.quantity == "loss"

# %%
show_source(silent.overlapping_shards)
runs = run_on_ranks(silent.overlapping_shards, True, None, world_size=WORLD, timeout_s=60)
print("rows each rank trains on:", [r["rows"] for r in runs])
assert loss_parity(runs[0], reference, precision="fp32", terms=silent.B).ok
print("mended twin: parity holds")

# %% [markdown]
# ## 7. Loss parity: the method behind every test of this course
#
# Every strategy in notebooks 03-12 was proven the same way: same seed, same data, run it next
# to the single process, compare step by step. `course_lib.observe.parity.loss_parity(run,
# reference, precision, terms)` packages that as a tool you can point at your own strategy.
# The tolerance is derived, not tuned: summing n terms in floating point in another order
# moves the result by at most about 2(n - 1)·u relative (u the unit roundoff: 2⁻²⁴ for fp32,
# 2⁻⁸ for bf16; Higham 2002, §4.2), and each step adds one such rounding to the weights:
#
# $$|\text{loss}_k - \text{loss}_k^{\text{ref}}| \le k \cdot 2(n-1)\,u\,|\text{loss}_k^{\text{ref}}| + \text{atol}$$
#
# (atol for an optimizer that magnifies rounding, such as AdamW near a zero gradient:
# `course_lib.tolerances`).
#
# *Predict first:* with a batch of 48 values summed in fp32, how far may step 1's loss of a
# correct run move, relative to its size? And in bf16?

# %%
for precision in ("fp32", "bf16"):
    print(f"{precision}: step 1 within {parity_rtol(precision, silent.B):.1e} relative, step 3 within "
          f"{3 * parity_rtol(precision, silent.B):.1e}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# 2 · 47 · 2⁻²⁴ ≈ 5.6e-6 in fp32; in bf16 the same 94 roundings of 2⁻⁸ allow 0.37, as loose as
# a bug: a bf16 run is compared with an fp32 reference in its own precision's terms, and a
# tight check needs fp32 (which is why the course proves its strategies in fp32).
# </details>
#
# **Point it at your own strategy.** Below, a data parallelism written by hand for the course GPT
# (each rank its share of the batch, the gradients averaged after backward), 20 AdamW steps on
# 4 ranks, and the same with the average forgotten, both against the single process. Each rank
# reports the mean of the ranks' losses (the whole batch's loss), and its gradient norm.

# %%
GPT_CONFIG = GPTConfig.tiny(VOCAB_SIZE, n_layer=1, block_size=32)
CURVE = TrainConfig(steps=20, batch_size=8, lr=3e-3, progress=False)


def my_data_parallel(average: bool) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    model = GPT(GPT_CONFIG, seed=CURVE.seed)

    def sync():
        if not average:
            return  # the bug: each rank steps on its own share's gradient
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n

    def mean_over_ranks(loss):
        t = torch.tensor([loss])
        dist.all_reduce(t)
        return t.item() / n

    run = train_loop(model, make_optimizer(model, CURVE), CharDataset("train", GPT_CONFIG.block_size), CURVE,
                     StepHooks(sync_gradients=sync), rows=share_rows(rank, n, CURVE.batch_size),
                     report_loss=mean_over_ranks, record_grad_norms=True)
    return {"losses": run.train_losses, "grad_norms": run.grad_norms}


one = GPT(GPT_CONFIG, seed=CURVE.seed)
single = train_loop(one, make_optimizer(one, CURVE), CharDataset("train", GPT_CONFIG.block_size), CURVE,
                    record_grad_norms=True)
# fp32 losses summed over 8 x 32 tokens, plus AdamW's magnification of rounding (course_lib.tolerances)
tolerance = dict(precision="fp32", terms=CURVE.batch_size * GPT_CONFIG.block_size, atol=adamw_loss_atol(CURVE.lr))
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.plot(range(1, CURVE.steps + 1), single.train_losses, "k-", lw=3, alpha=0.4, label="single process")
for average, style in ((True, "b--"), (False, "r:")):
    mine = run_on_ranks(my_data_parallel, average, world_size=WORLD, timeout_s=120)[0]
    report = loss_parity(mine, single, **tolerance)
    label = "averaged" if average else "average forgotten"
    ax.plot(range(1, CURVE.steps + 1), mine["losses"], style, label=f"4 ranks, {label}")
    print(f"{label:>17}: " + ("parity holds over 20 steps" if report.ok else
                              f"departs at step {report.first_step}, first in the {report.quantity}"))
    assert report.ok == average
assert sum(mine["losses"]) > sum(single.train_losses)  # the forgotten average: above the reference on average
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.legend()
plt.show()

# %% [markdown]
# The forgotten average shows only as a loss curve a little above the single process's (the
# cell checks that it lies above on average): each replica still learns, from a quarter of the
# batch and so a noisier gradient, and nothing fails. Loss parity names it at step 1, from the
# gradient norm. The averaged strategy holds to the derived tolerance at every step.
#
# Every silent entry of the catalogue through the same test, rank by rank (`run_bug` runs an
# entry of the catalogue on gloo ranks and returns each rank's result):

# %%
for name, bug in BUGS.items():
    if bug.kind != "silent":
        continue
    run = run_bug(name, timeout_s=60)
    assert run.outcome == "completed", run
    reference_of_bug = bug.expected(run.world_size, run.bad_rank)
    reports = [loss_parity(r, reference_of_bug, precision="fp32", terms=silent.B) for r in run.results]
    off = [(rank, rep) for rank, rep in enumerate(reports) if not rep.ok]
    if not off:
        print(f"{name:>22}: parity holds on every rank")
        continue
    rank, rep = off[0]
    print(f"{name:>22}: rank {rank} departs at step {rep.first_step}: {rep.quantity} {rep.got:.4g} "
          f"against the reference's {rep.expected:.4g}")

# %% [markdown]
# One bug passes parity: `sync_every_microbatch` computes the right numbers, at twice the
# traffic. Parity proves the numbers; the tracer's counts prove the cost. A strategy needs both.
# `unsynced_dropout` departs on rank 1 only: rank 0 happens to draw the reference's mask.
#
# ## 8. The whole catalogue, and the torchrun form
#
# Twelve bugs, each a small rank function with its one line and its mended twin in
# `course_lib.debugging` (the table is printed from it):

# %%
rows = ["| bug | kind | symptom | found with | the line | mended |", "|---|---|---|---|---|---|"]
for bug in BUGS.values():
    rows.append(f"| `{bug.name}` | {bug.kind} | {bug.symptom} | {bug.tool} | `{bug.bug}` | `{bug.fix}` |")
display(Markdown("\n".join(rows)))

# %% [markdown]
# Every mended twin, run on its ranks, equals the single process (or the values one process
# computes for it):

# %%
for name in BUGS:
    run = run_bug(name, fixed=True, timeout_s=30)
    assert run.outcome == "completed" and run.evidence.matches, run
print(f"all {len(BUGS)} mended twins match the single process")

# %% [markdown]
# **The torchrun form.** On a cluster the ranks are processes `torchrun` starts, maybe on many
# machines, and no notebook is there to collect them. `course_lib.demos.broken_run` runs any
# entry that way; with `--flight-recorder DIR` every rank writes its recorder to `DIR` (a rank
# stuck for `--timeout / 2` seconds, or leaving), and after `--timeout` seconds each rank gives
# up with exit status 1. The analysis then reads the files, from the command line:
#
# ```bash
# torchrun --nproc-per-node 2 -m course_lib.demos.broken_run --bug skip_collective --timeout 4 --flight-recorder DIR
# python -m course_lib.observe.flight_recorder DIR
# ```
#
# Run for real here, on 2 gloo ranks; what the command prints is what a terminal shows, the
# culprit first:

# %%
fr_dir = tempfile.mkdtemp(prefix="flight-")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo CPU ranks, also on a GPU machine
job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "-m", "course_lib.demos.broken_run", "--bug", "skip_collective", "--timeout", "4",
                      "--flight-recorder", fr_dir], capture_output=True, text=True, timeout=180, env=ENV)
print("torchrun exit status:", job.returncode, "| dump files:", sorted(p.name for p in pathlib.Path(fr_dir).glob("*.json")))
cli = subprocess.run([sys.executable, "-m", "course_lib.observe.flight_recorder", fr_dir], capture_output=True,
                     text=True, timeout=120, env=ENV)
print(cli.stdout)
assert "Warning" not in cli.stderr, cli.stderr  # the terminal's first line is the analysis
assert job.returncode != 0 and cli.stdout.startswith("rank 1 never entered all_reduce #3 on group [0, 1] that rank 0")

# %% [markdown]
# **`TORCH_DISTRIBUTED_DEBUG=DETAIL`.** The same demo with `reorder_collectives` and PyTorch's
# own check switched on: the process group exchanges a fingerprint of each collective (op,
# shapes, dtypes, sequence number) before running it, and a mismatch is an error on every rank
# instead of a hang (rank 0's message, shortened):

# %%
job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "-m", "course_lib.demos.broken_run", "--bug", "reorder_collectives", "--timeout", "20"],
                     capture_output=True, text=True, timeout=180, env={**ENV, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
mismatch = [l for l in (job.stdout + job.stderr).splitlines() if l.startswith("[rank0]") and "Detected mismatch" in l]
assert job.returncode != 0 and mismatch, (job.stdout + job.stderr)[-3000:]
short = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?\)\)\)", ")", mismatch[0].split("RuntimeError: ")[1])
print(textwrap.fill(short, 100))

# %% [markdown]
# ## 9. PyTorch's own flight recorder, beside the course's
#
# The course's recorder is a small Python copy of one PyTorch ships in C++, inside the process
# group itself: every collective goes into a ring buffer of the process (its length:
# `TORCH_FR_BUFFER_SIZE`, called `TORCH_NCCL_TRACE_BUFFER_SIZE` in older releases; 0 turns it
# off), whose contents `torch._C._distributed_c10d._dump_fr_trace()` returns as a pickle, one file
# per rank. Its analyser lines the files up, as the course's does:
#
# ```bash
# python -m torch.distributed.flight_recorder.fr_trace DIR
# ```
#
# It was built for NCCL; the gloo process group records into it too. Below, Case 1 once more
# (rank 2 skips all-reduce #3 on 4 ranks), in **one run with both recorders on**: every rank runs
# under the course's recorder, and each dump it writes first writes PyTorch's buffer beside it.
# The parent's timeout is still the only clock: when it passes, the parent asks for the dumps and
# waits for them, and both analysers read the same moment of the same run.
#
# *Predict first:* both will name rank 2 and all-reduce #3. What can each say that the other
# cannot? Think of where each one sits: the course's in the rank's Python, around the call;
# PyTorch's in C++, inside the process group.
#
# <details><summary>Answer</summary>
#
# The course's recorder notes each call's state as the rank's Python sees it, issued or
# completed, so its analysis says who is still waiting (ranks 0, 1 and 3) and what the culprit
# did last (all-reduce #2, completed). PyTorch's keeps the Python stack of every call, so its
# analysis says where in the program the call was made (the catalogue's `skip_collective`). Under
# gloo no entry is ever marked started or completed (on NCCL the watchdog marks them, from each
# collective's CUDA events), so fr_trace's report cannot tell a rank that waits from one that has
# left.
# </details>

# %%
MISSING = torch_recorder_missing()  # None, or one sentence: this torch's gloo does not record, or has no analyser
print(MISSING or f"torch {torch.__version__}: gloo records into PyTorch's flight recorder; its analyser: {ANALYSER} DIR")
side = None if MISSING else compare_recorders("skip_collective", rank=BAD, world_size=WORLD, timeout_s=TIMEOUT_S)
if side is not None:
    print("\nthe course's analysis:")
    print(side.course_analysis)
    print("\nfr_trace, its first finding (up to the call's stack):")
    print(side.torch_report)
    print("\nthe course names:", side.course)
    print("PyTorch's names: ", side.torch)
    assert side.agree and side.course == Verdict(BAD, "all_reduce", 3, tuple(range(WORLD)))

# %% [markdown]
# One rank, one call, one sequence number: both count the world group's collectives from the
# start of the run, because the ranks were started afresh for it (PyTorch numbers a group's calls
# from the group's creation, the course from its recorder's start; in a long-lived process the two
# numbers differ by the calls made before). Now what each sees that the other does not, read from
# the same run:

# %%
if side is not None:
    others = tuple(r for r in range(WORLD) if r != BAD)
    print(f"only the course's: ranks {list(side.waiting)} wait in the call, and the culprit's last call "
          f"was {side.course_analysis.split('its last call: ')[1].rstrip(')')}")
    print(f"PyTorch's entries carry the states {list(side.torch_states)}: none started or completed, so "
          f"fr_trace's report cannot say who waits")
    print(f"only PyTorch's: the Python stack of the call, down to {side.call_site}")
    assert side.waiting == others and side.torch_states == ("scheduled",) 
    assert side.call_site == "skip_collective in hangs.py"
    if side.filled:
        print(f"and one catch: on the dumps as gloo wrote them, fr_trace stops with {side.raw_error}: gloo "
              f"notes its group before torch.distributed names it, so the dumps' group table is empty; "
              f"it was filled in from torch.distributed's own before the analysis above")
    assert side.filled == side.raw_error.startswith("KeyError")

# %% [markdown]
# So at work: the course's way (a recorder around the Python calls: the waiting ranks and the
# culprit's last call) works the same on any backend; PyTorch's is already inside the process
# group, cheap enough that large jobs leave it on, and on NCCL adds the states and times the GPU
# reports. With NCCL, `TORCH_NCCL_DUMP_ON_TIMEOUT=1` has the watchdog write every
# rank's buffer to `TORCH_FR_DUMP_TEMP_FILE` + rank (for example `/shared/fr/rank_`) when a
# collective times out, and `fr_trace /shared/fr` is the first command of the post-mortem.
#
# **The switches of 2026 practice**, each with what it is for (PyTorch's
# [NCCL environment variables](https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html),
# NCCL's [logging](https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/logging.html),
# PyTorch's [CUDA memory page](https://docs.pytorch.org/docs/stable/torch_cuda_memory.html)):
#
# | switch or tool | what it is for | where |
# |---|---|---|
# | `TORCH_FR_BUFFER_SIZE=N` (older: `TORCH_NCCL_TRACE_BUFFER_SIZE`) | PyTorch's flight recorder: each process keeps its last N collectives | NCCL; gloo in recent releases |
# | `TORCH_NCCL_DUMP_ON_TIMEOUT=1`, `TORCH_FR_DUMP_TEMP_FILE=DIR/rank_` | on a collective's timeout, every rank writes its buffer to a file, for `fr_trace DIR` | NCCL |
# | `TORCH_NCCL_DESYNC_DEBUG=1` | on a timeout, the watchdog reports which rank is out of step with the others (the culprit of a desync) | NCCL |
# | `TORCH_NCCL_ENABLE_MONITORING=1`, `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=S` | heartbeat monitoring: a second thread ends the process when the watchdog itself has given no heartbeat for S seconds (stuck in a CUDA or NCCL call), so a hang frees the machines instead of holding them | NCCL |
# | `TORCH_DISTRIBUTED_DEBUG=DETAIL` | each collective's fingerprint checked across ranks before it runs: a mismatch is an error, not a hang (section 8) | any backend |
# | `NCCL_DEBUG=INFO` (or `WARN`), `NCCL_DEBUG_SUBSYS=INIT,NET` | NCCL's own log: its version, the topology and rings it chose, network errors; SUBSYS keeps the subsystems named | NCCL |
# | `py-spy dump --pid PID` | every Python thread's stack of a live, hung process, read from outside without stopping it: where each rank is in the code | any Python process |
# | `torch.cuda.memory._record_memory_history()`, then `torch.cuda.memory._dump_snapshot("snap.pickle")` | a CUDA memory snapshot: every live allocation with the stack that made it, and the history before; drop the file on [pytorch.org/memory_viz](https://pytorch.org/memory_viz) | CUDA |
# | `dist.monitored_barrier(timeout=...)` | which rank never arrives at a point of the program (section 2) | gloo |
#
# ## 10. At scale: Llama 3's flight recorder
#
# Dubey et al. (2024, §3.3.4) describe training Llama 3
# 405B on up to 16,384 H100 GPUs: in a 54-day snapshot of pre-training, 466 job interruptions,
# 419 of them unexpected, about one every three hours, most from hardware. Among the tools they
# name for finding the stuck or slow ranks quickly is PyTorch's NCCL flight recorder, the one of
# section 9, used to diagnose hangs and performance problems at scale. At 16,384 ranks, "which
# rank never entered all-reduce #n" is the only question one can afford to ask first.
#
# ## What to remember
#
# * A timeout names the ranks that waited; the culprit is usually the one it does not name.
# * Line the ranks up by group and sequence number (the flight recorder): its first line names
#   the culprit, the rank and the call it never entered (or called differently), and who waits
#   for it. `monitored_barrier` names a rank that never arrives.
# * PyTorch's own recorder sits inside the process group (`fr_trace DIR` reads its dumps): it
#   names the same rank and call, with the call's Python stack; the course's adds who waits.
# * Every rank calls every collective, in one order, on the group it takes from the mesh.
# * Silent bugs need a reference: the gradient norm (a factor of N is a sum for a mean),
#   per-rank checksums (replicas must agree bitwise), loss parity with the single process
#   (for what everything else misses), and the tracer's counts (for the right numbers at the
#   wrong cost).
#
# ## Self-check
#
# 1. A job on 64 ranks times out; the error lists 63 stuck ranks. Where do you look first?
# 2. The flight recorder says: "rank 6 called reduce_scatter [1024] float32 #12 on group
#    [4, 5, 6, 7] where ranks 4, 5, 7 wait in all_gather [1024] float32". Name the bug and the fix.
# 3. A data-parallel run on 8 ranks shows a gradient norm 8 times the single process's at
#    step 1 and a loss curve that looks normal under AdamW. What is wrong?
# 4. The replicas' gradient checksums agree and the loss departs from the single process at
#    step 1. Which bugs of the catalogue fit, and which are excluded?
# 5. Why does a check that every rank calls the same collective (`TORCH_DISTRIBUTED_DEBUG=DETAIL`)
#    cost more than a flight recorder, and why can it still not replace loss parity?
# 6. On a gloo job, `fr_trace` names rank 5 missing from all-reduce #40, and the job's ranks are
#    all still alive. Which of them are waiting in that all-reduce, and how would you find out?
#
# <details><summary>Answers</summary>
#
# 1. At the one rank not listed: the 63 wait in a collective it never entered (section 2).
#    The flight recorder says which call it skipped.
# 2. `reorder_collectives` (or a branch that skips one call and the next call stands in for
#    it): rank 6's 12th call on that group is not the others'. Make every rank issue the
#    group's collectives in one order, fixed by the program, not by the rank's own state.
# 3. `sum_not_avg`: the gradients are summed over 8 ranks, not averaged. Divide by the world
#    size (gloo has no AVG).
# 4. Data bugs: `overlapping_shards` (same rows on two ranks), or a wrong loss normalisation.
#    Excluded: `never_sync` and `unsynced_dropout` (replicas would disagree), the hangs.
# 5. It adds a collective (a fingerprint exchange) before every call, doubling the number of
#    round trips; the recorder only writes to local memory. And it checks the calls, not the
#    data: a run with every call right and the wrong shards passes it.
# 6. Its report cannot say: gloo marks no entry started or completed, so fr_trace only knows who
#    issued call #40 and who did not. The course's recorder (issued or completed, per rank), or
#    `py-spy dump --pid` on each rank's process, shows who sits inside the all-reduce.
# </details>
#
# ## References
#
# * Dubey, A. et al. (2024). *The Llama 3 Herd of Models*, arXiv:2407.21783, §3.3.4
#   (reliability and operational challenges: interruptions of the 405B run, the NCCL flight
#   recorder).
# * Higham, N. J. (2002). *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM, §4.2:
#   the error bound of a floating-point sum behind loss parity's tolerance.
# * Li, S. et al. (2020). *PyTorch Distributed: Experiences on Accelerating Data Parallel
#   Training*, PVLDB 13(12): why every rank must issue the same collectives in the same order.
# * PyTorch documentation, [*Distributed communication package*](https://pytorch.org/docs/stable/distributed.html):
#   `monitored_barrier` and `TORCH_DISTRIBUTED_DEBUG`.
# * PyTorch documentation, [*ProcessGroupNCCL environment variables*](https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html):
#   `TORCH_NCCL_DUMP_ON_TIMEOUT`, `TORCH_NCCL_DESYNC_DEBUG`, `TORCH_NCCL_ENABLE_MONITORING`,
#   `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`, the trace buffer's size.
# * PyTorch documentation, [*Understanding CUDA memory usage*](https://docs.pytorch.org/docs/stable/torch_cuda_memory.html):
#   memory snapshots and pytorch.org/memory_viz.
# * NVIDIA, [*NCCL user guide: logging*](https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/logging.html):
#   `NCCL_DEBUG`, `NCCL_DEBUG_SUBSYS`.
# * B. Frederickson, [*py-spy*](https://github.com/benfred/py-spy): a sampling profiler whose
#   `dump --pid` prints a live process's Python stacks.
#
# Further reading:
#
# * C. Pandya and J. Wang (2024), [*Flight Recorder for Debugging Stuck Jobs*](https://docs.pytorch.org/tutorials/prototype/flight_recorder_tutorial.html)
#   (PyTorch tutorials): the recorder of section 9, its environment variables and its analyser
#   `fr_trace`.
# * Jiang, Z. et al. (2024). *MegaScale: Scaling Large Language Model Training to More Than
#   10,000 GPUs*, NSDI: how a production team detects stragglers and hangs.
#
# **Next:** exercise 14 (`exercises/ex14_debugging.ipynb`) hands you three broken runs (one
# hang, two silent) with their evidence: name each bug and write its fix, graded on real
# ranks. Then notebook 15, the capstone, puts every strategy of the course in one run.
