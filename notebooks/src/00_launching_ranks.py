# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/00_launching_ranks.ipynb)

# %% [markdown]
# # 00 · Launching ranks
#
# Every strategy in this course (data, tensor, pipeline and expert parallelism, ZeRO) is a
# way for several **processes** to cooperate on one training run. Before any of them, we need
# those processes, a way for them to talk, and a way to see what they say.
#
# **After this notebook you can**
#
# * explain what a *rank*, the *world size*, a *process group* and a *backend* are;
# * run a function you wrote on 2, 4 or 8 ranks and get its results back in rank order;
# * predict what an **all-reduce** leaves on every rank, and count its bytes with `CommTracer`;
# * read a per-rank timeline and explain why a synchronous step runs at the pace of the
#   slowest rank;
# * recognise a failing rank, a stuck rank and mismatched collectives from the errors they raise;
# * launch the same code on GPUs with `torchrun`;
# * train the reference model that every later notebook parallelises.
#
# Everything here runs for real: separate operating-system processes talking over the
# loopback network with PyTorch's **gloo** backend. The notebooks use these CPU ranks even on a
# machine with GPUs, so that every machine prints the same numbers; on GPUs the same code runs
# over **NCCL** (section 5 says how).

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
import os
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from course_lib import (CommTracer, RankError, RankTimeout, Timeline, format_summary, make_mesh,
                        merge_summaries, mesh_groups, plot_gantt, run_on_ranks)

torch.manual_seed(0)
%matplotlib inline

# %% [markdown]
# ## 1. Ranks, world size, process group
#
# * A **rank** is one process taking part in training, numbered `0 … N-1`.
# * The **world size** `N` is how many ranks there are.
# * A **process group** is a set of ranks that can run *collectives* together (all-reduce,
#   broadcast, all-gather, …). The *default* group holds every rank; later notebooks carve
#   out sub-groups (the ranks sharing one tensor-parallel layer, say).
# * A **backend** moves the bytes: `gloo` works on CPUs (what we use here), `nccl` on NVIDIA
#   GPUs. Ranks first meet at a *rendezvous* (an address and port on rank 0), then connect.
#
# `course_lib.run_on_ranks(fn, world_size=N)` starts `N` processes, joins them into the
# default process group, runs `fn` on each and returns the `N` results **in rank order**.
# The function can be defined right here in the notebook. The ranks are CPU processes talking
# gloo unless you ask for GPUs: `run_on_ranks(fn, world_size=N, backend="nccl")` puts rank `r` on
# GPU `r` of this machine (it needs one GPU per rank).

# %%
def whoami():
    """Runs on every rank."""
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "pid": os.getpid()}

for n in (2, 4, 8):
    results = run_on_ranks(whoami, world_size=n)
    assert [r["rank"] for r in results] == list(range(n))
    assert len({r["pid"] for r in results}) == n and os.getpid() not in {r["pid"] for r in results}
    print(f"world_size={n}: ranks {[r['rank'] for r in results]}, backend {results[0]['backend']}, "
          f"{n} distinct processes")

# %% [markdown]
# Each rank is a separate process (distinct process ids, none of them this notebook's).
#
# **What the ranks print.** Ranks run at the same time, so their prints would interleave
# differently on every run. `run_on_ranks` captures each rank's output and prints it here,
# grouped by rank and in rank order, so the text is the same every time:

# %%
def greet():
    time.sleep(0.02 * (3 - dist.get_rank()))  # rank 3 finishes first...
    print(f"hello from rank {dist.get_rank()} of {dist.get_world_size()}")

_ = run_on_ranks(greet, world_size=4)  # ...but the output still comes in rank order

# %% [markdown]
# **Why the first call is slower.** Starting a process and importing PyTorch takes time, so
# the ranks of one world size stay alive between calls (a *pool*): the first call pays for
# start-up, later calls only send the function and collect the results.
#
# *Predict first:* how many times slower than a later call is the first call on 4 ranks:
# about the same, a few times, or more than ten times?
#
# <details><summary>Answer</summary>
#
# Many times slower: the first call starts 4 Python processes that import PyTorch and meet at
# the rendezvous (the course keeps PyTorch pre-imported in a parent process, so this takes
# about a tenth of a second rather than several seconds), while a later call only pickles a
# function to ranks already waiting, a few milliseconds. Your exact numbers depend on the
# machine and its load.
# </details>

# %% tags=["nbval-ignore-output"]
from course_lib.runtime import shutdown_pools

