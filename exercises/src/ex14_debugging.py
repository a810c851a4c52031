# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex14_debugging.ipynb)

# %% [markdown]
# # Exercise 14: three broken runs
#
# **Goal.** Three data-parallel training runs of the course GPT on 2 ranks went wrong: one
# hangs, two finish with numbers that are quietly wrong. For each you get the evidence a
# practitioner would collect (loss curves against the single process, gradient norms, per-rank
# checksums, the flight recorder's dumps), then the code that ran. In
# `exercises/ex14_debugging/student.py`:
#
# 1. `name_the_bugs()`: name each run's bug, with one of the catalogue's names (below);
# 2. write the fix of each run as the small function the run needs:
#    `average_gradients(model)` (run 1), `should_stop(local_loss, target)` (run 2) and
#    `accumulation_step(model, optimizer, micro_batches)` (run 3). One fix goes further than
#    mending: run 1's code makes one collective call per parameter, and yours must make **one
#    call per step** for the whole model, however many parameters it has.
#
# Re-read notebook 14: §1 (how a run fails, and which tool finds what), §2 (reading the flight
# recorder's analysis of a hang), §4 and §5 (what a wrong gradient norm and diverging checksums
# mean), §7 (loss parity) and §8 (the whole catalogue, symptom by symptom).
#
# The catalogue's names: `skip_collective`, `reorder_collectives`, `wrong_group`,
# `microbatches_below_stages`, `zero_token_expert`, `sync_every_microbatch`, `never_sync`,
# `sum_not_avg`, `unsynced_dropout`, `overlapping_shards`, `nan_on_one_rank`, `uneven_oom`.
#
# **Every run** is data parallelism (notebook 03): each of N ranks takes its 1/N share of the
# global batch the single process draws, computes its own loss (a mean over its share) and
# gradients, and the ranks must then agree so that the run equals one process training on the
# whole batch. The single process is the reference every curve below is drawn against.
#
# **Think first.** A data-parallel run ends with its loss curve on top of the single process's,
# step for step, but its gradient norm is twice the reference's at every step. How can the loss
# be right when the gradients are not?
#
# <details><summary>Answer</summary>
#
# AdamW divides each gradient by the root of its running mean square, so multiplying every
# gradient by the same constant barely changes the update (only through ε and through the
# clipping threshold, which the larger norm now crosses more often). The loss curve hides the
# bug; the gradient norm, or a comparison of the gradients themselves at step 1, shows it.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your fixes run on real ranks, 2 and 4, and
# are compared with the single process on the same data: the gradients after one backward (and
# the gradient each accumulated step applies), the losses after a few AdamW steps, the decision
# to stop and the step each rank stops at, the replicas' parameters, and the calls and bytes
# each step sends. Edit `student.py`, then
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
%matplotlib inline
import inspect
import tempfile

import matplotlib.pyplot as plt

from course_lib.grading import ex14_debugging as checks
from course_lib.grading import load_student
from course_lib.observe.flight_recorder import analyse, load_dumps
from course_lib.runtime import HangAnalysed, run_on_ranks, run_recorded
from course_lib.train import TrainConfig

# Your module may not import the catalogue of broken runs and their mended twins, nor the
# library's data parallelism (checks.REFUSE lists them): the checks must pass on your own code.
student = load_student("ex14_debugging", refuse=checks.REFUSE)
STEPS = 20  # steps of each run's evidence
CLIPPED = TrainConfig(steps=STEPS, batch_size=8, lr=3e-3, grad_clip=1.0, progress=False)
UNCLIPPED = TrainConfig(steps=STEPS, batch_size=8, lr=3e-3, grad_clip=0.0, progress=False)
RANKS = dict(world_size=2, backend="gloo", timeout_s=120)


def calls_per_rank(dump_dir):
    """What the flight recorder saw on each rank, from its dump file: {rank: {op: calls}}. The
    buffer keeps a rank's last 256 calls, so larger counts show as 256."""
    counts = {}
    for rank, entries in sorted(load_dumps(dump_dir).items()):
        counts[rank] = {}
        for e in entries:
            counts[rank][e["op"]] = counts[rank].get(e["op"], 0) + 1
    return counts


def plot(ax, reference, run, ylabel):
    steps = range(1, len(reference) + 1)
    ax.plot(steps, reference, "k-", label="single process")
    ax.plot(steps, run, "r--", label="2 ranks (mean over the ranks)")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend()

# %% [markdown]
# ## Run 1: the evidence
#
# 2 ranks, 20 steps of AdamW with gradient clipping at norm 1, under the flight recorder
# (each rank writes its last calls to a file when it leaves). The run finished without an error.

# %%
dump_1 = tempfile.mkdtemp(prefix="run1-")
run1 = run_recorded(checks.train_with_sync, checks.run_1_sync, CLIPPED, dump_dir=dump_1, **RANKS)
ref1 = checks.train_with_sync(None, CLIPPED)
print("flight recorder:", analyse(load_dumps(dump_1)))
print("calls per rank: ", calls_per_rank(dump_1))
print("replicas equal after the run (parameter checksums):", run1[0]["checksum"] == run1[1]["checksum"])
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
plot(axes[0], ref1["losses"], checks.rank_mean(run1), "training loss")
plot(axes[1], ref1["grad_norms"], run1[0]["grad_norms"], "gradient norm (before clipping)")
plt.show()

# %% tags=["nbval-ignore-output"]
ratio = run1[0]["grad_norms"][0] / ref1["grad_norms"][0]
gap = max(abs(a - b) for a, b in zip(checks.rank_mean(run1), ref1["losses"]))
print(f"step 1: gradient norm {run1[0]['grad_norms'][0]:.4f} against the reference's {ref1['grad_norms'][0]:.4f} "
      f"(ratio {ratio:.4f}); largest loss gap over {STEPS} steps: {gap:.4f}")
