# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/09_context_parallelism.ipynb)

# %% [markdown]
# # 09 · Long sequences and context parallelism
#
# Every strategy so far split the batch (data parallelism, ZeRO), the weights (tensor and
# pipeline parallelism) or the experts. None of them helps when **one sequence** is too long:
# at 128K tokens the activations of a single sequence outgrow a GPU even when the weights are
# spread over hundreds of them. Llama 3 405B was trained on sequences of 131,072 tokens by
# splitting each sequence over 16 GPUs, on top of 8-way tensor and 16-way pipeline parallelism
# (Dubey et al. 2024, Table 4). That fifth axis is **context parallelism** (CP): each of `cp`
# ranks holds $T/cp$ tokens of every sequence, and the ranks exchange what attention needs.
#
# **After this notebook you can**
#
# * say why attention's memory and time grow with the sequence length, and what a fused
#   attention kernel keeps instead of the $s \times s$ scores, measured on one process;
# * merge two partial attention results by their log-sum-exp, by hand, and say why a plain
#   average is wrong;
# * read ring attention's per-rank timeline and point at the sends and receives that overlap
#   the compute;
# * explain why contiguous chunks overload the last rank under a causal mask, count the work
#   per rank, and show how the zig-zag assignment evens it;
# * compare ring attention, all-gather K/V and Ulysses by the bytes each rank sends per layer
#   (traced against the formula) and say when each wins: heads against ranks, grouped-query
#   attention, NVLink against InfiniBand;
# * measure activation memory per rank against the sequence length, and read the estimator's
#   numbers for Llama 3 405B at 128K tokens;
# * show that a context-parallel GPT trains exactly like the single-process one.

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
import math
import time
from dataclasses import replace

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import CommTracer, run_on_ranks
from course_lib.comm.measured import collective_time
from course_lib.data import CharDataset, get_batch
from course_lib.dims import ParallelDims
from course_lib.estimate import LLAMA3_8B
from course_lib.estimate.clusters import LONG_CONTEXT, published_estimate
from course_lib.estimate.context import ring_exposed
from course_lib.estimate.traffic import cp_traffic, wire_bytes
from course_lib.model import GPT, GPTConfig
from course_lib.model.layers import CausalAttention
from course_lib.observe.memory import SavedActivations
from course_lib.parallel.cp import SequenceLayout, attention_work, context_attention
from course_lib.parallel.cp import figures
from course_lib.parallel.cp.apply import apply_context_parallel, shard_batch
from course_lib.parallel.cp.training import run_context_parallel
from course_lib.parallel.cp.viz_ring import RingRecorder, overlaps
from course_lib.train import TrainConfig, flat_grads, flat_params, train_reference
from course_lib.units import fmt_bytes
from course_lib.widgets import show_interactive

torch.manual_seed(0)
V = CharDataset("train").vocab_size
CP = 4  # context-parallel ranks in every run below
RANKS = dict(backend="gloo", timeout_s=180)  # CPU ranks, even on a GPU machine
print(f"{CP} context-parallel ranks; every run below uses the same pool of {CP} gloo processes")

# %% [markdown]
# ## 1. Why attention grows with the sequence length
#
# Every op of a transformer layer but one acts on each token alone: LayerNorm, the Q/K/V and
# output projections, the MLP. Their memory and time grow like $s$, the number of tokens.
# Attention is the exception: each of the $s$ queries scores every key at or before it, so
# one head computes an $s \times s$ matrix of scores $S = QK^\top/\sqrt{d_{head}}$, then
# $\mathrm{softmax}(S)\,V$. For $B$ sequences and $H$ heads of dimension $h_d$ that is
# $2 \cdot 2 B H s^2 h_d$ FLOPs forward (two matmuls), and a naive implementation keeps the
# $B H s^2$ softmax weights for backward.
#
# A **fused** kernel (FlashAttention, Dao et al. 2022; PyTorch's
# `F.scaled_dot_product_attention`) never stores them. It walks over the keys block by block,
# keeps for each query only a running maximum, a running sum of exponentials and the running
# output, and saves for backward the output and one number per query, the log-sum-exp of its
# scores; backward recomputes the scores block by block. Memory becomes linear in $s$; the
# FLOPs stay quadratic.
#
# Per attention call, in fp32 ($e = 4$ bytes), what autograd keeps:
#
# | | saved for backward |
# |---|---|
# | naive | $Q, K, V$: $3eBHs\,h_d$ + softmax weights $eBHs^2$ + the boolean causal mask $s^2$ |
# | fused | $Q, K, V$, output: $4eBHs\,h_d$ + log-sum-exp $4BHs$ |
#
# **Predict.** Doubling $s$ from 256 to 512 with 4 heads of dimension 16: by how much does each
# grow?
#
# <details><summary>Answer</summary>
#
# The fused one exactly doubles (every term is linear in $s$). The naive one grows by almost
# 4: at $s = 256$ its $s^2$ terms (1 MiB + 64 KiB) already outweigh $Q, K, V$ (192 KiB), so the
# ratio is $(3 \cdot 4 \cdot 4 \cdot 512 \cdot 16 + 4 \cdot 4 \cdot 512^2 + 512^2)/(\dots \text{at } 256) \approx 3.7$.
# </details>

# %%
B, H, HD = 1, 4, 16
SEQS = (64, 128, 256, 512)


def saved_bytes(impl, s):
    q, k, v = (torch.randn(B, H, s, HD, requires_grad=True) for _ in range(3))
    attend = CausalAttention(impl)
    with SavedActivations(attend) as saved:
        attend(q, k, v)
    return saved.bytes


def formula(impl, s, e=4):
    if impl == "naive":
        return 3 * e * B * H * s * HD + e * B * H * s * s + s * s
    return 4 * e * B * H * s * HD + 4 * B * H * s


measured = {impl: [saved_bytes(impl, s) for s in SEQS] for impl in ("naive", "fused")}
print(f"{'s':>5}{'naive (measured = formula)':>30}{'fused (measured = formula)':>30}")
for i, s in enumerate(SEQS):
    for impl in measured:
        assert measured[impl][i] == formula(impl, s)  # bytes: exact
    print(f"{s:>5}{fmt_bytes(measured['naive'][i]):>30}{fmt_bytes(measured['fused'][i]):>30}")
