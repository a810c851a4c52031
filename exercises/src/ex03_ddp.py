# %% [markdown]
# # Exercise 03: bucketed, overlapped data parallelism
#
# **Goal.** Write a reduced `DistributedDataParallel` in `exercises/ex03_ddp/student.py`
# (notebook `03_data_parallel` explains every idea used here):
#
# 1. `build_buckets(sizes_bytes, bucket_cap_bytes)`: group parameter indices into buckets,
#    walking from the **last** parameter to the first (backward produces gradients roughly in
#    that order), closing a bucket as soon as it holds at least the cap (PyTorch's rule).
# 2. `SimpleDDP(module, bucket_cap_mb, group)`:
#    * `__init__` copies rank 0's parameters to every rank, builds the buckets and registers a
#      `register_post_accumulate_grad_hook` on every trainable parameter;
#    * `_on_grad_ready(p)` counts ready gradients and, when a bucket is full, starts its
#      all-reduce **asynchronously** (`async_op=True`) on the flattened bucket, divided by `N`;
#    * `finish_gradient_synchronization()` (called after `backward()`, before the optimizer
#      step) waits for every bucket and writes the averaged gradients back into `p.grad`.
#
# You may assume every trainable parameter gets a gradient in every step (no unused
# parameters) and no gradient accumulation; notebook 03 §5 shows how a full DDP handles
# both. Re-read §5 (buckets, hooks, in-order launches, `finish`) before you start, and §1 for
# why the average of the shards' gradients is the right one.
#
# **Think first.** Your hook fires once per parameter, in the order autograd finishes them.
# Can two ranks see their buckets become full in different orders? What would happen if each
# rank launched its buckets in the order they became full?
#
# <details><summary>Answer</summary>
#
# For identical graphs autograd finishes the gradients in the same order on every rank, but
# as soon as the ranks' graphs differ (a parameter unused on one rank, data-dependent control
# flow), buckets fill in different orders, or not at all. Async collectives are matched by the
# order in which they are issued, so rank 0's bucket 3 would be added to rank 1's bucket 2:
# wrong sums, or a hang when the sizes differ. Launch buckets strictly in index order: a full
# bucket waits until all earlier ones have been launched.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your model is trained for a few steps on 2
# and 4 ranks and compared with `torch.nn.parallel.DistributedDataParallel` on the same data.
# Edit `student.py`, then *Kernel → Restart and run all*.

# %%
import time

import torch
import torch.distributed as dist

from course_lib import CommTracer, run_on_ranks
from course_lib.data import CharDataset, get_batch
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPT, GPTConfig
from course_lib.parallel import assign_buckets
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.train import TrainConfig

student = load_student("ex03_ddp")
CONFIG = GPTConfig.tiny(CharDataset("train").vocab_size)
# No clipping: AdamW and clipping both ignore the gradient's scale, so a DDP that forgets to
# divide by N would still produce the right parameters. Comparing raw gradients catches it.
TRAIN = TrainConfig(steps=4, batch_size=8, grad_clip=0.0, progress=False)
CAP_MB = 0.05  # MiB: small buckets, so the tiny GPT's 0.42 MiB of gradients make several

# %% [markdown]
# ## Check 1: `build_buckets`
# Sizes are in bytes. A parameter larger than the cap gets a bucket of its own.

# %%
check_equal("4 equal sizes, cap 8", student.build_buckets([4, 4, 4, 4], 8), [[3, 2], [1, 0]])
check_equal("a bucket closes once it holds the cap", student.build_buckets([4, 100, 4, 4], 10), [[3, 2, 1], [0]])
check_equal("exactly at the cap", student.build_buckets([2, 8, 2, 8], 10), [[3, 2], [1, 0]])
check_equal("everything fits", student.build_buckets([1, 2, 3], 10**9), [[2, 1, 0]])
sizes = [p.numel() * 4 for p in GPT(CONFIG).parameters()]
check_equal("the course GPT, cap 0.05 MiB", student.build_buckets(sizes, CAP_MB * 2**20),
            assign_buckets(sizes, CAP_MB * 2**20))