shutdown_pools()
t0 = time.perf_counter(); run_on_ranks(whoami, world_size=4); first = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(10):
    run_on_ranks(whoami, world_size=4)
again = (time.perf_counter() - t0) / 10
print(f"first call on 4 ranks: {first:.2f} s;  each later call: {again * 1e3:.0f} ms")

# %% [markdown]
# ## 2. Hello, all-reduce
#
# **All-reduce** is the collective data parallelism is built on: every rank contributes a
# tensor, and every rank receives the element-wise *sum* (or mean, max, …) of all of them.
#
# ```
#  before:  rank0 [1]   rank1 [2]   rank2 [3]   rank3 [4]
#  after:   rank0 [10]  rank1 [10]  rank2 [10]  rank3 [10]      (1+2+3+4)
# ```
#
# The course's `CommTracer` records every `torch.distributed` call made inside its block:
# op, dtype, element count and bytes.
#
# *Predict first:* 4 ranks, rank `r` fills a tensor of 1,000 float32 values with `r + 1` and
# all-reduces it. What does every rank hold afterwards, and how many bytes does the tracer
# record for each rank's call?
#
# <details><summary>Answer</summary>
#
# Every element on every rank is `1 + 2 + 3 + 4 = 10` (in general `N(N+1)/2`), and each rank's
# call carries its 1,000 × 4 = 4,000-byte buffer. That is the size of the buffer handed to
# the collective, not what crosses the wire (notebook 02).
# </details>

# %%
def hello_all_reduce(numel):
    t = torch.full((numel,), float(dist.get_rank() + 1))
    with CommTracer() as tracer:
        dist.all_reduce(t)          # sum over ranks, in place
    return t[0].item(), tracer.summary()

n, numel = 4, 1000
results = run_on_ranks(hello_all_reduce, numel, world_size=n)
values = [v for v, _ in results]
print("every rank now holds:", values)
assert values == [n * (n + 1) / 2] * n

merged = merge_summaries([s for _, s in results])
print(format_summary(merged))
assert merged["all_reduce"]["calls"] == [1] * n
assert merged["all_reduce"]["bytes_sent"] == [numel * 4] * n   # 1000 float32 = 4000 bytes

# %% [markdown]
# The tracer shows one `all_reduce` per rank with 4,000 bytes in and out: the *logical*
# payload, the size of the buffer each rank hands to the collective. How many bytes really
# cross the wire depends on the algorithm the backend uses; notebook 02 builds those
# algorithms from point-to-point sends, where the tracer counts every byte, and shows why a
# ring moves `2(N-1)/N` times the buffer per rank.
#
# **Timelines.** Later notebooks ask *when* things happen: does communication overlap
# compute? where are the pipeline bubbles? Each rank can record spans in a `Timeline`, and
# the tracer adds every collective to it; the parent draws them on one time axis.
#
# Below, the 4 ranks start together (a barrier), then rank `r` "computes" for
# `(r + 1) × 40 ms` (a sleep stands in for a slower device or a longer batch, so the
# difference shows the same on any machine), then all of them all-reduce.
#
# *Predict first:* which rank's all-reduce bar is the longest, and when does each rank's
# all-reduce end?
#
# <details><summary>Answer</summary>
#
# Rank 0's, the rank with the least work: it enters the all-reduce first and then waits
# about 120 ms for rank 3 to arrive. Every rank's all-reduce ends at about the same moment,
# shortly after rank 3 joins: nobody can have the sum before everyone contributed.
# </details>

# %%
WORK_S = 0.04

def unequal_work_then_reduce():
    tl = Timeline()
    x = torch.ones(1000)
    dist.barrier()                                        # start together
    with tl.span("compute", "compute"):
        time.sleep(WORK_S * (dist.get_rank() + 1))       # rank r works (r + 1) x 40 ms
    with CommTracer(timeline=tl):
        dist.all_reduce(x)
    return tl.events

# check_collectives=False: run_on_ranks normally checks each collective's shape across the
# ranks first (section 3); that check is a small exchange of its own, and the waiting would
# happen inside it, before the all-reduce bar starts.
events = run_on_ranks(unequal_work_then_reduce, world_size=4, check_collectives=False)
plot_gantt(events, title="all-reduce waits for the slowest rank")
plt.show()
slowest_compute_end = max(ev[0][2] for ev in events)
# Causality, not timing (one system-wide clock): no rank's all-reduce ends before rank 3 has joined it
assert all(ev[1][2] >= slowest_compute_end for ev in events)