ratio = {impl: measured[impl][-1] / measured[impl][-2] for impl in measured}
print(f"from s = {SEQS[-2]} to {SEQS[-1]}: naive x{ratio['naive']:.2f}, fused x{ratio['fused']:.2f}")
fig, ax = plt.subplots(figsize=(5.5, 3.2))
figures.plot_attention_memory(ax, SEQS, measured)
ax.set_title(f"one attention call, B={B}, H={H}, head dim {HD}, fp32", fontsize=9)
plt.show()

# %% [markdown]
# The time does not get the same rescue: the fused kernel still computes every score, so each
# doubling of $s$ multiplies the FLOPs by four. Timed on this CPU: forward and backward of the
# fused kernel on one thread, as the CPU time of that thread (what other processes take from
# the core does not count), the median of 5 rounds that run every length in turn.

# %% tags=["nbval-ignore-output"]
def cpu_seconds_fused(q, k, v):
    start = time.thread_time()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return time.thread_time() - start


LENGTHS = (1024, 2048, 4096, 8192)
inputs = {s: [torch.randn(B, H, s, HD, requires_grad=True) for _ in range(3)] for s in LENGTHS}
threads = torch.get_num_threads()
torch.set_num_threads(1)  # one thread: its CPU time is the kernel's whole work
try:
    for s in LENGTHS:
        cpu_seconds_fused(*inputs[s])  # warm-up
    rounds = {s: [] for s in LENGTHS}
    for r in range(5):
        for s in (LENGTHS if r % 2 else LENGTHS[::-1]):  # alternate the order: drift falls on every length
            rounds[s].append(cpu_seconds_fused(*inputs[s]))
finally:
    torch.set_num_threads(threads)
