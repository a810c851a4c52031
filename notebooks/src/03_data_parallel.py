# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/03_data_parallel.ipynb)

# %% [markdown]
# # 03 · Data parallelism from scratch
#
# **Data parallelism** (DP) is the first strategy every large training run uses and the one
# all others are combined with. Each of the `N` ranks holds a **complete copy** of the model,
# takes its own `1/N` of every batch, computes gradients on it, and then the ranks
# **average their gradients** before the optimizer step. Because every rank then applies the
# same update to the same weights, the copies stay identical, and the whole thing computes
# exactly what one process would on the full batch, only `N` times faster on `N` devices.
#
# The one new cost is communication: every step, every rank must exchange a gradient as big
# as the model. This notebook builds DP from scratch in `course_lib/parallel/dp/ddp.py`
# (read it: under 300 lines), proves it correct, makes that communication cheap, and then asks
# what the bigger global batch does to training.
#
# **After this notebook you can**
#
# * prove that averaging the gradients of equal shards gives the gradient of the whole batch,
#   and shard a dataset over ranks without overlap;
# * count the calls and bytes of naive DP and of bucketed DDP, and predict them with
#   $2\frac{N-1}{N}S$ per rank for a ring;
# * explain and implement DDP's buckets, hooks, in-order launches, small first bucket and
#   `no_sync`, and read the overlap of communication with backward on a timeline;
# * choose a bucket size by measuring, and say what a 2-core machine can and cannot show;
# * compute what bf16 and top-k compression save, and when error feedback helps;
# * scale the learning rate with the global batch (linear, square root, warm-up) and estimate
#   the critical batch size from gradient noise (McCandlish et al. 2018).
# * compile a model per block under PyTorch's DDP and FSDP2, in the order tensor parallelism,
#   activation checkpointing, compile, sharding, and check one compiled step against eager.

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
import inspect
import os
import time
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from course_lib import CommTracer, format_summary, merge_summaries, plot_gantt, run_on_ranks
from course_lib.data import CharDataset, sample_indices
from course_lib.dims import ParallelDims
from course_lib.model import GPT, GPTConfig
from course_lib.parallel import (DDP, LowPrecisionHook, TopKHook, assign_buckets, check_replicas,
                                 naive_all_reduce_gradients, run_data_parallel)
from course_lib.parallel.dp.compression import topk_count
from course_lib.parallel.dp.ddp import FIRST_BUCKET_MB
from course_lib.parallel.dp.large_batch import (gradient_noise_scale, micro_batch_gradients, scale_lr,
                                                train_at_token_budget)
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.train import TrainConfig, smooth, train_reference

torch.manual_seed(0)
DATA = CharDataset("train")
CONFIG = GPTConfig.tiny(DATA.vocab_size)  # 2 layers, d_model 64: the tests' model
N_PARAMS = GPT(CONFIG).num_params()
print(f"course GPT: {N_PARAMS:,} parameters -> {4 * N_PARAMS:,} bytes of fp32 gradient per step")
# Every run below uses CPU ranks (gloo, even on a GPU machine: the timings and their discussion
# are about this 2-core box) and skips the collective checks (see the note below).
RANKS = dict(backend="gloo", check_collectives=False)

# %% [markdown]
# Every run below passes `**RANKS`: CPU ranks, and `check_collectives=False`. The check
# (notebook 00) adds a small blocking all-gather before each collective, which is what you
# want while writing new rank code, but it would distort the timings of sections 7-9, and one
# setting for the whole notebook means one pool of ranks per world size instead of two.

# %% [markdown]
# ## 1. Why the average gradient is the big-batch gradient
#
# The training loss of a batch $B$ is a **mean** over its examples,
# $L(\theta; B) = \frac{1}{|B|}\sum_{i\in B} \ell_i(\theta)$. Split $B$ into `N` equal shards
# $B_0, \dots, B_{N-1}$, one per rank. Rank `r` computes the gradient of its own shard's mean,
# $g_r = \nabla L(\theta; B_r)$, and then
#
# $$\frac{1}{N}\sum_{r=0}^{N-1} g_r \;=\; \frac{1}{N}\sum_r \frac{N}{|B|}\sum_{i\in B_r}\nabla\ell_i
# \;=\; \frac{1}{|B|}\sum_{i\in B}\nabla \ell_i \;=\; \nabla L(\theta; B).$$
#
# So after one **all-reduce** (sum over ranks, then divide by `N`) every rank holds the
# gradient of the *global* batch. Everything after it is the same on every rank:
# gradient clipping sees the global norm $\lVert\nabla L(\theta;B)\rVert$, AdamW sees the same
# gradient, and since every rank started from the same $\theta$ they all end at the same
# $\theta'$. DP is not an approximation: it is the single-process algorithm, computed by `N`
# processes (up to float rounding, since sums are added in another order).
#
# Two architectures have been used for the averaging (Li et al. 2014 for the parameter
# server; notebook 02 for both): a **parameter server** (every worker sends its gradient to a
# central process, which adds them and sends the result back: that one process receives and
# sends $N S$ bytes per step, so its link is the bottleneck; sharding the server over the $N$
# workers brings every worker's traffic down to $2\frac{N-1}{N}S$) and **all-reduce** among the
# workers. With a ring all-reduce (Patarasuk & Yuan 2009; notebook 02) every rank sends only
# $2\frac{N-1}{N}S$ bytes for a gradient of $S$ bytes, nearly independent of `N`; that is what
# PyTorch, Horovod and NCCL do, and what we use here.
#
# ## 2. The data side: one shard per rank
#
# In real training, a dataset is read in **epochs**, and `torch.utils.data.DistributedSampler`
# gives every rank a disjoint part of a shuffled permutation: rank `r` takes positions
# `r, r+N, r+2N, …`. With `drop_last=True` the few samples beyond a multiple of `N` are
# dropped instead of repeated, so no window of text is seen twice in an epoch.
# `set_epoch(e)` reseeds the shuffle, so each epoch every rank gets a *different* shard.
# Here are the 4 shards of the course's training text (about 418,000 next-character windows),
# built exactly as each rank would build its own:

# %%
def shards(dataset, n, epoch):
    out = []
    for rank in range(n):
        sampler = DistributedSampler(dataset, num_replicas=n, rank=rank, shuffle=True, seed=0, drop_last=True)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out