# %% [markdown]
# ## Check 2: same training as torch's DDP, on 2 and 4 ranks
# Both runs start from the same model and see the same data; after 4 AdamW steps the
# parameters and the last averaged gradients must agree (up to float rounding), and every rank
# must hold the same replica.

# %%
def wrap_student(model, group):
    return student.SimpleDDP(model, bucket_cap_mb=CAP_MB, group=group)


def both(config, cfg):
    mine = train_data_parallel(config, cfg, wrap_student)
    theirs = train_data_parallel(config, cfg, "torch", bucket_cap_mb=CAP_MB)
    return mine, theirs


for world_size in (2, 4):
    res = run_on_ranks(both, CONFIG, TRAIN, world_size=world_size, backend="gloo", timeout_s=60)
    mine, theirs = res[0]
    # Compared in norm, not element by element: on 4 ranks gloo adds in an order set by the bucket layout, and
    # AdamW magnifies that rounding where a gradient is near zero (notebook 04), up to ~lr for a single
    # parameter. So: the last gradients to 1e-4 of their norm (a DDP that forgets to divide by N is off by
    # N - 1), the parameters in RMS to a hundredth of one AdamW step (a wrong gradient moves most by ~lr).
    check_close(f"{world_size} ranks: last averaged gradients = torch DDP's (|difference| / |gradient|)",
                ((mine.final_grads - theirs.final_grads).norm() / theirs.final_grads.norm()).item(), 0.0,
                rtol=0, atol=1e-4)
    check_close(f"{world_size} ranks: parameters after {TRAIN.steps} steps = torch DDP's (RMS of the difference)",
                (mine.final_params - theirs.final_params).pow(2).mean().sqrt().item(), 0.0, rtol=0, atol=TRAIN.lr / 100)
    check_equal(f"{world_size} ranks: every replica identical",
                all(torch.equal(r[0].final_params, mine.final_params) for r in res), True)

# %% [markdown]
# ## Check 3: one all-reduce per bucket, launched during backward
# The tracer counts the collective calls of one step; each call's start time is compared with
# the moment `backward()` returned. A DDP that reduces after backward (or per parameter) fails.

# %%
def one_step(config):
    model = GPT(config)
    ddp = student.SimpleDDP(model, bucket_cap_mb=CAP_MB)
    x, y = get_batch(CharDataset("train"), 4, torch.Generator().manual_seed(dist.get_rank()))
    with CommTracer() as tracer:
        _, loss = ddp(x, y)
        loss.backward()
        backward_done = time.perf_counter()
        ddp.finish_gradient_synchronization()
    calls = [r for r in tracer.records if r.op == "all_reduce"]
    return {"buckets": len(ddp.buckets), "calls": len(calls), "bytes": sum(r.bytes_sent for r in calls),
            "during_backward": sum(r.start < backward_done for r in calls)}


n_buckets = len(assign_buckets(sizes, CAP_MB * 2**20))
for r in run_on_ranks(one_step, CONFIG, world_size=2, backend="gloo", timeout_s=60)[:1]:
    check_equal("number of buckets", r["buckets"], n_buckets)
    check_equal("one all-reduce per bucket", r["calls"], n_buckets)
    check_equal("bytes all-reduced = the whole gradient (4 bytes per parameter)", r["bytes"], sum(sizes))
    check_equal("every bucket launched while backward was running", r["during_backward"], n_buckets)

# %% [markdown]
# All checks passed? Then you have written the heart of PyTorch's DDP. Two questions to take
# back to notebook 03: what must a DDP do for a parameter that gets no gradient on one rank in
# some step (§5, step 5), and why does PyTorch give its *first* bucket a smaller cap (§8)?
