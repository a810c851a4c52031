# %% [markdown]
# # 00 · Launching ranks
#
# Every strategy in this course (data, tensor, pipeline and expert parallelism, ZeRO) is a
# way for several **processes** to cooperate on one training run. Before any of them, we need
# those processes, a way for them to talk, and a way to see what they say. This notebook
# builds that ground:
#
# 1. what a *process group*, a *rank* and the *world size* are;
# 2. running a function defined right here on 2, 4 and 8 emulated ranks;
# 3. the first collective, **all-reduce**, and counting its bytes with the course's tracer;
# 4. what a failing rank and a stuck rank look like (an error, and the kernel lives on);
# 5. the same code on GPUs with `torchrun`;
# 6. the reference model every later notebook parallelises, trained once on one process.
#
# Everything here runs for real: separate operating-system processes talking over the
# loopback network with PyTorch's **gloo** backend. On a multi-GPU machine the same code
# runs over **NCCL**.

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
# The function can be defined right here in the notebook.

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
# start-up, later calls only send the function and collect the results. Timings depend on
# the machine, so nbval does not compare this cell's output.

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
# With rank `r` holding `r + 1`, every rank must end with `1 + 2 + … + N = N(N+1)/2`.
# The course's `CommTracer` records every `torch.distributed` call made inside its block:
# op, dtype, element count and bytes.

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

# %%
def compute_then_reduce():
    tl = Timeline()
    x = torch.randn(256, 256)
    with tl.span("matmul", "compute"):
        for _ in range(5 * (dist.get_rank() + 1)):   # ranks do unequal work on purpose
            x = torch.tanh(x @ x)
    with CommTracer(timeline=tl):
        dist.all_reduce(x)
    return tl.events

events = run_on_ranks(compute_then_reduce, world_size=4)
plot_gantt(events, title="all-reduce waits for the slowest rank")
plt.show()

# %% [markdown]
# The all-reduce cannot finish on any rank before the slowest rank has joined it: the fast
# ranks' red bars are mostly *waiting*. That is the first lesson about synchronous training:
# the step runs at the pace of the slowest rank.
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
# op, dtype and shape across the group first (see `course_lib/observe/checks.py`), so the bug is an
# error that says what each rank called:

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
# `course_lib.runtime.launch.init_from_env()` reads them and picks NCCL when the process has a GPU:
#
# ```bash
# torchrun --nproc-per-node=8 -m course_lib.demos.allreduce --sizes-mb 1 64 256
# # two machines: add --nnodes=2 --node-rank=0|1 --rdzv-endpoint=HOST:29500
# ```
#
# The demo's functions are the ones a notebook runs with `run_on_ranks`. Here is the
# same demo under `torchrun` on this machine's CPU (gloo, 2 ranks), then from the notebook:

# %% tags=["nbval-ignore-output"]
import subprocess, sys
proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "-m", "course_lib.demos.allreduce", "--sizes-mb", "1", "16", "--iters", "3"],
                      capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
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
# hundreds of GB/s. **Honesty note:** this course's CI runs on CPUs only; the NCCL path is the
# standard PyTorch one, but multi-GPU runs are not part of its automated tests.
#
# ## 6. The reference model
#
# Every strategy in the course is proven against one plain model trained by one process:
# `course_lib.model.GPT`, a small GPT-2-style decoder, on a character-level dataset made of
# the documentation that ships with Python (`pydoc_data.topics`), so nothing is downloaded.

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

# %% tags=["nbval-ignore-output"]
result = train_reference(config, TrainConfig(steps=200, eval_every=50))
print(f"trained in {result.seconds:.1f} s")

# %%
first, last = result.val_losses[0][1], result.val_losses[-1][1]
print(f"validation loss: {first:.2f} at step 0 -> {last:.2f} at step {result.val_losses[-1][0]}")
assert last < 0.6 * first
plot_losses(result)
plt.show()

# %% [markdown]
# The loss falls from about ln(vocabulary) (a uniform guess) to well below it: the model is
# learning the text. From notebook 03 on, each parallel version of this training run must
# reproduce these numbers.
#
# **Next:** notebook 01 asks how much memory and compute a *real* model of this shape needs,
# and why one GPU is not enough.