N = 4
per_epoch = [shards(DATA, N, epoch) for epoch in (0, 1)]
for epoch, ranks in enumerate(per_epoch):
    sets = [set(s) for s in ranks]
    union = set().union(*sets)
    assert all(len(s) == len(DATA) // N for s in sets)              # equal shards, no repeats
    assert len(union) == sum(len(s) for s in sets)                  # pairwise disjoint
    assert len(DATA) - len(union) == len(DATA) % N                  # only the remainder is dropped
    print(f"epoch {epoch}: {N} shards of {len(sets[0]):,} windows, pairwise disjoint, "
          f"{len(union):,} of {len(DATA):,} windows covered")
for rank in range(N):
    same = len(set(per_epoch[0][rank]) & set(per_epoch[1][rank])) / len(per_epoch[0][rank])
    assert same < 0.5  # a fresh shuffle overlaps the last one by about 1/N (a count: no rounding involved)
    print(f"rank {rank}: {same:.1%} of its epoch-1 shard was also in its epoch-0 shard (chance: 1/{N})")

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 1.8), sharex=True)
owner = torch.empty(len(DATA), dtype=torch.long)
for ax, ranks, epoch in zip(axes, per_epoch, (0, 1)):
    owner.fill_(-1)
    for rank, idx in enumerate(ranks):
        owner[torch.tensor(idx)] = rank
    ax.imshow(owner[:120].view(1, -1), aspect="auto", cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
    ax.set_yticks([0], [f"epoch {epoch}"])
axes[1].set_xlabel("dataset index (first 120 windows); colour = the rank that trains on it")
fig.suptitle("DistributedSampler: every window goes to exactly one rank, a different one each epoch", fontsize=10)
plt.show()

# %% [markdown]
# **The global-batch view.** To compare DP with the single-process reference step by step
# (`course_lib.train.train_reference`, which draws each batch with
# `data.sample_indices(len, B, generator)`), every rank draws the reference's *global* batch
# indices with the same seeded generator and keeps its contiguous slice; with gradient
# accumulation the slice is further cut into micro-batches. `train_data_parallel` does this:

# %%
B, n, accum = 8, 2, 2
global_idx = sample_indices(len(DATA), B, torch.Generator().manual_seed(0))
share, micro = B // n, B // (n * accum)
print("global batch:", global_idx.tolist())
for rank in range(n):
    mine = global_idx[rank * share:(rank + 1) * share]
    print(f"rank {rank}: micro-batches", [mine[k * micro:(k + 1) * micro].tolist() for k in range(accum)])

# %% [markdown]
# Each micro-batch loss is divided by `accum`, so the gradients summed over a rank's
# micro-batches are the gradient of its shard's mean, and the all-reduce does the rest.
#
# ## 3. Naive data parallel
#
# The simplest correct implementation: after `loss.backward()`, all-reduce every gradient,
# one parameter at a time, and divide by `N`. We divide *before* summing (`g/N` summed over
# ranks is the mean; for `N` a power of two the division is exact), as PyTorch does.

# %%
print(inspect.getsource(naive_all_reduce_gradients))

# %% [markdown]
# `check_replicas` compares every rank's parameter names, shapes and a checksum of the values
# (one small all-gather): averaging gradients keeps replicas equal only if they *start*
# equal, so it refuses to start otherwise (section 8).
#
# Does it reproduce the single-process run? Train 5 steps on 2 ranks and compare with
# `train_reference` on the same global batches. Each rank returns its own per-step losses
# (its shard's mean); their average is the global batch loss.
#
# **Predict first.** Bit-for-bit equal, equal up to rounding, or only statistically similar?
#
# <details><summary>Answer</summary>
#
# Equal up to float rounding: the same sums are added in another order (per shard, then over
# ranks). The losses agree to about 1e-7; most parameters to about 1e-6 after AdamW, a few
# by more (see below).
# </details>

# %% tags=["nbval-ignore-output"]
TRAIN = TrainConfig(steps=5, batch_size=8, eval_every=10**6, eval_batches=1, progress=False)
ref = train_reference(CONFIG, TRAIN)
ref_params = torch.cat([p.detach().reshape(-1) for p in ref.model.parameters()])
ref_grads = torch.cat([p.grad.reshape(-1) for p in ref.model.parameters()])

def rms(t):
    """Root mean square: one outlying element of size x adds only x / sqrt(numel)."""
    return t.pow(2).mean().sqrt().item()

def compare(per_rank, label):
    """Global loss per step and differences to the reference; asserts the claim."""
    n = len(per_rank)
    losses = [sum(r.train_losses[s] for r in per_rank) / n for s in range(len(ref.train_losses))]
    d_loss = max(abs(a - b) for a, b in zip(losses, ref.train_losses))
    diff = per_rank[0].final_params - ref_params
    same = all(torch.equal(r.final_params, per_rank[0].final_params) for r in per_rank)
    # Losses: means of fp32 sums taken in another order, ~1e-7 apart. Parameters: in RMS, against a
    # hundredth of one AdamW step (lr): rounding in a gradient near zero can move a single parameter
    # by up to ~lr (below), while a wrong gradient moves most of them by ~lr.
    assert same and d_loss < 1e-5 and rms(diff) < TRAIN.lr / 100, (label, d_loss, rms(diff))
    return (f"{label:<40} max|Δloss| {d_loss:.1e}   max|Δθ| {diff.abs().max().item():.1e}   "
            f"RMS Δθ {rms(diff) / TRAIN.lr:.0e} lr   replicas identical: {same}")

naive = run_data_parallel(ParallelDims(dp=2), CONFIG, TRAIN, "naive", **RANKS)
print("reference losses:", [f"{x:.4f}" for x in ref.train_losses])
print("naive DP losses: ", [f"{(a + b) / 2:.4f}" for a, b in zip(naive[0].train_losses, naive[1].train_losses)])

# %% tags=["nbval-ignore-output"]
print(compare(naive, "naive DP, 2 ranks"))

# %% [markdown]
# The differences are at the level of float rounding: about `1e-7` for the loss. The parameters
# agree as closely almost everywhere, but AdamW magnifies the rounding of gradients near zero:
# its step $\text{lr}\cdot m/(\sqrt{v} + \varepsilon)$ has slope $\text{lr}/\varepsilon$ there
# ($\varepsilon = 10^{-8}$), so a gradient of $10^{-8}$ that one run rounds differently from the
# other moves its parameter by a visible amount, up to about lr in the worst case. That is why
# the largest parameter difference is a few `1e-6` rather than `1e-7`, and why the assert in the
# cell above compares the parameters in RMS, against a hundredth of one step (lr/100), not
# element by element. (Notebook 04 works out the bound for one step.)
#
# ## 4. What naive DP costs: calls and bytes
#
# The tracer sees each rank's collective calls.
#
# **Predict first.** For one step of naive DP on the course GPT: how many all-reduce calls per
# rank, and how many bytes in total?
#
# <details><summary>Answer</summary>
#
# One call per parameter tensor (a tied weight — the GPT's `head.weight` *is*
# `tok_emb.weight` — is one `Parameter`, reduced once), handing the backend the whole
# gradient, $S = 4P$ bytes.
# </details>

# %%
def traced_step(config, cfg, strategy, **kw):
    cfg = TrainConfig(**{**cfg.__dict__, "steps": 1})
    return train_data_parallel(config, cfg, strategy, trace=True, **kw).comm_summary

n_tensors = len(list(GPT(CONFIG).parameters()))
naive_comm = run_on_ranks(traced_step, CONFIG, TRAIN, "naive", world_size=2, **RANKS)
print(format_summary(merge_summaries(naive_comm)))
assert all(c["all_reduce"]["calls"] == n_tensors for c in naive_comm)
assert all(c["all_reduce"]["bytes_sent"] == 4 * N_PARAMS for c in naive_comm)
print(f"\n{n_tensors} parameter tensors -> {n_tensors} all-reduce calls; {4 * N_PARAMS:,} bytes = 4 x {N_PARAMS:,} parameters")

# %% [markdown]
# (The two small `all_gather_single` calls are `check_replicas`, on the first call only.)
# Two things are wasteful:
#
# * **Many small messages.** A collective costs roughly $\alpha + S/\beta$: a fixed latency
#   $\alpha$ per call plus bytes over bandwidth (the α-β model of notebook 02). One call per
#   tensor pays that latency once per tensor; one call with the same bytes pays it once. Real
#   models have hundreds of tensors.
# * **No overlap.** Nothing is sent until backward has finished, then the processor waits for
#   the network. But the last layer's gradients are ready at the very *start* of backward:
#   they could be travelling while the earlier layers are still differentiated.
#
# ## 5. DDP: buckets and overlap
#
# `course_lib.parallel.DDP(module, bucket_cap_mb=25, overlap=True)` fixes both, the way
# PyTorch's `DistributedDataParallel` does:
#
# 1. **Construction.** Check that every rank's parameters have the same names and shapes
#    (`check_replicas`), then **broadcast** rank 0's values so all replicas start equal.
# 2. **Buckets.** Walk the trainable parameters in *reverse* registration order (roughly the
#    order backward produces their gradients) and fill buckets: a bucket is closed as soon as
#    it holds `bucket_cap_mb` (MiB; PyTorch's rule, so a bucket overshoots by at most its last
#    parameter). The **first** bucket has a smaller cap, `first_bucket_cap_mb` = 1 MiB as in
#    PyTorch (section 8 shows why). Frozen parameters (`requires_grad=False`) are left out:
#    nothing to send.
# 3. **Hooks.** `p.register_post_accumulate_grad_hook(hook)` (PyTorch ≥ 2.1) calls `hook(p)`
#    the moment `p.grad` is complete. The hook counts the bucket's ready gradients; when the
#    bucket is full, it copies them into one flat tensor, divides by `N` and starts
#    `dist.all_reduce(flat, async_op=True)`, which returns at once: the backend reduces in
#    its own thread while autograd continues with earlier layers.
# 4. **In order.** Buckets are launched strictly in index order. Async collectives are
#    matched across ranks by the order they are issued, so if rank 0 issued bucket 3 first and
#    rank 1 bucket 2, they would add unrelated tensors (or hang).
# 5. **Finish.** The first hook of a backward queues `finish_gradient_synchronization` to run
#    when autograd finishes the whole backward (`queue_callback`, as PyTorch's DDP does). It
#    launches any bucket not launched yet — a parameter that got no gradient on this rank
#    (unused in this step) counts as zeros, so every rank still joins every all-reduce — then
#    waits for all buckets and copies the averages into `p.grad`. By the time
#    `loss.backward()` returns, the gradients are averaged; calling `finish_…` again is a no-op.
# 6. **`no_sync()`.** Backward passes inside it only accumulate local gradients: gradient
#    accumulation over micro-batches pays for one all-reduce per optimizer step, not per
#    micro-batch.
# 7. **Tied weights.** The GPT's `head.weight` is `tok_emb.weight`: one `Parameter` used twice.
#    `parameters()` yields it once, so it gets one hook and one place in one bucket; autograd
#    sums both uses' gradients before its hook fires, once.
#
# In a training loop (this is what `train_data_parallel` does on every rank):
#
# ```python
# ddp = DDP(model, bucket_cap_mb=25)             # broadcast from rank 0, buckets, hooks
# optimizer = make_optimizer(model, cfg)
# for step in range(cfg.steps):
#     optimizer.zero_grad(set_to_none=True)
#     with ddp.no_sync():                        # micro-batches 1 .. A-1: local sums only
#         for x, y in micro_batches[:-1]:
#             (ddp(x, y)[1] / A).backward()
#     x, y = micro_batches[-1]
#     (ddp(x, y)[1] / A).backward()              # buckets leave while this backward runs;
#                                                # when it returns, p.grad is the global mean
#     torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
#     optimizer.step()
# ```
#
# Which parameters share a bucket? Here is the layout for the model we will time below
# (4 layers, `d_model` 128: 3.1 MiB of gradients), in the order backward reaches them:

# %%
TIMING = GPTConfig.tiny(DATA.vocab_size, d_model=128, n_layer=4)
timing_params = list(GPT(TIMING).named_parameters())

def draw_buckets(ax, cap_mb, named=timing_params, first_cap_mb=FIRST_BUCKET_MB):
    """One bar per parameter in backward order (width = its MiB), coloured by bucket, as DDP
    lays them out (the first bucket capped at min(first_cap_mb, cap_mb))."""
    sizes = [p.numel() * 4 for _, p in named]
    buckets = assign_buckets(sizes, cap_mb * 2**20, min(first_cap_mb, cap_mb) * 2**20)
    x = 0.0
    for b, idx in enumerate(buckets):
        for i in idx:
            ax.barh(0, sizes[i] / 2**20, left=x, color=plt.cm.tab10(b % 10), edgecolor="white", linewidth=0.3)
            x += sizes[i] / 2**20
    ax.set_yticks([])
    ax.set_xlabel("MiB of gradient, in the order backward produces it (ln_f ... tok_emb)")
    ax.set_title(f"bucket_cap_mb={cap_mb:g}: {len(buckets)} buckets for {len(sizes)} tensors", fontsize=9)
    return buckets

fig, axes = plt.subplots(2, 1, figsize=(9, 2.6))
layout = {cap: draw_buckets(ax, cap) for ax, cap in zip(axes, (0.25, 25))}
fig.tight_layout()
plt.show()
for cap, buckets in layout.items():
    print(f"cap {cap:>4} MiB, {len(buckets)} buckets:",
          [[timing_params[i][0] for i in b][:2] + (["..."] if len(b) > 2 else []) for b in buckets[:3]])

# %% [markdown]
# **Try it.** In a live kernel, the slider below redraws the layout for any bucket size
# (the static figure above shows two settings). Note the last bucket: the token embedding is
# the last gradient to be ready (it is used first in forward and again, tied, by the head),
# so it can never overlap with compute. Is it also the largest tensor? Only when its
# $V \times d$ exceeds the largest weight matrix, the MLP's $d \times 4d$, that is when the
# vocabulary is larger than $4d$. Here $V = 97 < 4 \cdot 128$: the MLP matrices are
# larger. For GPT-2 (V = 50,257, d = 768) it is the largest by far, and in real models the
# last bucket, holding it, is a big one that leaves only when backward ends.

# %% tags=["nbval-ignore-output"]
from course_lib.parallel.dp import bucketviz
from course_lib.widgets import show_interactive

show_interactive(lambda: bucketviz.bucket_view(TIMING), lambda: bucketviz.bucket_widget(TIMING))

# %% [markdown]
# With buckets, the tracer sees **one call per bucket** and still the whole gradient's bytes.
# What actually crosses the wire depends on the algorithm: the built-in gloo all-reduce is a
# black box to the tracer, so as a comm hook we plug the course's own ring all-reduce from
# notebook 02 (`course_lib.comm.ring_all_reduce`, built from `isend`/`irecv`) into our DDP and
# count real bytes: $2\frac{N-1}{N}S$ per rank (up to one element of chunk rounding per step).

# %%
from course_lib import comm

def ring_hook(bucket_index, flat, group=None):
    comm.ring_all_reduce(flat, group=group)     # synchronous: done when it returns
    return SimpleNamespace(wait=lambda: flat)   # the handle DDP waits on

def traced_ddp_step(config, cfg, **kw):
    return traced_step(config, cfg, "ddp", **kw), len(DDP(GPT(config), **kw).buckets)

ddp_comm = run_on_ranks(traced_ddp_step, CONFIG, TRAIN, bucket_cap_mb=0.1, world_size=2, **RANKS)
n_buckets = ddp_comm[0][1]
print(format_summary(merge_summaries([c for c, _ in ddp_comm])))
assert all(c["all_reduce"]["calls"] == n_buckets and c["all_reduce"]["bytes_sent"] == 4 * N_PARAMS for c, _ in ddp_comm)
print(f"\nnaive: {n_tensors} calls per step; DDP with 0.1 MiB buckets: {n_buckets} calls; same {4 * N_PARAMS:,} bytes")

for n in (2, 4):
    ring = run_on_ranks(traced_step, CONFIG, TRAIN, "ddp", bucket_cap_mb=0.1, comm_hook=ring_hook, world_size=n,
                        **RANKS)
    wire = [c["isend"]["bytes_sent"] for c in ring]
    formula = 2 * (n - 1) / n * 4 * N_PARAMS
    assert all(abs(w - formula) <= 2 * (n - 1) * 4 * n_buckets for w in wire)
    print(f"ring on {n} ranks: {wire[0]:,} bytes sent per rank on the wire;  2(N-1)/N * S = {formula:,.0f}")

# %% [markdown]
# ## 6. The proof: equal to the reference and to PyTorch's DDP
#
# Same 5 steps, now with our DDP — small buckets (so there are several), with and without
# gradient accumulation (2 micro-batches per rank), without overlap — against the same
# reference, and against `torch.nn.parallel.DistributedDataParallel` on the same data, on 2
# and 4 ranks. Every row asserts its claim; the numbers are the largest differences.
#
# **Predict first.** Our DDP and PyTorch's both average the same gradients over the same
# data. On 2 ranks, do their parameters after 5 steps agree bit for bit or only up to
# rounding? And on 4 ranks?
#
# <details><summary>Answer</summary>
#
# Bit for bit on 2 ranks: both divide by $N = 2$ (exact for a power of two) and then add two
# numbers, and $a + b = b + a$ in floating point (the cell asserts equality). On 4 ranks only
# up to rounding: gloo adds four numbers per element in an order that depends on where the
# element sits in the buffer, so buckets that place it differently round differently (the
# cell asserts a bound, not equality).
# </details>

# %%
VARIANTS = [("ddp", 1, {}), ("ddp", 2, {"bucket_cap_mb": 0.05}), ("ddp", 1, {"bucket_cap_mb": 0.05, "overlap": False}),
            ("naive", 2, {}), ("torch", 1, {}), ("torch", 2, {"bucket_cap_mb": 0.05})]

def all_variants(config, cfg):
    return [train_data_parallel(config, cfg, s, a, **kw) for s, a, kw in VARIANTS]

rows, results = [], {}
for n in (2, 4):
    per_rank = run_on_ranks(all_variants, CONFIG, TRAIN, world_size=n, timeout_s=120, **RANKS)
    for v, (strategy, accum, kw) in enumerate(VARIANTS):
        runs = [r[v] for r in per_rank]
        results[(n, strategy, accum)] = runs[0]
        rows.append(compare(runs, f"{n} ranks {strategy:<5} accum={accum} {kw}"[:40]))
    for accum in (1, 2):
        diff = results[(n, "ddp", accum)].final_params - results[(n, "torch", accum)].final_params
        # 2 ranks: x/2 + y/2 is exact in either order, so bit for bit; 4 ranks: sums of four in
        # another order, then AdamW (RMS against lr/100, as in compare)
        assert (diff == 0).all() if n == 2 else rms(diff) < TRAIN.lr / 100
        rows.append(f"{n} ranks: ours vs torch DDP, accum={accum}: max|Δθ| {diff.abs().max().item():.1e}")

# %% tags=["nbval-ignore-output"]
print("\n".join(rows))

# %% [markdown]
# On 2 ranks ours and PyTorch's agree bit for bit (`0.0`, asserted): both pre-divide by `N`
# (exact for a power of two) and add two numbers, and $a + b = b + a$ holds in floating point
# too. On 4 ranks gloo adds four numbers per element, in an order that depends on where the
# element sits in the buffer, so different bucket layouts round differently: differences of
# the same size as between either and the reference.
#
# A parameter comparison alone can hide a bug: with clipping *and* AdamW — both blind to the
# gradient's scale — a DDP that forgot to divide by `N` would still produce the right
# parameters. To catch it, turn clipping off and compare the raw averaged gradients
# (exercise 03 does). The other corner cases deserve the same care: frozen parameters (never
# bucketed, never changed) and a parameter used on one rank only (its bucket still reduced,
# in order, on both ranks).
#
# ## 7. Seeing the overlap
#
# Now the model from section 5 on 2 ranks, with 1 MiB buckets. Each rank records a
# timeline: forward, backward and optimizer on one lane, and on a second lane each bucket's
# all-reduce **from the moment this rank launched it until the backend reported it done**
# (that includes waiting for the other rank to launch the same bucket). "finish" (grey) is the
# end of backward, where the remaining buckets are launched and all of them waited for.
#
# **Predict first.** With `overlap=True`, how many of the buckets are launched before
# backward has finished? And with `overlap=False`?
#
# <details><summary>Answer</summary>
#
# With overlap, all of them: each leaves from the hook of its last gradient, and the last
# bucket's last gradient (the embedding's) is still produced inside backward. Without
# overlap, none: everything is launched by `finish`, after backward.
# </details>

# %%
TIMING_TRAIN = TrainConfig(steps=3, batch_size=16, progress=False)

def lanes(per_rank_events):
    """Last step of each rank, split into a compute lane and a comm lane."""
    rows, labels = [], []
    for rank, events in enumerate(per_rank_events):
        t0 = [e for e in events if e[0] == "forward"][-1][1]
        step = [e for e in events if e[1] >= t0]
        rows += [[e for e in step if e[3] != "comm"], [e for e in step if e[3] == "comm"]]
        labels += [f"rank {rank} compute", f"rank {rank} comm"]
    return rows, labels

def timeline_run(overlap):
    return run_data_parallel(ParallelDims(dp=2), TIMING, TIMING_TRAIN, "ddp", bucket_cap_mb=1.0, overlap=overlap,
                             record_timeline=True, **RANKS)

timelines = {overlap: [r.timeline_events for r in timeline_run(overlap)] for overlap in (True, False)}
for overlap, per_rank in timelines.items():  # the claim, independent of timing: who launched when
    for events in per_rank:
        last_step = [e for e in events if e[1] >= [f for f in events if f[0] == "forward"][-1][1]]
        finish = [e for e in last_step if e[0] == "finish"][0]
        buckets = [e for e in last_step if e[3] == "comm"]
        launched_early = sum(b[1] < finish[1] for b in buckets)
        assert launched_early == (len(buckets) if overlap else 0), (overlap, launched_early, len(buckets))
    print(f"overlap={overlap}: {launched_early} of {len(buckets)} buckets launched during backward")

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
for ax, overlap in zip(axes, (True, False)):
    rows, labels = lanes(timelines[overlap])
    n_comm = sum(e[3] == "comm" for e in rows[1])
    plot_gantt(rows, ax=ax, title=f"overlap={overlap}: one training step on 2 ranks (bucket_cap_mb=1, {n_comm} buckets)")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("")
axes[1].set_xlabel("time (s) from the step's first forward")
fig.tight_layout()
plt.show()

# %% [markdown]
# With `overlap=True` the red bucket bars start while backward (orange) is still running: each
# bucket leaves as soon as its last gradient is accumulated, so by the end of backward part of
# the communication is already done. With `overlap=False` every bucket starts at `finish`,
# after backward. (The assert above checks exactly this schedule, which does not depend on
# timing.)
#
# Two more things to read in the picture, and they vary from run to run:
#
# * **Stragglers.** A bucket's all-reduce completes only when *both* ranks have launched it.
#   If one rank's backward is slower (here: another process took its core for a while), the
#   other one sits in `finish` waiting. Every data-parallel step runs at the pace of the
#   slowest rank.
# * **What this machine can and cannot show.** Both ranks share 2 CPU cores with the gloo
#   threads doing the reduction, so communication *competes* with compute for the same cores
#   instead of running on a separate network engine. On GPUs, NCCL kernels run beside the
#   backward kernels and the network is a separate device: there the overlap hides most of
#   the communication. The *schedule* — which buckets can leave before backward ends — is the
#   same everywhere.
#
# ## 8. How big should a bucket be?
#
# Small buckets start earlier (more overlap) but each call pays the latency $\alpha$ of the
# α-β model ($T = \alpha + S/\beta$ per call, $\beta$ a bandwidth); one huge bucket pays
# $\alpha$ once but cannot leave before backward has finished. On a GPU cluster the best size
# is a compromise; PyTorch's default is 25 MiB.
#
# **The small first bucket.** A model whose gradients all fit in one 25 MiB bucket gets no
# overlap at all: that bucket is complete only when the last gradient (the embedding's) is,
# at the very end of backward. PyTorch therefore closes its *first* bucket at 1 MiB
# (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`): the gradients backward produces first
# leave at once, while the rest of backward runs. Our DDP does the same
# (`first_bucket_cap_mb=1`). How many bytes can leave before the last gradient is ready,
# for the model timed here and for the 12 MiB model of `benchmarks/bench_data_parallel.py`:

# %%
def early_bytes(config, cap_mb, first_mb):
    """Bytes in buckets other than the last: they can leave before backward's last gradient."""
    sizes = [p.numel() * 4 for p in GPT(config).parameters()]
    first = None if first_mb is None else min(first_mb, cap_mb) * 2**20
    buckets = assign_buckets(sizes, cap_mb * 2**20, first)
    return len(buckets), sum(sizes) - sum(sizes[i] for i in buckets[-1]), sum(sizes)

BENCH = GPTConfig.tiny(DATA.vocab_size, d_model=256, n_layer=4, n_head=8)
for name, config in (("timed model, d_model 128", TIMING), ("benchmark model, d_model 256", BENCH)):
    for first in (None, FIRST_BUCKET_MB):
        n, early, total = early_bytes(config, 25, first)
        print(f"{name} ({total / 2**20:.1f} MiB), 25 MiB buckets, first bucket "
              f"{'= the cap' if first is None else f'{first:g} MiB'}: {n} bucket(s), "
              f"{early / 2**20:.2f} MiB can leave during backward")
assert early_bytes(BENCH, 25, None)[1] == 0 and early_bytes(BENCH, 25, FIRST_BUCKET_MB)[1] >= 2**20

# %% [markdown]
# On the benchmark model the first bucket is one 1 MiB matrix of the last block, so only a
# twelfth of the gradient can overlap; in models with hundreds of MiB of gradients there are
# many 25 MiB buckets and the first one mostly matters for latency. On this machine the gain is
# small either way (communication shares the two cores with backward, section 7);
# `benchmarks/bench_data_parallel.py` measures our DDP against PyTorch's, with and without the
# small first bucket, in interleaved rounds with their spread.
#
# Now a sweep of the bucket size on the timed model (a shared box: timings vary with load).
#
# **Predict first.** Which will be slowest: naive, tiny buckets (0.05 MiB), or one big bucket?
# Which fastest?
#
# <details><summary>Answer</summary>
#
# Naive pays one call, and one Python round trip, per tensor, so it is usually among the
# slowest. Beyond that the ranking changes from run to run on this shared 2-core machine:
# per-call overhead favours few buckets, overlap favours several, and the load of other
# processes moves the balance. That is the point: measure on the hardware you train on.
# </details>

# %% tags=["nbval-ignore-output"]
SWEEP_TRAIN = TrainConfig(steps=6, batch_size=16, progress=False)
caps = [0.05, 0.25, 1.0, 25]

def sweep(config, cfg):
    out = {"naive": train_data_parallel(config, cfg, "naive").step_seconds[2:]}
    for cap in caps:
        out[cap] = train_data_parallel(config, cfg, "ddp", bucket_cap_mb=cap).step_seconds[2:]
    out["25, one bucket"] = train_data_parallel(config, cfg, "ddp", bucket_cap_mb=25,
                                                first_bucket_cap_mb=None).step_seconds[2:]
    return out

t0 = time.perf_counter()
res = run_on_ranks(sweep, TIMING, SWEEP_TRAIN, world_size=2, **RANKS, timeout_s=120)
step_ms = {k: 1e3 * sorted(max(a, b) for a, b in zip(res[0][k], res[1][k]))[len(res[0][k]) // 2] for k in res[0]}
n_b = {cap: early_bytes(TIMING, cap, FIRST_BUCKET_MB)[0] for cap in caps}
for k, ms in step_ms.items():
    what = (f"naive ({len(timing_params)} calls)" if k == "naive" else f"DDP 25 MiB, no small first bucket (1)"
            if k == "25, one bucket" else f"DDP {k:>5} MiB ({n_b[k]:>2} buckets)")
    print(f"{what:<38} {ms:7.1f} ms/step")
fastest = min((k for k in step_ms if k != "naive"), key=step_ms.get)
fastest_name = "25 MiB in one bucket" if fastest == "25, one bucket" else f"{fastest} MiB buckets"
print(f"fastest here: {fastest_name}; naive takes {step_ms['naive'] / step_ms[fastest]:.2f}x as long")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(caps, [step_ms[c] for c in caps], "o-", label="DDP, overlap")
ax.axhline(step_ms["naive"], color="grey", ls="--", label="naive")
ax.set_xscale("log"); ax.set_xlabel("bucket_cap_mb"); ax.set_ylabel("ms per step (median)")
ax.set_title(f"2 ranks, 3.1 MiB of gradients (load average {os.getloadavg()[0]:.1f})", fontsize=9)
ax.legend()
plt.show()

# %% [markdown]
# Read the printout, not a rule: on CPU gloo the per-call overhead is large and overlap buys
# little when the reduction runs on the same two cores as backward (previous section), so
# few, mid-sized buckets often do well here, but the ranking among bucket sizes changes with
# the load. On GPUs the balance shifts toward smaller buckets, because there overlap really
# hides communication. The lesson is the method, not the number: measure the sweep on the
# hardware you train on.
#
# ## 9. Step time against the number of ranks
#
# Keep each rank's batch fixed (8 sequences) and add ranks: the global batch, and the work
# done per step, grow with `N`. On `N` real devices the step time would stay nearly flat —
# compute per rank is constant, and the ring's bytes per rank $2\frac{N-1}{N}S$ barely grow —
# so throughput would grow almost `N`-fold. Here the "devices" are CPU cores, and this
# machine has **2**. To make a rank behave like one device, each rank computes with one
# thread (`torch.set_num_threads(1)`).
#
# **Predict first.** Going from 1 to 2 to 4 ranks on this 2-core machine, what happens to the
# tokens per second?
#
# <details><summary>Answer</summary>
#
# From 1 to 2 it rises (each rank has a core), though less than 2x. From 2 to 4 it cannot
# rise: four ranks share two cores, so it stays about level or drops, by as much as the extra
# communication and process switching cost.
# </details>

# %% tags=["nbval-ignore-output"]
def one_thread_per_rank(*args, **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_data_parallel(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)

scaling = {}
for n in (1, 2, 4):
    cfg = TrainConfig(steps=5, batch_size=8 * n, progress=False)
    res = run_on_ranks(one_thread_per_rank, TIMING, cfg, "ddp", bucket_cap_mb=1.0, world_size=n, **RANKS)
    per_step = sorted(max(r.step_seconds[s] for r in res) for s in range(2, cfg.steps))
    scaling[n] = per_step[len(per_step) // 2]
    print(f"{n} rank(s): {scaling[n] * 1e3:7.1f} ms/step, {8 * n * TIMING.block_size / scaling[n]:8,.0f} tokens/s")
for a, b in ((1, 2), (2, 4)):
    change = (b * scaling[a]) / (a * scaling[b]) - 1  # tokens/s at b ranks vs at a ranks
    print(f"{a} -> {b} ranks: throughput {change:+.0%}")
print(f"(load average {os.getloadavg()[0]:.1f}: other processes share these cores too)")
fig, ax = plt.subplots(1, 2, figsize=(9, 3))
ax[0].bar([str(n) for n in scaling], [1e3 * t for t in scaling.values()])
ax[0].set_xlabel("ranks (8 sequences each)"); ax[0].set_ylabel("ms per step")
ax[1].bar([str(n) for n in scaling], [8 * n * TIMING.block_size / t for n, t in scaling.items()], color="tab:green")
ax[1].set_xlabel("ranks"); ax[1].set_ylabel("tokens per second")
fig.suptitle("weak scaling, one thread per rank, on a 2-core machine", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# From 1 to 2 ranks each rank has a core of its own, like one GPU per rank: the step time
# grows only by the communication and synchronisation cost, and the throughput rises toward
# 2x (less than that here: the gloo threads need CPU time too, and a step waits for the slower
# rank). From 2 to 4 ranks there are no more cores: four ranks share two, each step does
# twice the work on the same silicon and takes at least twice as long, so throughput cannot
# grow; the printed change, a loss whose size depends on the machine's load, is what four
# processes' extra communication and switching cost. (Other processes running on the machine
# blur all of this; the load average is printed.)
# What these runs show is that DP is correct at every `N` and what its communication costs
# on top of compute; real speed-up needs one device per rank: run
# `torchrun --nproc-per-node=N` on a multi-GPU machine for that.
#
# ## 10. Gradient compression
#
# When the network is the bottleneck, send fewer bytes. Two classic ways, both written as
# DDP **comm hooks** in `course_lib/parallel/dp/compression.py` (a hook receives a bucket's flat
# gradient, already divided by `N`, and returns a handle whose `wait()` gives the average):
#
# * **Low precision** (`LowPrecisionHook(torch.bfloat16)`): cast to bf16, all-reduce, cast
#   back. Half the bytes; each value keeps 8 significant bits (spacing $2^{-7}$ at 1.0, so
#   rounding to nearest errs by at most $2^{-8}$ relative).
# * **Top-k sparsification** (`TopKHook(ratio)`): each rank sends only its $k$ largest-magnitude
#   entries, as (value, index) pairs. The ranks pick *different* entries, so the sparse
#   vectors cannot be all-reduced: each rank **all-gathers** everyone's pairs and adds them
#   up. Per rank that is $8k$ bytes sent instead of $4n$, but $8kN$ received: top-k only pays
#   while $k/n \ll 1/N$.
# * **Error feedback**: what a rank did not send is not dropped but remembered,
#   $c = g + e$, send $\text{top}_k(c)$, $e \leftarrow c - \text{top}_k(c)$, and added to the
#   next step's gradient. Every component is applied eventually, only late.
#
# First the bytes, from the tracer, for one step on 2 ranks (one bucket).
#
# **Predict first.** Per rank, what fraction of the fp32 bytes does bf16 send? And top-1% on
# 2 ranks, counting what is sent and what is received?
#
# <details><summary>Answer</summary>
#
# bf16: exactly half. Top-1%: each kept entry costs a 4-byte value and a 4-byte index, so 2%
# of the fp32 bytes are sent; the all-gather then *receives* every rank's pairs, $N$ times
# that (4% on 2 ranks).
# </details>

# %%
def traced_hooks(config, cfg):
    out = {}
    for name, hook in [("fp32", None), ("bf16", LowPrecisionHook()), ("top-1%", TopKHook(0.01))]:
        out[name] = traced_step(config, cfg, "ddp", comm_hook=hook)
    return out

hooks_comm = run_on_ranks(traced_hooks, CONFIG, TRAIN, world_size=2, **RANKS)[0]
S, k = 4 * N_PARAMS, topk_count(N_PARAMS, 0.01)
sent = {name: sum(op["bytes_sent"] for op in c.values()) for name, c in hooks_comm.items()}
recv = {name: sum(op["bytes_recv"] for op in c.values()) for name, c in hooks_comm.items()}
assert sent["fp32"] == S and sent["bf16"] == S // 2
assert sent["top-1%"] == 8 * k and recv["top-1%"] == 2 * 8 * k
for name in sent:
    print(f"{name:>7}: sent {sent[name]:>8,} bytes, received {recv[name]:>8,}  ({sent[name] / S:6.1%} of fp32 sent)")

# %% [markdown]
# Error feedback's promise is exact bookkeeping: after any number of steps,
# *(everything sent) + (what every rank still holds back) = (the sum of all gradients)*.
# Without it, whatever was not in the top-k is gone for good:

# %% tags=["nbval-ignore-output"]
def ef_bookkeeping(steps=20, n_elems=1000):
    rank, out = dist.get_rank(), {}
    for ef in (True, False):
        hook, sent = TopKHook(0.05, error_feedback=ef), torch.zeros(n_elems)
        for step in range(steps):
            g = torch.randn(n_elems, generator=torch.Generator().manual_seed(100 * step + rank)) / 2
            sent += hook(0, g, None).wait()
        out[ef] = (sent, hook.residuals.get(0, torch.zeros(n_elems)))
    return out

ef = run_on_ranks(ef_bookkeeping, world_size=2, **RANKS)
truth = sum(torch.randn(1000, generator=torch.Generator().manual_seed(100 * s + r)) / 2 for s in range(20) for r in range(2))
for flag in (True, False):
    sent_total = ef[0][flag][0]
    held_back = ef[0][flag][1] + ef[1][flag][1]
    gap = (sent_total + held_back - truth).abs().max().item()
    # with error feedback: the same 40 numbers of size ~1 summed in another order, so within ~40 fp32
    # roundings (~1e-5); without it, whole gradients are missing (a gap of order 1)
    assert (gap < 1e-4) == flag
    print(f"error feedback={flag!s:>5}: max |sent + held back - sum of gradients| = {gap:.1e}" if flag else
          f"error feedback={flag!s:>5}: max |sent - sum of gradients| = {(sent_total - truth).abs().max().item():.2f}")

# %% [markdown]
# Now training: 60 steps of the course GPT on 2 ranks, 16 sequences per step, with each hook.
# What counts as "as good as fp32"? A yardstick: fp32 again, on the same batches, from
# initialisation seeds 1, 2 and 3 (the hooks' runs are seed 0). How far apart those four runs
# end is the luck of the initial weights; an effect smaller than that is not one this
# experiment can see, and one larger than it counts as real. (Notebook 04 measures its
# precision recipes against the same yardstick.)

# %%
LONG = TrainConfig(steps=60, batch_size=16, progress=False)
SEEDS = (1, 2, 3)  # the yardstick's other initialisation seeds (GPT(CONFIG) is seed 0)

def loss_curves(config, cfg, seeds):
    hooks = {"fp32 (no compression)": None, "bf16 all-reduce": LowPrecisionHook(),
             "top-1% + error feedback": TopKHook(0.01), "top-1%, no error feedback": TopKHook(0.01, error_feedback=False)}
    runs = {name: train_data_parallel(config, cfg, "ddp", comm_hook=hook).train_losses for name, hook in hooks.items()}
    # fp32 from another initialisation: model_fn(config, seed=cfg.seed) builds the model, here with
    # its own seed; cfg.seed still draws the batches, so only the initial weights change
    for init in seeds:
        runs[f"fp32, seed {init}"] = train_data_parallel(
            config, cfg, "ddp", model_fn=lambda c, seed, init=init: GPT(c, seed=init)).train_losses
    return runs

per_rank = run_on_ranks(loss_curves, CONFIG, LONG, SEEDS, world_size=2, **RANKS, timeout_s=120)
runs = {name: [(a + b) / 2 for a, b in zip(per_rank[0][name], per_rank[1][name])] for name in per_rank[0]}
curves = {name: c for name, c in runs.items() if "seed" not in name}
tail = {name: sum(c[-10:]) / 10 for name, c in runs.items()}
seed_tails = [tail["fp32 (no compression)"]] + [tail[f"fp32, seed {s}"] for s in SEEDS]
spread = max(seed_tails) - min(seed_tails)
fig, ax = plt.subplots(figsize=(7, 3.8))
for (name, c), style in zip(curves.items(), ("-", "--", "-", "-")):
    ax.plot(range(1, len(c) + 1), smooth(c, 0.8), style, label=name)
ax.set_xlabel("step"); ax.set_ylabel("train loss (smoothed)"); ax.legend()
ax.set_title("2 ranks, course GPT, AdamW", fontsize=9)
plt.show()

# %% tags=["nbval-ignore-output"]
for name in curves:
    print(f"{name:<27} mean loss of the last 10 steps: {tail[name]:.3f}")
print(f"fp32 from initialisation seeds 0-3: {', '.join(f'{v:.3f}' for v in seed_tails)}: spread {spread:.3f}")
ef_minus = tail["top-1% + error feedback"] - tail["top-1%, no error feedback"]
print(f"Error feedback ends {abs(ef_minus):.3f} {'above' if ef_minus > 0 else 'below'} top-1% without it, "
      + (f"more than the seeds' spread ({spread:.3f}): here it hurts." if ef_minus > spread else
         f"within the seeds' spread ({spread:.3f}): it does not help beyond what a change of seed does."))
# The yardstick is measured, not a fixed number: every effect is a training result after 60 steps
# that moves with the CPU's kernels and threads, the seeds' spread with them. The spread must be
# real and small: above 0.05 (the seeds do differ) and below a quarter of what the 60 steps lower
# the loss (~1.8), so that "within the spread" still says something.
fp32_tail = tail["fp32 (no compression)"]
fall = curves["fp32 (no compression)"][0] - fp32_tail
assert fall > 1.0 and 0.05 < spread < fall / 4, (seed_tails, fall)
assert abs(tail["bf16 all-reduce"] - fp32_tail) < spread, (tail, spread)  # bf16: as good as fp32
assert tail["top-1%, no error feedback"] > fp32_tail + spread, (tail, spread)  # top-1%: slower, beyond seed luck
assert ef_minus > -spread, (tail, spread)  # error feedback does not help: never lower by more than seed luck

# %% [markdown]
# * **bf16** (dashed) ends closer to fp32 than fp32 runs from different initial weights end
#   from each other: its rounding error is far below the noise of a 16-sequence gradient.
#   Halving gradient bytes this way is routine (it is what mixed precision training's bf16
#   gradients do anyway).
# * **Top-1%** (2% of the bytes on 2 ranks) learns, but slower: in these 60 steps it ends
#   further above fp32 than the seeds' spread.
# * **Error feedback does not help here** (the line above says by how much it moved top-1%'s
#   loss, against the seeds' spread). Its guarantee is about the *sum* of the
#   applied gradients, which is what an update linear in the gradient (SGD) cares about. AdamW
#   divides each coordinate by the running RMS of its own gradient, so a residual that was
#   held back for 30 steps and then arrives at once moves the weight by about one normalised
#   step, not 30; what remains of EF is that the values sent are stale. Published
#   compressors for Adam therefore treat the optimizer specially (e.g. 1-bit Adam freezes the
#   second moment after a warm-up with full precision). Measure before you compress.
#
# ## 11. Large-batch training
#
# Data parallelism multiplies the batch: with $N$ ranks of $b$ sequences each and $A$
# accumulation micro-batches, every step trains on a global batch of $B = N A b$. Adding
# ranks at a fixed per-rank batch makes $B$ grow, and a training run is planned around a
# budget of tokens (of compute), so a larger $B$ means proportionally *fewer* optimizer steps.
# Does the loss at the end of the budget survive that? Three ideas decide it:
#
# * **Learning-rate scaling.** A bigger batch gives a less noisy gradient, so each step can be
#   longer. The **linear rule** multiplies the learning rate by $B/B_0$ (Goyal et al. 2017,
#   for SGD: $k$ small steps ≈ one step $k$ times as long); the **square-root rule** by
#   $\sqrt{B/B_0}$ (Krizhevsky 2014; Hoffer et al. 2017), which is what fits Adam-type
#   optimizers (Malladi et al. 2022).
# * **Warm-up.** A large learning rate applied to random initial weights diverges; ramping it
#   up linearly over the first steps lets the model reach a region where it is safe (Goyal et
#   al. 2017).
# * **The critical batch size.** Beyond some batch size, averaging more examples barely
#   improves the gradient: the steps cannot get longer and the extra tokens are wasted
#   (McCandlish et al. 2018, below).
#
# Since $N$-rank DP with equal shards computes exactly the single-process steps on the global
# batch (section 6), these experiments need no communication: each of 2 ranks trains half of
# the configurations on its own, one thread each. Every run gets the same budget of 1,024
# sequences (65,536 tokens); the base is batch 4 with learning rate $10^{-3}$ (the best of
# $10^{-3}$, $3\cdot10^{-3}$, $10^{-2}$ for batch 4 on this budget), so batch 16 gets 64 steps and batch 64
# only 16. Warm-up, where used, is 4 steps. The yardstick, as in section 10: batch 4 also
# runs from seeds 1, 2 and 3. A seed here sets the initial weights, the order of the batches
# and the validation batches, so how far those four runs end apart (their spread) is the
# luck any single run carries; a gap between two settings counts only when it is larger.
#
# **Predict first.** At batch 64, rank these: no scaling, linear, square root, each with and
# without warm-up. Will the best of them match batch 4's loss?
#
# <details><summary>Answer</summary>
#
# No scaling is clearly bad (16 steps of a size tuned for batch 4). Linear scaling without
# warm-up starts with a 16-fold learning rate on random weights and loses its gain; with
# warm-up it does well, and so does square root (the Adam rule) with warm-up (which of the two
# ends lower is within the seeds' spread). But none matches batch 4: on this model batch 64 is
# beyond the critical batch size, so part of the budget is wasted whatever the schedule.
# </details>

# %% tags=["nbval-ignore-output"]
BUDGET, BASE_B, BASE_LR, WARMUP = 1024 * CONFIG.block_size, 4, 1e-3, 4
BATCH_RUNS = ([(4, "none", 0)] + [(16, rule, 0) for rule in ("none", "linear", "sqrt")]
              + [(64, rule, w) for rule in ("none", "linear", "sqrt") for w in (0, WARMUP) if rule != "none" or not w])

SEED_RUNS = [(BASE_B, "none", 0, seed) for seed in SEEDS]  # the yardstick: batch 4 from seeds 1-3

def budget_runs(config, runs):
    """Rank code: this rank's share of the runs (batch, lr rule, warm-up steps, seed), each
    trained alone on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mine = runs[dist.get_rank()::dist.get_world_size()]
        return {run: train_at_token_budget(config, run[0], BUDGET, BASE_LR, BASE_B, rule=run[1], warmup_steps=run[2],
                                           seed=run[3]) for run in mine}
    finally:
        torch.set_num_threads(threads)

t0 = time.perf_counter()
all_runs = {run: res for part in run_on_ranks(budget_runs, CONFIG, [r + (0,) for r in BATCH_RUNS] + SEED_RUNS,
                                              world_size=2, **RANKS, timeout_s=120) for run, res in part.items()}
lb = {run[:3]: res for run, res in all_runs.items() if run[3] == 0}
final = {run: res.val_losses[-1][1] for run, res in lb.items()}
base = final[(BASE_B, "none", 0)]
base_seeds = [base] + [all_runs[run].val_losses[-1][1] for run in SEED_RUNS]
noise = max(base_seeds) - min(base_seeds)
print(f"{'batch':>5} {'steps':>5} {'lr rule':>8} {'lr':>8} {'warm-up':>7}  val loss after {BUDGET:,} tokens")
for (b, rule, w) in BATCH_RUNS:
    print(f"{b:>5} {len(lb[(b, rule, w)].train_losses):>5} {rule:>8} {scale_lr(BASE_LR, BASE_B, b, rule):>8.1e} "
          f"{w:>7}  {final[(b, rule, w)]:.3f}")
print(f"batch 4 from seeds 0-3: {', '.join(f'{v:.3f}' for v in base_seeds)}: spread {noise:.3f}")
print(f"({time.perf_counter() - t0:.1f} s on 2 ranks)")
best16 = min(final[(16, r, 0)] for r in ("linear", "sqrt"))
best64 = min(v for (b, _, _), v in final.items() if b == 64)
# Every gap is measured against the seeds' spread, not a fixed number: these are training results,
# which move with the CPU's kernels. The spread must be real and small: above 0.05 (the seeds do
# differ) and below a quarter of what the budget lowers the loss (~2.1 from the first step's).
fall = lb[(BASE_B, "none", 0)].train_losses[0] - base
assert fall > 1.0 and 0.05 < noise < fall / 4, (base_seeds, fall)
assert final[(16, "none", 0)] > base + noise and final[(64, "none", 0)] > final[(16, "none", 0)] + noise  # no scaling
assert best16 < base + noise  # scaling brings batch 16 back within the seeds' spread of batch 4
assert best64 < final[(64, "none", 0)] - noise  # scaling matters at batch 64...
assert final[(64, "linear", 0)] > final[(64, "linear", WARMUP)] + noise  # ...and linear needs warm-up:
assert final[(64, "linear", 0)] > final[(64, "none", 0)] - noise  # without it, no better than no scaling
for b, w in ((16, 0), (64, WARMUP)):  # which rule wins is within the seeds' spread
    assert abs(final[(b, "linear", w)] - final[(b, "sqrt", w)]) < noise, (b, final, noise)
assert best64 > base + noise  # but batch 64 is past the critical batch: tokens wasted

fig, ax = plt.subplots(figsize=(6.5, 3.4))
for rule, w, style in (("none", 0, "o--"), ("linear", 0, "s:"), ("sqrt", 0, "^:"), ("linear", WARMUP, "s-"),
                       ("sqrt", WARMUP, "^-")):
    bs = [b for b in (4, 16, 64) if (b, rule, w) in final or b == 4]
    ax.plot(bs, [final.get((b, rule, w), final[(4, "none", 0)]) for b in bs], style,
            label=f"{rule}{' + warm-up' if w else ''}")
ax.set_xscale("log", base=2); ax.set_xticks([4, 16, 64], ["4", "16", "64"])
ax.set_xlabel("global batch (sequences)"); ax.set_ylabel(f"val loss after {BUDGET:,} tokens")
ax.set_title("same token budget, bigger batches: fewer, larger steps", fontsize=9)
ax.legend(title="lr scaling", fontsize=8)
plt.show()

# %% [markdown]
# Read the table with the ideas above, against the seeds' spread printed under it. Without
# scaling, every larger batch ends higher, by more than the spread: the same step size, fewer
# steps. Scaling the learning rate brings batch 16 back to within the spread of batch 4. At
# batch 64, scaling matters, linear scaling needs its warm-up, and even the best schedule stays
# above batch 4 by more than the spread: the extra examples per step no longer buy a
# proportionally longer step. (Which rule wins at batch 16, or among the warmed-up runs at
# batch 64, is a gap smaller than the spread: another seed can change the order.)
#
# ### 11.1 The gradient-noise scale
#
# McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") make "critical" precise.
# Let $G$ be the true gradient and $\Sigma$ the covariance of one example's gradient; a batch
# of $B$ examples gives a gradient $G_B$ with $\mathbb{E}\,|G_B|^2 = |G|^2 + \operatorname{tr}(\Sigma)/B$.
# Noise and signal are equal at the **simple noise scale**
#
# $$B_\text{simple} = \frac{\operatorname{tr}(\Sigma)}{|G|^2}.$$
#
# It predicts the trade-off between steps $S$ and examples $E$ needed to reach a given loss,
# $S = S_\min (1 + B_\text{noise}/B)$ and $E = E_\min (1 + B/B_\text{noise})$: well below
# $B_\text{noise}$, doubling the batch halves the steps at no cost in examples; well above it,
# it wastes examples. The critical batch size is about $B_\text{simple}$.
#
# We estimate it from $k$ gradients $g_1, \dots, g_k$ of independent micro-batches of $b$
# sequences at the same weights (`gradient_noise_scale`): the sample variance gives
# $\operatorname{tr}(\Sigma) \approx b \sum_i |g_i - \bar g|^2/(k-1)$, and
# $|G|^2 \approx |\bar g|^2 - \operatorname{tr}(\Sigma)/(k b)$ removes the noise left in the mean.
# Data-parallel training gets the same estimate for free: every rank holds its local gradient
# (batch $B/N$) before the all-reduce and the global one (batch $B$) after it, and two batch
# sizes are enough (`noise_scale_from_two_batches`, McCandlish et al.'s Appendix A).
#
# **Predict first.** Is $B_\text{simple}$ larger for the freshly initialised model or for the
# model at the end of the batch-4 run?
#
# <details><summary>Answer</summary>
#
# After training, by about an order of magnitude: as the loss falls the true gradient $|G|$
# shrinks much faster than the per-example noise. The critical batch size grows during training,
# which is why large runs ramp their batch size up (GPT-3 did).
# </details>

# %% tags=["nbval-ignore-output"]
def noise_scale_at(params, k=16, b=4):
    model = GPT(CONFIG)
    if params is not None:
        torch.nn.utils.vector_to_parameters(params, model.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # micro-batches of 4 sequences are too small to share between two threads
    try:
        return gradient_noise_scale(micro_batch_gradients(model, DATA, b, k, torch.Generator().manual_seed(0)), b)
    finally:
        torch.set_num_threads(threads)

at_init, trained = noise_scale_at(None), noise_scale_at(lb[(4, "none", 0)].final_params)
for name, est in (("at initialisation", at_init), ("after the batch-4 run", trained)):
    print(f"{name:<22} |G|^2 = {est.grad_sq:.3g}, tr(Sigma) = {est.trace_cov:.3g}: "
          f"B_simple = {est.b_simple:.1f} sequences = {est.b_simple * CONFIG.block_size:,.0f} tokens")
for b in (4, 16, 64):  # McCandlish et al.: examples needed E = E_min (1 + B / B_noise), with B_noise ~ B_simple
    print(f"batch {b:>2} = {b / trained.b_simple:4.2f} x B_simple: about {1 + b / trained.b_simple:.1f} x "
          f"the minimal number of training examples")
# statistical estimates (1.4 and ~15 here), far from these bounds; rounding moves them by far less
assert at_init.b_simple < 5 and trained.b_simple > 3 * at_init.b_simple
assert 8 < trained.b_simple < 32

# %% [markdown]
# This matches the table. Batch 4 is well below the trained model's noise scale, batch 16 is
# close to it (it needs about twice the minimal examples, and with a scaled learning rate it
# ended within the seeds' spread of batch 4), and batch 64 is several times above it: a large part of its tokens are
# wasted, and no schedule gave them back. (These are rough estimates from 16 micro-batches on
# a tiny model; the method, not the number, carries over: measure $B_\text{simple}$ during
# your run, and grow the global batch, and with it the data-parallel degree, while it stays
# below.)
#
# ## 12. Bad input
#
# Arguments are checked in the notebook process, before any rank starts:

# %%
for call in (lambda: DDP(torch.nn.Linear(2, 2), bucket_cap_mb=0),
             lambda: run_data_parallel(ParallelDims(dp=2), CONFIG, TRAIN, "ddp", accum_steps=0),
             lambda: run_data_parallel(ParallelDims(dp=4), CONFIG, TRAIN, "ddp", accum_steps=4),
             lambda: TopKHook(ratio=1.5)):
    try:
        call()
    except ValueError as err:
        print("ValueError:", err)

# %% [markdown]
# Replicas that differ between ranks are caught on the ranks. Different **shapes** (say, one
# rank built the model with another config) make `DDP` and `check_replicas` raise before any
# gradient is exchanged, naming the first parameter that differs. Different **values** with
# the same shapes (each rank seeded its model differently) are refused by
# `naive_all_reduce_gradients`, which has no way to repair them; `DDP` instead broadcasts rank 0's
# values at construction, after which `check_replicas` passes.

# %%
def bad_replicas():
    rank, msgs = dist.get_rank(), []
    try:
        DDP(GPT(GPTConfig.tiny(DATA.vocab_size, d_model=64 if rank == 0 else 32)))
    except ValueError as err:
        msgs.append(f"DDP, shapes differ: {err}")
    model = GPT(CONFIG, seed=rank)  # same shapes, different values
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    try:
        naive_all_reduce_gradients(model)
    except ValueError as err:
        msgs.append(f"naive, values differ: {err}")
    ddp = DDP(model)
    check_replicas(ddp.module)  # raises if still different
    msgs.append("DDP, values differ: broadcast from rank 0 at construction -> check_replicas passes")
    return msgs

for line in run_on_ranks(bad_replicas, world_size=2, **RANKS)[0]:
    print(line)

# %% [markdown]
# ## 13. The one you will use at work: `torch.compile` with DDP and FSDP2
#
# Everything above ran PyTorch eagerly: one Python call, one kernel, per operation.
# `torch.compile` (Ansel et al. 2024) captures a region of the model as a graph (TorchDynamo),
# derives its backward ahead of time (AOTAutograd) and generates fused kernels for it
# (TorchInductor: C++ loops built with the system's C++ compiler on a CPU, Triton kernels on a
# GPU). Large training runs compile, and they compile **per block**: torchtitan (Liang et al.
# 2025) calls `compile` on each transformer block, not on the whole model. The blocks are the
# same code with the same shapes, so one block's forward and backward are compiled once and
# reused by every block, and the compiled regions end exactly where the data-parallel
# machinery starts. `course_lib.techniques.compiled.apply_compile(model)` does that
# (`block.compile()` for every block; the embeddings, the head and the loss stay eager).
#
# **The order rule.** A run that combines them applies, in this order: tensor parallelism
# (notebook 05), activation checkpointing (notebook 04), `compile`, then FSDP or DDP. Each step
# needs the one before it done:
#
# * **TP before compile**: TP swaps a block's weights for shards and adds its collectives to the
#   block's forward. Compilation is lazy (the first forward traces the block), but what it traces
#   must be the split block; compiling first would capture the unsplit one.
# * **Activation checkpointing before compile**: the checkpoint then sits *inside* the compiled
#   region, where the compiler sees which activations are recomputed and plans its saved tensors
#   around them; compiled first, the checkpoint would only re-run an opaque compiled call.
# * **Compile before FSDP**: `fully_shard(block)` adds an all-gather before the block's forward
#   and a reduce-scatter after its backward as hooks, and FSDP2 marks those hooks so that
#   TorchDynamo does not trace them. Wrapping the compiled block keeps one FSDP unit per compiled
#   block: the collectives run outside the compiled graph, overlapping with it as in eager.
#   DDP is the same: its reducer is fed by autograd hooks on the parameters, outside the graph.
#   (Compiling the whole `DDP(model)` instead also works: TorchDynamo's *DDPOptimizer* then
#   splits the captured graph at DDP's bucket boundaries, so that each bucket's all-reduce can
#   start when its piece of backward ends, at the price of one graph per bucket.)
#
# torchtitan's `parallelize` functions apply them in exactly this order ("turn on per-TransformerBlock
# compile after AC wrapping and before FSDP"). Here both wrappers run on 2 CPU ranks, each
# rank stepping an eager and a compiled copy of the course GPT from the same weights, on the same
# rows of one global batch, with one SGD step (plain gradients, so that the comparison is not
# blurred by Adam; see section 3). The compile starts from an empty cache folder, as on a
# learner's first run: every kernel is generated and built by the C++ compiler. (These runs ask
# Inductor for plain scalar C++ loops, which g++ builds in about half the time of vectorised
# ones: the same arithmetic, up to rounding, built faster.)
#
# **Predict first.** Will the compiled step give the same parameters as the eager step, bit for
# bit? And how does the first compiled step's time compare with an eager step?
#
# <details><summary>Answer</summary>
#
# Not bit for bit: Inductor fuses element-wise operations into loops of its own and may add
# the same fp32 terms in another order (a LayerNorm's mean and variance, a bias gradient's sum),
# so the gradients differ in their last bits, far below what any real difference (a missing
# gradient average) moves. The first compiled step costs seconds to minutes instead of
# milliseconds: tracing, generating and building C++ kernels for a block's forward and backward.
# Later steps reuse them, and a second run reads them from the cache folder.
# </details>

# %% tags=["nbval-ignore-output"]
from course_lib.techniques.compiled import compile_unavailable, run_compiled_vs_eager

reason = compile_unavailable()
if reason is not None:  # no C++ compiler: say what fails, and keep the eager runs above
    print("torch.compile cannot build CPU kernels here:", reason)
else:
    t0 = time.perf_counter()
    compiled_steps = run_compiled_vs_eager(CONFIG, world_size=2, **RANKS)
    print(f"2 ranks, cold Inductor cache: {time.perf_counter() - t0:.1f} s for both comparisons\n")
    for i, (mine, other) in enumerate(zip(*compiled_steps)):
        for s in (mine, other):
            # Within the rounding bound (GRAD_RTOL = 1e-4 of the largest gradient: the same fp32 sums
            # in another order), and far from what a gradient left unaveraged moves: a real difference
            # would show. The replicas are bitwise equal: each one averages or gathers the same numbers.
            assert s.max_grad_diff <= s.grad_atol and s.max_param_diff <= s.param_atol, s
            assert s.param_atol < s.max_param_diff_unaveraged / 100, s
        assert torch.equal(mine.params, other.params) and mine.graphs >= 1
        print(f"{mine.kind:>5}: loss eager {mine.loss_eager:.6f}, compiled {mine.loss_compiled:.6f}; "
              f"max|Δgrad| {mine.max_grad_diff:.1e} (bound {mine.grad_atol:.1e}); max|Δθ| after one SGD step "
              f"{mine.max_param_diff:.1e} (bound {mine.param_atol:.1e}; an unaveraged gradient moves "
              f"{mine.max_param_diff_unaveraged:.1e})")
        print(f"       {mine.graphs} graph compiled (one block's, reused by the other); first compiled step "
              f"{mine.compiled_step_s:.1f} s, eager step {mine.eager_step_s:.2f} s; replicas identical")

# %% [markdown]
# The compiled and the eager step agree within fp32 rounding, under DDP and under FSDP2, and
# both replicas hold the same parameters bit for bit. Only one graph was compiled per wrapper:
# the second block reused the first one's. The DDP comparison ran first and paid for building
# every kernel; FSDP2's compiled block is the same computation: it is traced again (its
# parameters now come from FSDP's all-gather), and its kernels, already built, are read from the
# cache folder. On a GPU
# the trade is the same in kind: a compile that costs seconds to minutes once, against faster
# steps for the rest of a run that lasts days. (On this CPU, and a model this small, a compiled
# step is not meant to be faster; the lesson is the order and the equality.)

# %% [markdown]
# ## What to remember
#
# * DP = `N` replicas, `N` shards, one gradient average per step; with equal shards and a
#   mean loss it *is* big-batch training, and clipping/optimizer see the global gradient.
# * A DP rank sends about $2S$ bytes per step on a ring, whatever `N`; what differs between
#   implementations is how many calls that takes and whether it hides behind backward.
# * DDP = buckets (fewer, larger calls) + hooks (launch while backward runs) + in-order
#   launches + a finish that waits; `no_sync` for accumulation; frozen parameters skipped,
#   unused ones reduced as zeros, tied ones once.
# * A small first bucket (1 MiB) lets communication start while backward runs even when the
#   whole gradient would fit in one bucket.
# * Compression trades accuracy for bytes: bf16 is nearly free, top-k needs `k/n ≪ 1/N` to pay
#   at all, and error feedback is designed for SGD-like updates.
# * More ranks mean a bigger global batch and fewer steps per token. Scale the learning rate
#   (linear for SGD, square root for Adam) with a warm-up, and keep the batch below the
#   critical batch size, estimated by the gradient-noise scale $B_\text{simple}$.
# * At work, compile per block, in the order tensor parallelism, activation checkpointing,
#   `torch.compile`, then FSDP or DDP; a compiled step equals the eager one within fp32
#   rounding, not bit for bit.
#
# ## Self-check
#
# 1. 8 ranks, 16 sequences each, mean loss per rank. You average the gradients with a SUM
#    all-reduce and forget to divide by 8. With AdamW and clipping at 1.0, would a comparison of
#    parameters with the single-process run notice? What would?
# 2. A model has 300 MiB of fp32 gradients. How many bytes does each of 64 ranks send per step
#    with a ring all-reduce? With 25 MiB buckets, how many all-reduce calls?
# 3. Why must every rank launch its buckets in the same order, and what does DDP do about a
#    parameter that got no gradient on one rank?
# 4. Why can the bucket holding the tied embedding never overlap with backward?
# 5. You go from 8 to 64 data-parallel ranks at a fixed per-rank batch and a fixed token budget,
#    with AdamW. What do you change in the learning-rate schedule, and what would tell you that
#    the new global batch is too large?
#
# 6. A colleague compiles each block first and applies activation checkpointing afterwards, then
#    `fully_shard`. Does it train correctly? What does the compiler miss?
#
# <details><summary>Answers</summary>
#
# 1. Hardly: AdamW divides by the gradient's running magnitude and clipping rescales, both
#    blind to a constant factor of 8 (only weight decay and `eps` would differ slightly).
#    Comparing the raw averaged gradients with clipping off shows the factor at once.
# 2. $2\cdot\frac{63}{64}\cdot 300$ MiB ≈ 591 MiB per rank; 13 calls (a 1 MiB first bucket,
#    then 25 MiB buckets: 1 + ⌈299/25⌉; one fewer if the parameter sizes let the buckets
#    overshoot into one another).
# 3. Collectives are matched by the order they are issued, not by name: a different order adds
#    unrelated tensors or hangs. A parameter with no gradient joins its bucket as zeros, so that
#    every rank makes the same calls.
# 4. Its gradient is complete only after the embedding's own backward, the last operation of
#    backward (the head's use adds earlier, but the hook fires once, when both have been added).
# 5. Multiply the learning rate by about $\sqrt{8} \approx 2.8$ (square root for Adam) and add
#    or lengthen the warm-up. The global batch is too large when it exceeds the measured
#    noise scale $B_\text{simple}$: then the loss per token gets worse, whatever the schedule.
# 6. It trains correctly (checkpointing an opaque compiled call still recomputes the same
#    numbers), but the checkpoint lies outside the compiled region: the compiler cannot see
#    which activations will be recomputed, so it cannot plan its saved tensors around them.
#    Checkpoint first, then compile, then shard.
# </details>

# %% [markdown]
# ## References
#
# What this notebook relies on:
#
# * Li et al. (2020). *PyTorch Distributed: Experiences on Accelerating Data Parallel
#   Training*, PVLDB 13(12): the design of PyTorch's `DistributedDataParallel` (buckets in
#   reverse order, gradient hooks, overlap, `no_sync`) that section 5 rebuilds.
# * Li et al. (2014). *Scaling Distributed Machine Learning with the Parameter Server*, OSDI
#   2014, and Patarasuk & Yuan (2009). *Bandwidth optimal all-reduce algorithms for clusters of
#   workstations*, Journal of Parallel and Distributed Computing 69(2): the two ways of
#   averaging of section 1 (notebook 02 builds both).
# * Seide et al. (2014). *1-Bit Stochastic Gradient Descent and its Application to
#   Data-Parallel Distributed Training of Speech DNNs*, Interspeech 2014, and Stich, Cordonnier
#   & Jaggi (2018). *Sparsified SGD with Memory*, NeurIPS 2018: error feedback, and top-k
#   sparsification with it (section 10).
# * Tang et al. (2021). *1-bit Adam: Communication Efficient Large-Scale Training with Adam's
#   Convergence Speed*, ICML 2021: why compression for Adam needs special care (section 10).
# * Goyal et al. (2017). *Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour*,
#   arXiv:1706.02677: the linear scaling rule and warm-up (section 11).
# * Krizhevsky (2014). *One weird trick for parallelizing convolutional neural networks*,
#   arXiv:1404.5997, and Hoffer, Hubara & Soudry (2017). *Train longer, generalize better:
#   closing the generalization gap in large batch training of neural networks*, NeurIPS 2017:
#   the square-root rule.
# * Malladi et al. (2022). *On the SDEs and Scaling Rules for Adaptive Gradient Algorithms*,
#   NeurIPS 2022: why the square-root rule is the one that fits Adam.
# * McCandlish et al. (2018). *An Empirical Model of Large-Batch Training*, arXiv:1812.06162:
#   the gradient-noise scale and the critical batch size (section 11.1).
# * Ansel et al. (2024). *PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode
#   Transformation and Graph Compilation*, ASPLOS 2024: TorchDynamo, AOTAutograd and
#   TorchInductor, the three parts of `torch.compile` (section 13).
# * Liang et al. (2025). *TorchTitan: One-stop PyTorch native solution for production ready LLM
#   pre-training*, ICLR 2025: per-block compilation and the order in which it composes tensor
#   parallelism, activation checkpointing and FSDP2 (section 13).
#
# Further reading:
#
# * Li et al. (2020): read it whole for what this notebook leaves out, such as finding unused
#   parameters, and how bucket size and overlap behave at scale on real GPUs.
# * McCandlish et al. (2018): how to estimate the critical batch size of your own model
#   before paying for a large-batch run.
# * Shallue et al. (2019). *Measuring the Effects of Data Parallelism on Neural Network
#   Training*, Journal of Machine Learning Research 20: a large measured study of how the
#   number of steps to a target falls (or stops falling) as the batch grows.
#
# **Next:** write the bucketed, overlapped DDP yourself in `exercises/ex03_ddp.ipynb`.