assert abs(ratio - 2) < 1e-3  # step 1, before any update: the same gradients, summed in another order

# %% [markdown]
# ## Run 1: the code that ran
#
# The training loop is the course's (`train_loop`, notebook 03): forward, backward, then this
# function, then clipping and the AdamW step.

# %%
print(inspect.getsource(checks.run_1_sync))

# %% [markdown]
# ## Run 2: the evidence
#
# The same training with early stopping: after each step every rank asks whether the loss is
# below 3.3 and, if so, leaves the loop. The run never finished: the parent gave up after 12
# seconds, the flight recorder's dumps were analysed. Below, also the ranks' own losses in the
# first 12 steps, from the same run with the stopping rule switched off.

# %%
dump_2 = tempfile.mkdtemp(prefix="run2-")
try:
    run_recorded(checks.train_until, checks.run_2_should_stop, dump_dir=dump_2, world_size=2, backend="gloo",
                 timeout_s=12, stuck_after_s=4)
    hang = None
except HangAnalysed as err:
    hang = err
    print("the run timed out; stuck ranks:", err.stuck_ranks)
    print(err.analysis)
assert hang is not None, "run 2 should hang"
free = run_on_ranks(checks.train_until, lambda loss, target: False, checks.TARGET, 12, **RANKS)
for rank, r in enumerate(free):
    print(f"rank {rank}: below {checks.TARGET} at steps", [s + 1 for s, loss in enumerate(r["losses"]) if loss < checks.TARGET])

# %% [markdown]
# ## Run 2: the code that ran

# %%
print(inspect.getsource(checks.run_2_should_stop))
print(inspect.getsource(checks.train_until))

# %% [markdown]
# ## Run 3: the evidence
#
# Gradient accumulation: each rank's share of the batch (4 rows) is cut into 2 micro-batches
# of 2 rows, one optimizer step after both. No clipping. The run finished without an error.

# %%
dump_3 = tempfile.mkdtemp(prefix="run3-")
run3 = run_recorded(checks.train_accumulating, checks.run_3_step, 2, UNCLIPPED, dump_dir=dump_3, **RANKS)
ref3 = checks.train_accumulating(None, cfg=UNCLIPPED)
print("flight recorder:", analyse(load_dumps(dump_3)))
print("calls per rank: ", calls_per_rank(dump_3))
same = [a == b for a, b in zip(run3[0]["checksums"], run3[1]["checksums"])]
print("replicas equal after each step (parameter checksums):", same[:5], "...")
fig, ax = plt.subplots(figsize=(5, 3.2))
plot(ax, ref3["losses"], checks.rank_mean(run3), "training loss")
plt.show()

# %% tags=["nbval-ignore-output"]
print("rank 0's checksums:", [round(c, 4) for c in run3[0]["checksums"][:4]], "...")
print("rank 1's checksums:", [round(c, 4) for c in run3[1]["checksums"][:4]], "...")
above = sum(a > b for a, b in zip(checks.rank_mean(run3), ref3["losses"]))
print(f"the mean over the ranks is above the single process at {above} of {STEPS} steps")
assert not any(same)  # the replicas drift apart from step 1 on: they never exchange a byte

# %% [markdown]
# ## Run 3: the code that ran

# %%
print(inspect.getsource(checks.run_3_step))

# %% [markdown]
# ## Check 1: name the bugs
#
# `name_the_bugs()` returns `{"run 1": NAME, "run 2": NAME, "run 3": NAME}`.

# %%
checks.check_names(student)

# %% [markdown]
# ## Check 2: run 1 mended
#
# `average_gradients(model)` runs after backward on 2 and 4 ranks: every rank's gradients must
# equal the gradient of the whole batch computed by one process (to fp32 rounding), each step
# must make one collective call, and 3 AdamW steps must give the single process's losses.

# %%
checks.check_sync(student)

# %% [markdown]
# ## Check 3: run 2 mended
#
# `should_stop(local_loss, target)` first on ranks holding losses chosen by hand (the decision
# must be the same on every rank, and the global batch's), then in run 2 itself: every rank
# must stop at the step the single process stops at, with nothing left waiting.

# %%
checks.check_stop(student)

# %% [markdown]
# ## Check 4: run 3 mended
#
# `accumulation_step(model, optimizer, micro_batches)` for 3 steps of 2, then of 4,
# micro-batches on 2 ranks: the replicas must stay bitwise equal, the gradient of step 1 must be
# the whole batch's, the losses must equal the single process's, and each step must all-reduce
# one gradient's worth of bytes: a fix that synchronises after every micro-batch gives the right
# numbers at several times the traffic, and fails here.

# %%
checks.check_accumulate(student)

# %% [markdown]
# ## Having mended them, compare with the catalogue
#
# All checks passed? Then you have found and fixed three of the bugs practitioners lose the
# most days to. Compare your fixes with the course's own:
#
# * the catalogue of broken runs and their mended twins (notebook 14, §8), where each of the
#   three entries you named has a one-line bug and its fix, and the torchrun demo
#   `course_lib.demos.broken_run` that runs any of them from the command line;
# * `course_lib/parallel/dp/`: how the course's data parallelism averages (bucketed, one
#   all-reduce per bucket) and how its `no_sync` defers the all-reduce to the last micro-batch.
#
# Two questions to take back to notebook 14: in run 2, why would "stop when *any* rank's loss is
# below the target" (an all-reduce with `MIN`) also cure the hang, and why is it still the wrong
# fix? And in run 3, what would the flight recorder's call counts have looked like had the
# condition been `i < len(micro_batches)` (the bug `sync_every_microbatch`)?