times = {s: sorted(t)[len(t) // 2] for s, t in rounds.items()}  # the median round
ratios = [times[s] / times[s // 2] for s in LENGTHS[1:]]
for s, t in times.items():
    flops = 3 * 4 * B * H * s * s * HD / 2  # forward + backward (2x forward), half the scores visible
    ratio = f"x{t / times[s // 2]:.2f} the time of s = {s // 2}" if s // 2 in times else ""
    print(f"s = {s:>5}: {t * 1e3:7.1f} ms   ({flops / 1e6:,.0f} MFLOP of causal attention)   {ratio}")
print(f"Each doubling of s multiplied the time by {', '.join(f'{r:.2f}' for r in ratios)} for 4x the FLOPs: "
      f"from {ratios[0]:.1f} at the shortest to {ratios[-1]:.1f} at the longest, towards 4.")
# Medians of one thread's CPU time moved by 3% or less between runs here, alone and with both cores
# busy: the ratios rose by 5% or more per row, and the last sat at 3.8 on PyTorch's AVX-512, AVX2
# and scalar kernels alike. 3.2 leaves room for a slower memory system; 4.4 for noise above 4.
assert ratios[0] < ratios[-1] and 3.2 < ratios[-1] < 4.4, ratios

# %% [markdown]
# The ratio rises with $s$ towards 4. The kernel works in tiles of queries and keys and skips
# only the tiles wholly above the diagonal, so it computes more than half of the $s^2$ scores,
# a share that falls towards one half as $s$ outgrows the tiles; and some of its work (the
# running maxima and sums, the output, the calls themselves) grows only like $s$. Both weigh
# less at each doubling, and the $s^2$ work more.
#
# Even fused, attention at 128K tokens is out of reach for one GPU: Llama 3 405B's 126 layers
# keep, per sequence of 131,072 tokens, at least the layer inputs and $Q, K, V$, several
# gigabytes per layer (section 9 has the estimator's numbers). The cure is to split the
# **sequence**: each of $cp$ ranks holds $T/cp$ tokens of every layer's input. All the
# per-token ops run unchanged on a shard; attention is the only one that needs the other
# ranks, because a rank's queries must see every earlier key.
#
# ## 2. What each rank holds
#
# A sequence of $T$ tokens is cut into chunks. The simple choice gives rank $r$ chunk $r$ of
# $cp$ contiguous chunks. The load-balanced one (section 4 explains why) cuts $2cp$ chunks and
# gives each rank one chunk from each end of the sequence ("zig-zag"). With $T = 16$ and
# $cp = 4$:

# %%
for lb in (False, True):
    layout = SequenceLayout(16, CP, load_balance=lb)
    print("zig-zag   " if lb else "contiguous")
    for r in range(CP):
        print(f"   rank {r}: positions {layout.positions(r).tolist()}")

# %% [markdown]
# Each rank embeds its tokens with their **absolute** positions (the model's position
# embedding takes them as an argument), runs every per-token op on its shard, and computes the
# loss of its own tokens. The ranks hold whole copies of the weights, as under data
# parallelism, so their gradients are averaged over the cp group.
#
# ## 3. The online-softmax merge, by hand on two blocks
#
# A rank that sees the keys in pieces, one block now and another later, cannot compute a
# softmax over all of them in one go. It computes each block's **partial result**: the output
# $o_a = \sum_{j \in a} \frac{e^{S_j}}{\sum_{i \in a} e^{S_i}} v_j$ over the block's keys
# alone, and the block's log-sum-exp $\ell_a = \log \sum_{j \in a} e^{S_j}$. Two partials
# then combine exactly (Milakov & Gimelshein 2018; the rescaling inside FlashAttention):
#
# $$\ell = \log\left(e^{\ell_a} + e^{\ell_b}\right), \qquad
#   o = e^{\ell_a - \ell}\, o_a + e^{\ell_b - \ell}\, o_b .$$
#
# $e^{\ell_a - \ell}$ is block $a$'s share of the whole softmax denominator, so each partial
# output is weighted by how much of the probability mass its keys hold.
#
# **Predict.** One query, four keys in two blocks of two. Its scaled scores are
# $S = (2.0,\ 1.0 \mid 0.5,\ 3.0)$, the values (one number each, to keep it readable)
# $v = (1, 2 \mid 3, 4)$. Block $b$ holds the largest score. Is the merged output closer to
# $o_a$ or to $o_b$, and is it their average?
#
# <details><summary>Answer</summary>
#
# Closer to $o_b$: block $b$ holds $e^{3.08} \approx 21.7$ of the denominator's
# $\approx 31.8$, about 68 %. The average weighs the two blocks equally and is off by
# about 0.49. The numbers are below.
# </details>

# %%
scores, values = [2.0, 1.0, 0.5, 3.0], [1.0, 2.0, 3.0, 4.0]
blocks = {"a": (scores[:2], values[:2]), "b": (scores[2:], values[2:])}
partial = {}
for name, (s, v) in blocks.items():
    z = sum(math.exp(x) for x in s)                               # this block's denominator
    out = sum(math.exp(x) / z * y for x, y in zip(s, v))          # softmax over this block only
    partial[name] = (out, math.log(z))
    print(f"block {name}: scores {s}, values {v} -> partial output {out:.4f}, log-sum-exp {math.log(z):.4f}")
(o_a, l_a), (o_b, l_b) = partial["a"], partial["b"]
l_all = math.log(math.exp(l_a) + math.exp(l_b))
w_a, w_b = math.exp(l_a - l_all), math.exp(l_b - l_all)
merged = w_a * o_a + w_b * o_b
print(f"weights: block a {w_a:.4f}, block b {w_b:.4f} (they sum to {w_a + w_b:.4f})")
full = (torch.softmax(torch.tensor(scores, dtype=torch.float64), 0) @ torch.tensor(values, dtype=torch.float64)).item()
print(f"merged {merged:.4f}   softmax over all four keys {full:.4f}   plain average {(o_a + o_b) / 2:.4f}")
assert abs(merged - full) < 1e-12  # float64: a handful of roundings of numbers near 1
assert abs((o_a + o_b) / 2 - full) > 0.1

# %% [markdown]
# The merge is exact, so a rank can visit the key blocks in any order, one at a time, and keep
# only a running $(o, \ell)$ per query: that is how both FlashAttention (blocks of keys in
# fast on-chip memory) and ring attention (blocks of keys arriving from other ranks) work. Two
# questions the exercise makes you answer in code: what is the partial result of a block in
# which a query sees **no** key (all masked out by causality), and how do you merge it without
# producing `nan`?
#
# ## 4. The causal imbalance and the zig-zag fix
#
# Under a causal mask the query at position $p$ scores $p + 1$ keys. With contiguous chunks,
# rank 0's queries come first and see few keys; the last rank's see almost the whole
# sequence. Every rank waits for the slowest at the next collective, so the step takes as long
# as the last rank's attention. Below, each visible (query, key) pair of a 16-token sequence
# coloured by the rank that computes it (the rank holding the query).
#
# **Predict.** With $cp = 4$ contiguous chunks of $c$ tokens, how many times rank 0's work does
# rank 3 do, for a long sequence? And with the zig-zag assignment?
#
# <details><summary>Answer</summary>
#
# Rank $r$'s queries see $rc$ earlier keys each plus a triangle: $W_r = c^2 r + c(c+1)/2$, so
# $W_3/W_0 = 1 + 6c/(c+1)$, which tends to $2cp - 1 = 7$. Zig-zag pairs an early chunk with
# a late one, $r$ with $2cp-1-r$, and the two sum to the same work on every rank.
# </details>

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
counted = {lb: figures.plot_causal_owners(axes[i], 16, CP, lb) for i, lb in enumerate((False, True))}
figures.plot_work_per_rank(axes[2], 96, CP)
plt.tight_layout()
plt.show()
for lb, counts in counted.items():
    assert counts == attention_work(16, CP, lb)  # the picture's cells = the closed form, exactly
for T, cp in ((16, 4), (96, 4), (131_072, 16)):
    contiguous, zigzag = attention_work(T, cp, False), attention_work(T, cp, True)
    print(f"T = {T:>7,}, cp = {cp:>2}: contiguous, last / first rank = {contiguous[-1] / contiguous[0]:6.2f} "
          f"(2cp - 1 = {2 * cp - 1});  zig-zag, max / min = {max(zigzag) / min(zigzag):.2f}")
    assert sum(contiguous) == sum(zigzag) == T * (T + 1) // 2  # the whole causal triangle, either way
    assert len(set(zigzag)) == 1

# %% [markdown]
# Zig-zag gives every rank exactly the same number of pairs, at any length; Llama 3 cuts its
# sequences into $2 \times cp$ chunks this way (Dubey et al. 2024, §3.3.2). Striped attention
# (Brandon et al. 2023) balances differently: rank $r$ takes every $cp$-th token (positions
# $r, r + cp, r + 2cp, \dots$), so every block of keys a rank meets is about half visible; the
# authors measured up to 1.45x the end-to-end training throughput of contiguous ring attention
# at 256K tokens.
#
# ## 5. Ring attention on a timeline
#
# Ring attention (Liu et al. 2023) never gathers the sequence. The $cp$ ranks form a ring; at
# step $t = 0, \dots, cp-1$ rank $r$ holds the K and V block of rank $(r - t) \bmod cp$. During
# the step it **sends** that block on to rank $r+1$ and **receives** the next one from rank
# $r-1$, and meanwhile attends its queries to the block it holds, merging the partial result
# into its running $(o, \ell)$ as in section 3. After $cp$ steps every query has seen every key,
# and no rank ever held more than two K/V blocks. If a block's attention takes longer than
# sending it, the communication is hidden. Under the causal mask a block whose keys all come
# after all of the rank's queries contributes nothing and is skipped.
#
# Backward is a second ring: K and V travel round again, and with them an accumulator of their
# gradients, dK and dV, to which each rank adds its queries' share before passing it on; one
# last hop brings each accumulator home.
#
# **Predict.** $cp = 4$, contiguous chunks. In forward, how many blocks does rank 0 compute,
# and rank 3? With the zig-zag layout?
#
# <details><summary>Answer</summary>
#
# Contiguous: rank $r$ computes $r + 1$ blocks (its own and those of the ranks before it);
# every later block is wholly in its future, so rank 0 computes 1 block and then only passes
# blocks on, while rank 3 computes 4. Zig-zag: every rank holds an early and a late chunk, so
# every block has visible pairs and every rank computes all 4, each about the same amount.
# </details>

# %%
T_RING = 1024  # 256 tokens per rank


def ring_run(seq_len, load_balance):
    """One forward and backward of ring attention on this rank's shard, timed by RingRecorder,
    and checked against the single-process attention of the same rows."""
    layout, rank = SequenceLayout(seq_len, CP, load_balance), dist.get_rank()
    g = torch.Generator().manual_seed(0)  # the same full sequence on every rank
    q, k, v = (torch.randn(B, H, seq_len, HD, generator=g) for _ in range(3))
    shards = [layout.shard(t, rank, dim=2).requires_grad_() for t in (q, k, v)]
    context_attention(*shards, layout.positions(rank), None, layout, "ring").sum().backward()  # warm-up
    for t in shards:
        t.grad = None
    with RingRecorder(layout) as recorder:
        out = context_attention(*shards, layout.positions(rank), None, layout, "ring")
        out.sum().backward()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # fp32: the ring adds the same exponentials in another order, over at most 1024 keys, on outputs of size ~1
    assert torch.allclose(out, layout.shard(full, rank, dim=2), rtol=1e-5, atol=1e-5)
    return recorder.events


timelines = {lb: run_on_ranks(ring_run, T_RING, lb, world_size=CP, **RANKS) for lb in (False, True)}
for lb, per_rank in timelines.items():
    fwd = [sum(name.startswith("fwd") for name, *_ in events) for events in per_rank]
    bwd = [sum(name.startswith("bwd") for name, *_ in events) for events in per_rank]
    hidden = [overlaps(events, "fwd") for events in per_rank]
    print(f"{'zig-zag   ' if lb else 'contiguous'}: blocks computed in forward per rank {fwd}, of them computed "
          f"while the next block was on its way {hidden}")
    assert fwd == bwd == ([CP] * CP if lb else [r + 1 for r in range(CP)])
    # forward: every step but the last posts its exchange before computing and waits after
    assert hidden == [min(n, CP - 1) for n in fwd]
    # backward: the K/V hop overlaps the same way (and, here, the dK/dV hop of the step before)
    assert all(overlaps(events, "bwd") >= min(n, CP - 1) for events, n in zip(per_rank, bwd))
print("every rank's output equals the single-process attention of its rows")

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(2, 1, figsize=(10, 5.6))
for ax, (lb, per_rank) in zip(axes, timelines.items()):
    busy = [sum(e - s for _, s, e, lane in events if lane == "compute") for events in per_rank]
    figures.plot_ring_timeline(ax, per_rank, f"{'zig-zag' if lb else 'contiguous'}: T = {T_RING}, cp = {CP}, "
                               f"compute per rank {', '.join(f'{b * 1e3:.0f}' for b in busy)} ms")
plt.tight_layout()
plt.show()

# %% [markdown]
# Read each rank's three lanes: the blue bars are the attention of one block (labelled with
# the rank whose K/V it used: forward, then backward), the red bars a K/V block travelling
# from its post to the wait that consumes it, the purple ones the dK/dV accumulators of
# backward. In forward every blue bar but the last step's sits under a red one: the next
# block was already on its way while the rank computed (the counts printed above); at the last
# step nothing is left to fetch. In backward the K/V blocks and the dK/dV accumulators both
# travel while the rank computes; only the last hop of the accumulators, home to their owners,
# has nothing left to hide behind. In the contiguous run rank 0 computes one block and then
# only passes blocks on; in the zig-zag run every rank computes every block, the same work.
# On GPUs the same picture decides whether the ring is free: a step hides its message when one
# block's attention ($4 B H c^2 h_d$ FLOPs for a chunk of $c$ tokens) takes longer than sending
# $2 B H c\, h_d$ elements; both grow with $c$, the FLOPs faster, so long sequences hide it.
#
# ## 6. Three ways to see the other ranks' keys
#
# Ring attention is one answer. Two others are in use, and the library runs all three behind
# one call, `context_attention(q, k, v, q_pos, group, layout, method)`:
#
# * **all-gather K/V** (Llama 3's choice, Dubey et al. 2024, §3.3.2): gather the keys and
#   values of the whole sequence once per layer, attend the local queries to them, and in
#   backward reduce-scatter their gradients. One collective, any attention mask is easy, and
#   with grouped-query attention (GQA: fewer K/V heads than query heads) K and V are small.
#   The gather is not hidden behind compute, and the rank holds the whole sequence's K and V
#   for the layer.
# * **ring** (section 5): the same K/V bytes, as $cp - 1$ point-to-point steps that overlap
#   the compute, never more than two blocks held; backward sends the K/V blocks round again
#   plus their gradients.
# * **Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns "all heads, my
#   $T/cp$ tokens" into "$H/cp$ heads, all $T$ tokens"; each rank runs ordinary attention on
#   its heads, and a second all-to-all turns the output back. It needs $cp \mid H$ (and
#   $cp \mid H_{kv}$), so the number of heads caps $cp$.
#
# What each sends per layer and rank, on the wire, forward and backward together. Write
# $s = T/cp$ for the rank's tokens, $k = B\,s\,H_{kv} h_d\,e$ for the bytes of its keys (as many
# for its values) and $q = B\,s\,H h_d\,e$ for its queries (as many for its output):
#
# | method | forward | backward | per layer |
# |---|---|---|---|
# | all-gather | all-gather of K and V: $(cp-1) \cdot 2k$ | reduce-scatter of dK, dV: $(cp-1) \cdot 2k$ | $4(cp-1)\,k$ |
# | ring | $cp - 1$ hops of K and V: $(cp-1) \cdot 2k$ | K and V again, and dK, dV one hop more: $(2cp - 1) \cdot 2k$ | $(6cp - 4)\,k$ |
# | Ulysses | all-to-all of Q, K, V, then of O: $\frac{cp-1}{cp}(2q + 2k)$ | dO, then dQ, dK, dV: the same | $4\,\frac{cp-1}{cp}(q + k)$ |
#
# Since $k \propto T/cp$, the all-gather's and the ring's bytes per rank stay near $4BTH_{kv}h_d e$
# and $6BTH_{kv}h_d e$ whatever $cp$; Ulysses' fall like $1/cp$ (Jacobs et al. 2023: constant
# when $T$ and $cp$ grow together), but they include the queries and outputs, $H$ heads instead
# of $H_{kv}$.
#
# **Predict.** The course GPT (4 heads, no GQA), $T = 64$, $cp = 4$. Which method sends the
# fewest bytes per layer, and which the most?
#
# <details><summary>Answer</summary>
#
# With $q = k$: all-gather $12k$, ring $20k$, Ulysses $4 \cdot \frac34 \cdot 2k = 6k$. Ulysses
# sends the fewest, the ring the most. Below, the tracer counts them on 4 ranks.
# </details>

# %%
MEM_CONFIG = GPTConfig.tiny(V, block_size=256)  # 2 layers, 4 heads, d_model 64
MEM_SEQS, MEM_BATCH = (64, 128, 256), 2


def one_step_on_ranks(config, seqs, batch):
    """Per method and sequence length: the bytes autograd keeps on this rank for one forward
    of the context-parallel GPT (zig-zag), and the calls and bytes the tracer sees in that
    forward and its backward."""
    out = {}
    for method in ("ring", "allgather", "ulysses"):
        for T in seqs:
            model = apply_context_parallel(GPT(config, seed=0), None, method, load_balance=True, seq_len=T)
            x, y = get_batch(CharDataset("train", block_size=T), batch, torch.Generator().manual_seed(0))
            with CommTracer() as tracer:
                with SavedActivations(model) as saved:
                    loss = model(*shard_batch(x, y, model.cp_layout, dist.get_rank()))[1]
                loss.backward()
            out[method, T] = saved.bytes, tracer.summary()
    return out


per_rank = run_on_ranks(one_step_on_ranks, MEM_CONFIG, MEM_SEQS, MEM_BATCH, world_size=CP, **RANKS)

# %%
def wire_per_layer(method, cp, k, q):
    """Bytes a rank sends per layer, forward + backward (the table above); k: its K bytes, q: its Q bytes."""
    return {"allgather": 4 * (cp - 1) * k, "ring": (6 * cp - 4) * k, "ulysses": 4 * (cp - 1) / cp * (q + k)}[method]


# The tracer counts what each call is given (notebook 08); on a ring, an all-gather sends its input cp - 1
# times, a reduce-scatter and an all-to-all (cp - 1)/cp of theirs, a point-to-point send exactly its bytes.
ON_THE_WIRE = {"isend": 1, "irecv": 0, "all_gather_single": CP - 1, "reduce_scatter_single": (CP - 1) / CP,
               "all_to_all_single": (CP - 1) / CP}
T = 64
k = MEM_BATCH * (T // CP) * MEM_CONFIG.d_model * 4  # one rank's K (and V, Q, O) in fp32: no GQA here
print(f"T = {T}, cp = {CP}, per layer and rank (k = {k:,} bytes):")
for method in ("allgather", "ring", "ulysses"):
    summary = per_rank[0][method, T][1]
    calls = {op: v["calls"] // MEM_CONFIG.n_layer for op, v in summary.items() if op != "irecv"}
    wire = sum(ON_THE_WIRE[op] * v["bytes_sent"] for op, v in summary.items()) / MEM_CONFIG.n_layer
    assert set(summary) <= set(ON_THE_WIRE)  # nothing else communicates
    assert wire == wire_per_layer(method, CP, k, k)  # traced = formula, exactly
    # and = the estimator's records (notebooks 10 and 11 read them): bytes summed over the ranks, calls on rank 0
    records = cp_traffic(MEM_CONFIG, ParallelDims(cp=CP, cp_method=method), MEM_BATCH, T, act_bytes=4)
    assert sum(r.world_bytes for r in records) == sum(sum(v["bytes_sent"] for v in p[method, T][1].values())
                                                      for p in per_rank)
    assert sum(r.calls for r in records) == sum(v["calls"] for v in summary.values())
    assert sum(wire_bytes(r) for r in records) / MEM_CONFIG.n_layer == wire
    print(f"  {method:>9}: {calls}  on the wire {wire / k:4.0f} k = {fmt_bytes(wire)}")

# %% [markdown]
# The tracer's counts equal the table's, and the estimator's `cp_traffic` records (what
# notebooks 10 and 11 price) equal both. Which method wins depends on three things:
#
# * **heads against ranks.** Ulysses cannot go past $cp = H_{kv}$ (8 for Llama 3, whatever its
#   size) without replicating K/V heads; the ring and the all-gather only need $cp \mid T$.
# * **GQA.** The all-gather and the ring move only K and V, so grouped-query attention shrinks
#   their bytes by $H/H_{kv}$, while Ulysses still moves Q and the output: the ratio of
#   Ulysses' bytes to the all-gather's is $\frac{H + H_{kv}}{cp\,H_{kv}}$. For Llama 3 8B
#   ($H = 32$, $H_{kv} = 8$) at 128K tokens and $cp = 8$, and for the same model with one K/V
#   head per query head, from the same formulas:

# %%
T_8B, cp8 = 131_072, 8
for name, config in (("Llama 3 8B, GQA (8 K/V heads)", LLAMA3_8B),
                     ("the same with 32 K/V heads (MHA)", replace(LLAMA3_8B, n_kv_head=32))):
    hd = config.d_model // config.n_head
    k8, q8 = (T_8B // cp8) * config.n_kv_head * hd * 2, (T_8B // cp8) * config.n_head * hd * 2  # bf16, one sequence
    sizes = {m: wire_per_layer(m, cp8, k8, q8) for m in ("allgather", "ring", "ulysses")}
    ratio = sizes["ulysses"] / sizes["allgather"]
    assert abs(ratio - (config.n_head + config.n_kv_head) / (cp8 * config.n_kv_head)) < 1e-12  # a few float roundings
    print(f"{name:<34}" + "   ".join(f"{m} {fmt_bytes(b)}" for m, b in sizes.items())
          + f"   Ulysses / all-gather = {ratio:.3f}")

# %% [markdown]
# Without GQA Ulysses sends a quarter of the all-gather's bytes here; with it, the gap
# narrows, and since Ulysses cannot go past $cp = H_{kv} = 8$ while the all-gather can, at
# $cp = 16$ only the ring and the all-gather remain (Llama 3's choice, section 9).
#
# * **NVLink against InfiniBand.** The all-gather and Ulysses' all-to-alls are exposed: the
#   attention waits for them. The ring's sends overlap the compute of the block in hand (section
#   5), so on a slow link it can hide what the others cannot, as long as one block's attention
#   outlasts one hop; an all-to-all across nodes is the hardest pattern for a network (every
#   rank talks to every other), which is why Ulysses is usually kept inside a node.
#   Megatron-Core combines them (its `cp_comm_type="a2a+p2p"`): all-to-all inside a node, a ring
#   across nodes, which also takes cp past the number of K/V heads.
#
# ## 7. Memory per rank against the sequence length
#
# The same runs kept, on each rank, what autograd saves for backward during the forward
# (`SavedActivations`, notebook 01), beside the single process with the naive and with the
# fused attention.
#
# **Predict.** Per rank, how do the ring's bytes compare with the single process's fused
# attention, and what does the all-gather keep that the ring does not?
#
# <details><summary>Answer</summary>
#
# About a quarter: every per-token tensor holds $T/4$ tokens, and the ring keeps, like a fused
# kernel, only Q, K, V, the output and the log-sum-exp of its own tokens. The all-gather also
# keeps the gathered K and V of the whole sequence for backward, and (in the course's plain
# implementation, which materialises the scores) the $T/cp \times T$ scores of its queries;
# Ulysses keeps the $T \times T$ scores of its $H/cp$ heads, as many. A fused kernel inside
# either would remove the quadratic terms; the ring never has them.
# </details>

# %%
single = {}
for impl in ("naive", "fused"):
    config = GPTConfig.tiny(V, block_size=256, attn_impl=impl)
    single[impl] = []
    for T in MEM_SEQS:
        x, y = get_batch(CharDataset("train", block_size=T), MEM_BATCH, torch.Generator().manual_seed(0))
        model = GPT(config, seed=0)
        with SavedActivations(model) as saved:
            model(x, y)
        single[impl].append(saved.bytes)
measured_cp = {m: [per_rank[0][m, T][0] for T in MEM_SEQS] for m in ("ring", "allgather", "ulysses")}
for m in measured_cp:
    assert all(r[m, T][0] == per_rank[0][m, T][0] for r in per_rank for T in MEM_SEQS)  # every rank the same
print(f"{'T':>5}" + "".join(f"{name:>16}" for name in ("1 rank naive", "1 rank fused", "ring", "all-gather", "Ulysses")))
for i, T in enumerate(MEM_SEQS):
    print(f"{T:>5}" + "".join(f"{fmt_bytes(v[i]):>16}" for v in (single["naive"], single["fused"], *measured_cp.values())))
fig, ax = plt.subplots(figsize=(6, 3.4))
figures.plot_attention_memory(ax, MEM_SEQS, {"1 rank, naive": single["naive"], "1 rank, fused": single["fused"],
                                             **{f"cp={CP}, {m}": v for m, v in measured_cp.items()}})
ax.set_ylabel("MiB saved per rank")
ax.set_title(f"course GPT (2 layers), batch {MEM_BATCH}, fp32: activations per rank", fontsize=9)
plt.show()
share = [r / f for r, f in zip(measured_cp["ring"], single["fused"])]
print("ring per rank / one process, fused: " + ", ".join(f"{x:.2f}" for x in share))
assert all(1 / CP < x < 1.5 / CP for x in share)  # T/cp tokens of every tensor, plus the ring's own output

# %% [markdown]
# ## 8. It trains exactly like one process
#
# `apply_context_parallel(model, group, method, load_balance)` swaps every block's attention
# for the context-parallel one and records the layout; each rank then runs the usual step on
# its shard of every sequence (its tokens, targets and positions). The loss on a rank is the
# mean over its $B \cdot T/cp$ tokens; the shards are equal, so the mean over the ranks is the
# single-process loss, and since every rank holds the whole weights the gradients are averaged
# over the cp ranks exactly as data parallelism averages them. `train_context_parallel` runs
# that loop on the ranks; the reference trains the same GPT on one process.
#
# **Predict.** A sequence of 72 tokens (not a power of two) on 4 ranks, zig-zag and
# contiguous: should the losses match the single process exactly, to rounding, or only
# roughly?
#
# <details><summary>Answer</summary>
#
# To rounding (about $10^{-7}$ here): every method computes exactly the single-process
# attention rows, only with the sums taken in another order (blocks merged by log-sum-exp,
# gradients summed over ranks).
# </details>

# %%
TRAIN_CONFIG = GPTConfig.tiny(V, block_size=72)  # 72 tokens: 8 chunks of 9 for the zig-zag over 4 ranks
TRAIN = TrainConfig(steps=6, batch_size=4, eval_every=10**9, eval_batches=1, progress=False)
reference = train_reference(TRAIN_CONFIG, TRAIN)
reference.final_params, reference.final_grads = flat_params(reference.model), flat_grads(reference.model)
RUNS = (("ring", True), ("ring", False), ("allgather", True), ("ulysses", True))
cp_runs = {(m, lb): run_context_parallel(ParallelDims(cp=CP, cp_method=m, cp_load_balance=lb), TRAIN_CONFIG, TRAIN,
                                         **RANKS)[0]
           for m, lb in RUNS}


def same_training(run, ref):
    """Losses to 1e-5 (fp32 sums in another order, ~1e-7 apart here); the last step's gradients
    in norm to 1e-4 of their size; parameters in RMS against a hundredth of one AdamW step (lr):
    AdamW magnifies the rounding of gradients near zero (notebook 04)."""
    losses = max(abs(a - b) for a, b in zip(run.train_losses, ref.train_losses)) < 1e-5
    grads = (run.final_grads - ref.final_grads).norm() < 1e-4 * ref.final_grads.norm()
    params = (run.final_params - ref.final_params).pow(2).mean().sqrt() < TRAIN.lr / 100
    return losses and grads and params


for (m, lb), run in cp_runs.items():
    assert same_training(run, reference)
    print(f"{m:>9}, {'zig-zag   ' if lb else 'contiguous'}: {TRAIN.steps} steps, losses, gradients and parameters "
          f"equal the single process's")

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(range(1, TRAIN.steps + 1), reference.train_losses, "k-", linewidth=4, alpha=0.3, label="single process")
for (m, lb), run in cp_runs.items():
    ax.plot(range(1, TRAIN.steps + 1), run.train_losses, "o--", markersize=3, label=f"cp={CP}, {m}"
            + ("" if lb else ", contiguous"))
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.legend(fontsize=8)
plt.show()
for (m, lb), run in cp_runs.items():
    diff = max(abs(a - b) for a, b in zip(run.train_losses, reference.train_losses))
    print(f"{m:>9} {'zig-zag' if lb else 'contiguous':>10}: largest loss difference {diff:.1e}")

# %% [markdown]
# PyTorch has its own version, `torch.distributed.tensor.experimental.context_parallel`, which
# swaps `F.scaled_dot_product_attention` for ring attention built on the GPU attention kernels.
# In torch 2.13 it does not run on the CPU (the CPU attention kernel has no sharding rule), so
# the comparison here is with one process. The course's demo runs the same code under
# `torchrun` (`python -m course_lib.demos.context_parallel`, NCCL when each process has a GPU).
#
# ## 9. Llama 3 405B at 128K tokens
#
# Meta's longest pre-training stage used sequences of 131,072 tokens on 16,384 H100s with
# $tp = 8$, $cp = 16$, $pp = 16$ and $dp = 8$, at 380 TFLOP/s per GPU (Dubey et al. 2024,
# Table 4). The estimator of notebooks 01 and 11, which now knows `cp`, holds that run as
# `LONG_CONTEXT`: the paper's degrees and its context parallelism, which all-gathers K and V
# over zig-zag chunks (§3.3.2; below); the course's simpler neighbour of the rest, as in
# notebook 10 (section 7): ZeRO-1 where the paper ran FSDP without resharding after forward,
# plain 1F1B where it ran an interleaved schedule; and, where the paper does not say, the
# course's choices: full activation recomputation and one sequence per micro-batch. Its memory
# per GPU, as published and changed one knob at a time:
#
# **Predict.** Without context parallelism (the same tp, pp and dp on 1,024 GPUs), would full
# recomputation alone fit a 128K sequence into an 80 GB H100?

# %%
RUN = "Llama 3 405B 128K on 16k H100"
print(LONG_CONTEXT[RUN]["reported"])
print(f"{'':<38}{'GPUs':>7}{'weights+grads+optimizer':>25}{'activations':>13}{'total':>11}")
memory = {}
for changes in ({}, dict(recompute="none"), dict(cp=1), dict(cp=1, recompute="none")):
    est = published_estimate(RUN, **changes)
    m, dims = est["memory"], est["dims"]
    memory[dims.cp, dims.recompute] = est
    state = m["params"] + m["grads"] + m["optimizer"]
    label = f"cp = {dims.cp:>2}, recompute {dims.recompute}" + (" (published)" if not changes else "")
    print(f"{label:<38}{dims.world_size:>7,}{fmt_bytes(state):>25}{fmt_bytes(m['activations']):>13}"
          f"{fmt_bytes(m['total']):>11}   {'fits' if est['fits'] else 'does not fit'}")
act = {cp: memory[cp, "none"]["memory"]["activations"] for cp in (1, 16)}
print(f"activations without recomputation: cp = 16 keeps 1/{act[1] / act[16]:.1f} of cp = 1's "
      f"(T/16 tokens of every tensor, plus the gathered K and V each layer keeps)")
assert 10 < act[1] / act[16] < 16  # 1/cp of everything, plus the all-gather's whole-sequence K and V
assert memory[16, "full"]["fits"] and not memory[1, "full"]["fits"]

# %% [markdown]
# <details><summary>Answer</summary>
#
# No: even keeping only each layer's input, a whole sequence of 131,072 tokens through all the
# layers (what 1F1B keeps in flight on the first pipeline stage: 16 micro-batches of its
# sixteenth of the layers) exceeds the GPU (the table above). Context parallelism divides
# every activation term by 16; with recomputation on top it leaves plenty of room (in this
# estimate cp = 16 alone, keeping every activation, is still above 80 GB).
# The estimator's sharding of the optimizer state over $dp \times cp = 128$ replicas also
# shows: cp ranks hold whole weights, so ZeRO shards their state together with dp's.
# </details>
#
# Llama 3 used the all-gather (§3.3.2): with GQA its 128 query heads share 8 K/V heads, so the
# gathered K and V are small, and although the all-gather is exposed, the $O(T^2)$ attention it
# feeds dwarfs its $O(T)$ bytes. With $tp = 8$ each tensor-parallel rank holds one K/V head;
# its cp group of 16 spans 16 nodes (tp fills a node), so the gather crosses the network: for
# the 405B, RDMA over Converged Ethernet (RoCE) at 400 Gb/s per GPU (§3.3.1; the smaller Llama 3
# models trained on InfiniBand of the same rate, and the course prices both alike). Per layer
# and rank, forward, with the α-β model (notebook 02) and 75 % of an H100's bf16 peak:

# %%
link_net, link_nv = LONG_CONTEXT[RUN]["cluster"].inter, LONG_CONTEXT[RUN]["cluster"].intra  # RoCE, NVLink 4
flops = 0.75 * 989e12
base, cp_l, tp_l, T_LLAMA = LONG_CONTEXT[RUN]["config"], 16, 8, LONG_CONTEXT[RUN]["seq"]
kv_rank = 2 * (T_LLAMA // cp_l) * (base.n_kv_head // tp_l) * (base.d_model // base.n_head) * 2  # K and V, bf16
attention = 4 * (T_LLAMA // cp_l) * T_LLAMA * (base.d_model // tp_l) / 2 / flops  # QK^T and PV, half visible
for name, link in (("RoCE", link_net), ("NVLink", link_nv)):
    gather = collective_time(link, "all_gather", cp_l * kv_rank, cp_l)
    dims = ParallelDims(dp=8, tp=tp_l, pp=16, cp=cp_l, cp_method="ring")
    exposed = ring_exposed(base, dims, 1, T_LLAMA, link, flops, act_bytes=2, causal=True)["forward"]
    print(f"{name:>10}: all-gather of K, V ({fmt_bytes(cp_l * kv_rank)} gathered) {gather * 1e3:5.2f} ms, exposed, "
          f"= {gather / attention:.0%} of the attention compute ({attention * 1e3:.2f} ms); ring: "
          f"{exposed * 1e3:.2f} ms exposed")
    assert gather < attention and exposed == 0.0  # the gather is smaller than the work; the ring hides every hop

# %% [markdown]
# The ring would hide its forward sends entirely: one block's attention (a chunk of 8,192
# queries against 8,192 keys) takes far longer than sending 4 MiB. The all-gather is exposed
# but costs a fraction of the attention it feeds, and it keeps the code simple for Llama 3's
# document masks. On NVLink both would be nearly free; the ring's overlap matters most when
# the cp group crosses the slower network, and when the chunks are short (small $T/cp$: the
# compute per block falls like $(T/cp)^2$, the bytes only like $T/cp$).
#
# ## 10. Explore: sequence length, cp and method
#
# For Llama 3 8B (32 query heads, 8 K/V heads), one sequence, bf16: the activations per rank
# (left, against the sequence length, with cp = 1 dashed) and the bytes each rank sends per
# layer for the three methods (right) at the chosen length and cp, from `cp_costs` in
# `course_lib.estimate.context` (the formulas of section 6 and `activation_bytes`). Find the
# smallest cp at which the activations of a 128K-token sequence fit an 80 GB H100, the cp at
# which Ulysses stops being possible, and how the three methods' bytes change as cp grows.

# %% tags=["nbval-ignore-output"]
show_interactive(lambda: figures.cp_view(131072, 8, "ring"), lambda: figures.cp_widget(131072, 8, "ring"))

# %% [markdown]
# ## What to remember
#
# * Attention is the only op of a transformer that mixes positions. Its scores are $s^2$ per
#   head; a fused kernel keeps only the output and one log-sum-exp per query, so memory becomes
#   linear, but the FLOPs stay quadratic.
# * Context parallelism splits every sequence over $cp$ ranks; everything but attention runs
#   unchanged on $T/cp$ tokens, the weights are whole on every rank, and the gradients are
#   averaged over cp as over dp. Activations per rank fall by $cp$.
# * Partial attention results merge exactly by their log-sum-exp:
#   $\ell = \log(e^{\ell_a} + e^{\ell_b})$, $o = e^{\ell_a - \ell} o_a + e^{\ell_b - \ell} o_b$.
# * Under a causal mask contiguous chunks give the last rank about $2cp - 1$ times the first
#   rank's work; $2cp$ chunks dealt from both ends (zig-zag) make it equal.
# * Ring: K/V round the ring, overlapping compute, two blocks in memory. All-gather: one
#   exposed collective, cheap under GQA, the whole K/V held. Ulysses: two all-to-alls each way,
#   bytes falling like $1/cp$, but $cp \le$ heads.
#
# ## Self-check
#
# 1. A fused attention kernel stores no $s \times s$ matrix. Why is context parallelism still
#    needed at 128K tokens?
# 2. Two key blocks give $(o_a, \ell_a) = (2, \ln 2)$ and $(o_b, \ell_b) = (8, \ln 6)$. What
#    are the merged output and log-sum-exp?
# 3. With $cp = 8$ contiguous chunks of a long sequence, about how many times rank 0's
#    attention work does rank 7 do? Which chunks does rank 2 hold under zig-zag?
# 4. Llama 3 70B has 64 query heads and 8 K/V heads. Which methods allow $cp = 16$, and which
#    sends the fewest bytes per layer?
# 5. Why does the ring's backward send more bytes than its forward?
# 6. Context-parallel ranks hold the whole weights. Over which ranks must their gradients be
#    averaged, and over which may ZeRO shard the optimizer state?
#
# <details><summary>Answers</summary>
#
# 1. The activations that remain are linear in $s$, but at 128K tokens the layer inputs, Q, K,
#    V and the MLP's hidden states of one sequence over all layers are hundreds of gigabytes
#    (section 9); and the quadratic FLOPs of one sequence are too slow for one GPU.
# 2. $\ell = \ln(2 + 6) = \ln 8$, $o = \frac{2}{8} \cdot 2 + \frac{6}{8} \cdot 8 = 6.5$.
# 3. $W_7/W_0 = 1 + 14c/(c + 1) \approx 15 = 2cp - 1$. Rank 2 holds chunks 2 and 13 of 16.
# 4. Ring and all-gather ($cp \mid T$ only); Ulysses needs $cp \mid 8$ K/V heads (without
#    replicating them), so not 16. All-gather sends $4(cp-1)k$ against the ring's $(6cp - 4)k$.
# 5. K and V go round again (they were not kept), and their gradients travel with them, one
#    hop more to reach the rank that owns them.
# 6. Averaged over every rank that holds a copy: dp × cp (the cp ranks saw different tokens of
#    the same sequences); ZeRO may shard the state over the same dp × cp ranks.
# </details>
#
# ## References
#
# * Liu, H., Zaharia, M., Abbeel, P. (2023). *Ring Attention with Blockwise Transformers for
#   Near-Infinite Context.* arXiv:2310.01889. K/V blocks passed round a ring of devices,
#   overlapped with blockwise attention (section 5).
# * Jacobs, S. A., Tanaka, M., Zhang, C., Zhang, M., Song, S. L., Rajbhandari, S., He, Y.
#   (2023). *DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
#   Sequence Transformer Models.* arXiv:2309.14509. All-to-all from sequence to head shards
#   (section 6).
# * Milakov, M., Gimelshein, N. (2018). *Online normalizer calculation for softmax.*
#   arXiv:1805.02867. The running maximum and sum that make softmax mergeable (section 3).
# * Dao, T., Fu, D. Y., Ermon, S., Rudra, A., Ré, C. (2022). *FlashAttention: Fast and
#   Memory-Efficient Exact Attention with IO-Awareness.* NeurIPS 2022, arXiv:2205.14135. The
#   fused kernel of section 1 and its log-sum-exp rescaling.
# * Llama Team, AI @ Meta (Dubey, A., et al.) (2024). *The Llama 3 Herd of Models.*
#   arXiv:2407.21783. Table 4 (the 128K layout), §3.3.2 (all-gather context parallelism,
#   2cp-chunk load balancing).
# * Korthikanti, V., Casper, J., Lym, S., McAfee, L., Andersch, M., Shoeybi, M., Catanzaro, B.
#   (2022). *Reducing Activation Recomputation in Large Transformer Models.* arXiv:2205.05198.
#   The activation formulas the estimator divides by cp.
# * Brandon, W., Nrusimha, A., Qian, K., Ankner, Z., Jin, T., Song, Z., Ragan-Kelley, J. (2023).
#   *Striped Attention: Faster Ring Attention for Causal Transformers.* arXiv:2311.09431. The
#   causal imbalance of contiguous ring attention and a striped fix (section 4).
#
# Further reading:
#
# * N. Tazi et al. (2025), *The Ultra-Scale Playbook: Training LLMs on GPU Clusters*, Hugging
#   Face (huggingface.co/spaces/nanotron/ultrascale-playbook): context parallelism and ring
#   attention among the other axes, with measurements.
# * NVIDIA Megatron-Core, *context parallel* developer guide (docs.nvidia.com/megatron-core):
#   ring attention with load balancing in a production framework.
#
# Next: write the merge of two partial attention results and the zig-zag chunk assignment
# yourself in `exercises/ex09_context_parallel.ipynb`, checked on real ranks against the
# single-process attention. Once its checks pass, its last cell points to the library's own
# version to compare with. Then notebook `10_3d_parallelism` puts cp on the mesh with the
# other four axes.