# %% tags=["nbval-ignore-output"]
(_, start0, end0, _), (_, c_start, c_end, _) = events[0]  # rank 0: compute, all_reduce
print(f"rank 0: all-reduce bar {(c_end - c_start) * 1e3:.0f} ms, of which {(slowest_compute_end - c_start) * 1e3:.0f} ms "
      f"before rank 3 joined; rank 3's bar: {(events[3][1][2] - events[3][1][1]) * 1e3:.0f} ms")

# %% [markdown]
# Rank 0 reached the all-reduce first, and its red bar cannot end before rank 3 has joined
# (the first cell asserts this for every rank): rank 0 spends the difference in work, about
# 120 ms, *waiting* (the cell above prints this run's times); rank 3's bar is short, and the
# four bars end at about the same moment. That is the first lesson about synchronous
# training: the step runs at the pace of the slowest rank, and every faster rank idles for
# the difference.
#
# ## 3. When a rank fails, or gets stuck
#
# Distributed bugs usually show up as one rank raising while the others sit in a
# collective, waiting forever for it. `run_on_ranks` turns both cases into errors in the
# notebook:
#
# * an exception on any rank raises `RankError`, naming the rank(s), with their tracebacks;
# * ranks still running after `timeout_s` raise `RankTimeout`, naming the stuck ranks.
#
# Either way the ranks are stopped and the next call starts fresh: the kernel never hangs.
#
# *Predict first:* below, rank 2 raises before a barrier that ranks 0, 1 and 3 call. Which
# ranks does the `RankError` name, and does the notebook sit out the whole `timeout_s=30`?
#
# <details><summary>Answer</summary>
#
# Only rank 2: ranks 0, 1 and 3 raised nothing, they were waiting in the barrier. And no
# 30-second wait: as soon as one rank reports an exception, the others get a short grace
# period (a couple of seconds) to report too, then they are stopped and the error is raised.
# The timeout is only for ranks that neither finish nor fail.
# </details>

# %%
def fails_on_rank_2():
    if dist.get_rank() == 2:
        raise ValueError("rank 2 read a corrupt batch")
    dist.barrier()                       # ranks 0, 1, 3 wait here for rank 2... forever
    return "done"

try:
    run_on_ranks(fails_on_rank_2, world_size=4, timeout_s=30)
except RankError as err:
    print("RankError: failed ranks:", list(err.failures))
    print("last line of rank 2's traceback:", err.failures[2].strip().splitlines()[-1])

# %%
def rank_0_skips_the_barrier():
    if dist.get_rank() != 0:
        dist.barrier()                   # rank 0 never arrives
    return dist.get_rank()

try:
    run_on_ranks(rank_0_skips_the_barrier, world_size=4, timeout_s=3)
except RankTimeout as err:
    print("RankTimeout:", err)
print("the kernel is alive, and a fresh pool works:", run_on_ranks(lambda: dist.get_rank(), world_size=4))

# %% [markdown]
# A subtler bug: ranks that call the *same* collective with *different* shapes. Left alone,
# gloo may return wrong numbers without complaint. `run_on_ranks` checks every collective's
# op, dtype and shape across the group first, so the bug is an error that says what each
# rank called:

# %%
def mismatched_shapes():
    t = torch.ones(3 + dist.get_rank())  # rank 0: 3 elements, rank 1: 4
    dist.all_reduce(t)
    return t.tolist()

try:
    run_on_ranks(mismatched_shapes, world_size=2, timeout_s=30)
except RankError as err:
    print("\n".join(err.failures[0].strip().splitlines()[-3:]))

# %% [markdown]
# Bad arguments are refused before any process starts, with the rule that was broken:

# %%
for bad in ({"world_size": 0}, {"backend": "mpi"}, {"world_size": 2, "backend": "nccl"}):
    try:
        run_on_ranks(whoami, **bad)
    except ValueError as err:
        print(f"{bad}: {err}")

# %% [markdown]
# ## 4. Sub-groups: a named device mesh
#
# Combining strategies means each rank belongs to several groups at once: the ranks it
# shares a tensor-parallel layer with, the ranks holding other copies of the same shard for
# data parallelism, and so on. `make_mesh(dp=…, tp=…, pp=…, ep=…)` arranges the ranks in a
# grid with tensor parallelism innermost (neighbouring ranks, which on a real cluster share a
# node and its fast links). `mesh_groups` computes the same layout without any processes.

# %%
layout = mesh_groups(4, dp=2, tp=2)
print("tp groups:", layout["tp"], "  dp groups:", layout["dp"])

def my_groups():
    mesh = make_mesh(dp=2, tp=2)
    return {d: dist.get_process_group_ranks(mesh[d].get_group()) for d in ("dp", "tp")}

for rank, groups in enumerate(run_on_ranks(my_groups, world_size=4)):
    assert groups["tp"] in layout["tp"] and groups["dp"] in layout["dp"]
    print(f"rank {rank}: tensor-parallel with {groups['tp']}, data-parallel with {groups['dp']}")

try:
    mesh_groups(4, dp=2, tp=3)
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# ## 5. The same code on GPUs: `torchrun`
#
# On a machine with GPUs, instructors launch the course's demos with PyTorch's launcher,
# which starts one process per GPU and tells each its rank through environment variables.
# `course_lib.runtime.launch.init_from_env()` reads them and picks NCCL whenever the process
# sees a GPU: local rank `i` (its number on its machine) takes GPU `i`, and a process that sees a
# single GPU (a cluster that gives each process its own) takes that one. A rank left without a GPU
# of its own stops with an error rather than training on the CPU, and rank 0 prints one line per
# rank with its backend and device:
#
# ```bash
# torchrun --nproc-per-node=8 -m course_lib.demos.allreduce --sizes-mb 1 64 256
# # two machines: add --nnodes=2 --node-rank=0|1 --rdzv-endpoint=HOST:29500
# ```
#
# So there are two ways to run a strategy on GPUs: from a notebook with `backend="nccl"` (in
# `run_on_ranks`, or in a strategy's `run_...` function, which passes it on; one machine, one GPU
# per rank), or its `torchrun` demo (one or several machines). A notebook's printed numbers come from CPU ranks; on GPUs the same
# computation can differ in its last digits (other kernels, other orders of summation).
#
# The demo's functions are the ones a notebook runs with `run_on_ranks`. Here is the
# same demo under `torchrun` on this machine's CPU (gloo, 2 ranks: `CUDA_VISIBLE_DEVICES=""` hides
# any GPU), then from the notebook:

# %% tags=["nbval-ignore-output"]
import subprocess, sys
proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "-m", "course_lib.demos.allreduce", "--sizes-mb", "1", "16", "--iters", "3"],
                      capture_output=True, text=True, timeout=120,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
print(proc.stdout)
assert proc.returncode == 0, proc.stderr[-2000:]

# %% tags=["nbval-ignore-output"]
from course_lib.demos.allreduce import allreduce_bandwidth, format_rows

rows = run_on_ranks(allreduce_bandwidth, sizes_mb=(1, 16), iters=3, world_size=2)[0]
print(format_rows(rows, 2, "gloo, from the notebook"))

# %% [markdown]
# *Algorithm bandwidth* is the buffer size over the time; *bus bandwidth* multiplies it by
# `2(N-1)/N`, the share of the buffer each link carries in a ring all-reduce, so it can be
# compared across world sizes. Loopback on one CPU shows a few GB/s at most; NVLink moves
# hundreds of GB/s (bandwidths are quoted in the vendors' decimal GB/s, 10⁹ bytes per second;
# sizes the course computes are in binary units, MiB = 2²⁰ bytes). **Honesty note:** the
# course's own checks run on CPUs only; the NCCL path is the standard PyTorch one, but
# multi-GPU runs are not part of its automated tests.
#
# ## 6. The reference model
#
# Every strategy in the course is proven against one plain model trained by one process:
# `course_lib.model.GPT`, a small GPT-2-style decoder, on a character-level dataset: a pinned
# extract of the Python documentation shipped with the course (with its licence), encoded
# over a fixed alphabet of 97 symbols (newline, the 95 printable ASCII characters, and one
# "unknown" symbol), so nothing is downloaded and every machine sees the same data.

# %%
from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, plot_losses, train_reference

train_set, val_set = CharDataset("train"), CharDataset("val")
config = GPTConfig.tiny(vocab_size=train_set.vocab_size)
print(f"{len(train_set.data):,} training characters, {len(val_set.data):,} validation characters, "
      f"vocabulary of {train_set.vocab_size}")
print(config)
print(f"{GPT(config).num_params():,} parameters")

# %% [markdown]
# *Predict first:* before any training, the model's guesses are close to uniform over the
# 97 symbols. What validation loss (cross-entropy, in nats) do you expect at step 0?
#
# <details><summary>Answer</summary>
#
# About ln 97 ≈ 4.57: a uniform guess gives every character probability 1/97, and the loss
# is −ln of the probability of the right character. A randomly initialised model is close to
# uniform, so it starts near that value; the printout below shows how near.
# </details>

# %% tags=["nbval-ignore-output"]
import math

result = train_reference(config, TrainConfig(steps=200, eval_every=50))
first, last = result.val_losses[0][1], result.val_losses[-1][1]
print(f"trained in {result.seconds:.1f} s")
print(f"validation loss: {first:.2f} at step 0 (ln {config.vocab_size} = {math.log(config.vocab_size):.2f}) "
      f"-> {last:.2f} at step {result.val_losses[-1][0]}")
# model properties, not rounding: a fresh model is near uniform (4.41 against ln 97 = 4.57 here) and 200
# steps more than halve the loss (2.15 here); fp32 rounding moves these by ~1e-6
assert abs(first - math.log(config.vocab_size)) < 0.3 and last < 0.6 * first

# %%
plot_losses(result)
plt.show()

# %% [markdown]
# The loss falls from about ln(vocabulary) (a uniform guess) to well below it: the model is
# learning the text. (The last digits of these losses can differ between machines: float
# sums are added in an order that depends on the CPU and its thread count.) From notebook 03
# on, each parallel version of this training run must reproduce the single-process run on
# the same machine.
#
# ## Self-check
#
# 1. `run_on_ranks(fn, world_size=4)` returns a list. Whose results are in it, and in what
#    order? Why does the order not depend on which rank finishes first?
# 2. Four ranks hold tensors `[1, 1]`, `[2, 0]`, `[0, 2]`, `[3, 3]` and call `dist.all_reduce`.
#    What does rank 2 hold afterwards?
# 3. In the timeline of section 2, rank 2 takes 60 ms longer than the others. What happens to
#    the step time of all four ranks?
# 4. Rank 1 skips a `dist.barrier()` that the other ranks call. What do the other ranks do,
#    and what does `run_on_ranks` report?
# 5. Why does every rank of a data-parallel run have to call the same collectives, in the
#    same order, with the same shapes?
#
# <details><summary>Answers</summary>
#
# 1. One result per rank, in rank order: `run_on_ranks` collects them by rank, not by
#    arrival.
# 2. `[6, 6]`: every rank holds the element-wise sum.
# 3. Every rank's step takes 60 ms longer: the all-reduce cannot finish anywhere before
#    rank 2 has joined it.
# 4. They wait in the barrier for rank 1 forever; `run_on_ranks` stops them after `timeout_s`
#    and raises `RankTimeout` naming the stuck ranks.
# 5. A collective matches the calls of all ranks one by one: a missing call leaves the others
#    waiting, and a different shape either fails or silently combines the wrong data.
# </details>

# %% [markdown]
# ## References
#
# What this notebook relies on:
#
# * PyTorch documentation, [*Distributed communication package: torch.distributed*](https://pytorch.org/docs/stable/distributed.html):
#   process groups, the gloo, NCCL and MPI backends, and every collective called here.
# * PyTorch documentation, [*torchrun (Elastic Launch)*](https://pytorch.org/docs/stable/elastic/run.html):
#   the launcher of section 5 and the environment variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, …)
#   it gives each process.
# * NVIDIA, [nccl-tests, *doc/PERFORMANCE.md*](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
#   the definitions of algorithm bandwidth and bus bandwidth printed in section 5.
# * Radford et al. (2019). *Language Models are Unsupervised Multitask Learners* (GPT-2), OpenAI:
#   the decoder that the reference model of section 6 follows, at a tiny size.
#
# Further reading:
#
# * S. Arnold, [*Writing Distributed Applications with PyTorch*](https://pytorch.org/tutorials/intermediate/dist_tuto.html)
#   (PyTorch tutorials): the same ideas written with raw `init_process_group`, `send`/`recv` and
#   collectives; read it to see what `run_on_ranks` does for you.
# * Chen, Pan, Monga, Bengio & Jozefowicz (2016). *Revisiting Distributed Synchronous SGD*,
#   arXiv:1604.00981: how much stragglers cost synchronous training (section 2's lesson) at
#   scale, and backup workers as a remedy.
# * Li et al. (2020). *PyTorch Distributed: Experiences on Accelerating Data Parallel Training*,
#   PVLDB 13(12): how PyTorch's process groups and `DistributedDataParallel` are built, the
#   design notebook 03 rebuilds.
#
# **Next:** exercise 00 (`exercises/ex00_all_reduce.ipynb`) has you write your first all-reduce
# and run it on ranks yourself. Then notebook 01 asks how much memory and compute a *real*
# model of this shape needs, and why one GPU is not enough.
