# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/05_tensor_parallel.ipynb)

# %% [markdown]
# # 05 · Tensor parallelism (Megatron) and sequence parallelism
#
# Data parallelism (notebook 03) copies the whole model onto every rank. When one layer's
# weights, gradients, optimizer state and activations no longer fit on one GPU, or a step
# takes too long even at batch size 1 per GPU, we must split **inside** the layers:
# **tensor parallelism** (TP) gives each of `tp` ranks a slice of every weight matrix, and the
# ranks exchange activations in the middle of each layer (Shoeybi et al. 2019, "Megatron-LM").
# **Sequence parallelism** (SP) then splits the rest of the layer, the LayerNorms and dropouts,
# along the sequence (Korthikanti et al. 2022).
#
# By the end of this notebook you can:
#
# 1. say what each rank computes when a weight is split by columns or by rows, and when the
#    partial results must be summed;
# 2. explain Megatron's two operators `f` and `g`, and why a transformer MLP needs exactly one
#    all-reduce in forward and one in backward;
# 3. split attention by heads, including the fused QKV weight, and split the vocabulary of
#    the embedding and of the loss without ever gathering the logits;
# 4. show that a tensor-parallel GPT trains exactly like the single-process one, and count
#    its collectives against the formulas;
# 5. measure what sequence parallelism saves, and why TP stays inside one node;
# 6. explain how asynchronous TP hides each all-gather and reduce-scatter behind chunks of the
#    matmul that needs it, check that it computes the same model with the same bytes, and read
#    from a per-rank timeline how much communication is still exposed, and why on CPU ranks;
# 7. split attention over more ranks than it has key/value heads (grouped-query attention), and
#    say what must divide what;
# 8. run the same model through PyTorch's DTensor `parallelize_module` and compare.

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
import contextlib
from unittest import mock

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import CommTracer, plot_gantt, run_on_ranks
from course_lib.dims import ParallelDims
from course_lib.comm.costmodel import CLUSTERS
from course_lib.data import CharDataset, get_batch
from course_lib.estimate import GPT3_175B, LLAMA3_405B, LLAMA3_70B, activation_bytes, per_gpu_memory
from course_lib.model import GPT, GPTConfig
from course_lib.observe.memory import SavedActivations, measured_state_bytes
from course_lib.parallel.tp import (ColumnParallelLinear, RowParallelLinear, apply_tensor_parallel,
                                    check_tensor_parallel, full_logits, qkv_rows)
from course_lib.parallel.tp.costs import layer_communication, step_communication
from course_lib.parallel.tp.dtensor import apply_dtensor_tensor_parallel
from course_lib.parallel.tp.figures import compute_vs_comm, layer_view, layer_widget, plot_split_matmul
from course_lib.parallel.tp.overlap import mlp_on_rank, plot_lanes, plot_ring_steps
from course_lib.parallel.tp.training import run_tensor_parallel
from course_lib.train import TrainConfig, flat_params, train_reference
from course_lib.units import fmt_bytes
from course_lib.widgets import show_interactive

torch.manual_seed(0)
DATA = CharDataset("train")
CONFIG = GPTConfig.tiny(DATA.vocab_size)  # 2 layers, 4 heads, d_model 64, d_ff 256
TRAIN = TrainConfig(steps=5, batch_size=8, eval_every=10**9, eval_batches=1, progress=False)
RANKS = dict(backend="gloo", timeout_s=120)  # CPU ranks, even on a GPU machine
print(f"course GPT: {GPT(CONFIG).num_params():,} parameters, vocabulary of {CONFIG.vocab_size} symbols")

# %% [markdown]
# ## 1. The matrix picture: split by columns, split by rows
#
# A linear layer computes $Y = XA$ ($X$: tokens x inputs, $A$: inputs x outputs; `nn.Linear`
# stores $W = A^\top$). There are two ways to cut $A$ between ranks:
#
# * **by columns**, $A = [A_0 \mid A_1]$: rank $r$ computes $Y_r = X A_r$, a slice of the
#   output's columns. Every rank needs all of $X$, and nothing has to be summed: the output
#   simply stays split.
# * **by rows**, $A = \begin{bmatrix}A_0\\A_1\end{bmatrix}$: rank $r$ holds only the matching
#   columns $X_r$ of the input and computes $X_r A_r$, a full-size **partial sum**; the output
#   is $Y = X_0A_0 + X_1A_1$, so the ranks must add their results (an all-reduce).

# %%
fig = plt.figure(figsize=(10, 3.4))
plot_split_matmul(fig, tp=2)
plt.show()

# %%
X, A = torch.randn(4, 6), torch.randn(6, 8)
Y = X @ A
by_columns = torch.cat([X @ A[:, :4], X @ A[:, 4:]], dim=1)  # rank 0 | rank 1, side by side
by_rows = X[:, :3] @ A[:3] + X[:, 3:] @ A[3:]                 # rank 0 + rank 1, summed
# Each entry is a sum of 6 products, here added in another order: each order is within 6ε·Σ|x·a| of
# the exact value (fp32 ε = 1.2e-7; notebook 02's bound), so the two within twice that
tol = 2 * 6 * torch.finfo(torch.float32).eps * (X.abs() @ A.abs())
assert ((by_columns - Y).abs() <= tol).all() and ((by_rows - Y).abs() <= tol).all()
print("column split: concatenate the slices;  row split: add the partial sums;  both give X @ A")

# %% [markdown]
# ## 2. f and g, and why the MLP needs one all-reduce, not two
#
# The MLP is $Z = \mathrm{GELU}(XA)\,B$. Split $A$ by **columns**: each rank computes
# $\mathrm{GELU}(XA_r)$ on its own, because GELU acts on each element and rank $r$ holds whole
# columns. That output is split by columns, exactly the way a **row**-split $B$ wants its input.
# So rank $r$ computes $\mathrm{GELU}(XA_r)B_r$ and the only communication is the sum at the end.
# Splitting $A$ by rows instead would leave partial sums *before* the GELU, and
# $\mathrm{GELU}(a) + \mathrm{GELU}(b) \neq \mathrm{GELU}(a + b)$: a second all-reduce would be
# needed in the middle.

# %%
a, b = torch.tensor(1.0), torch.tensor(-2.0)
print(f"GELU(a) + GELU(b) = {(F.gelu(a) + F.gelu(b)).item():.4f}   GELU(a + b) = {F.gelu(a + b).item():.4f}")

# %% [markdown]
# Megatron writes the communication as two conjugate operators around each such region:
#
# | operator | forward | backward | where |
# |---|---|---|---|
# | **f** | identity: every rank already holds $X$ | all-reduce of $\partial L/\partial X$ | entering the region (before the column-split layer) |
# | **g** | all-reduce of the partial sums | identity | leaving it (after the row-split layer) |
#
# Why f's backward sums: $X$ fed every rank's columns, so its gradient is the sum of every
# rank's contribution, $\partial L/\partial X = \sum_r \partial L/\partial Y_r \, A_r^\top$. Why g's
# backward is the identity: $Z = \sum_r Z_r$, so $\partial L/\partial Z_r = \partial L/\partial Z$,
# which every rank already holds. Each is the other's transpose.
#
# **Predict.** A column-split `fc` followed by a row-split `proj` on 2 ranks: how many
# all-reduces in forward, how many in backward, and how big is each?
#
# <details><summary>Answer</summary>
#
# One each: g after `proj` in forward, f before `fc` in backward, each of the whole
# activation $X$ (here 2 x 4 tokens x 8 features = 64 floats = 256 bytes). The GELU in between costs nothing.
# </details>

# %%
def mlp_on_ranks():
    torch.manual_seed(0)  # the same full layers and input on every rank
    fc, proj = nn.Linear(8, 32), nn.Linear(32, 8)
    x = torch.randn(2, 4, 8, requires_grad=True)
    reference = proj(F.gelu(fc(x)))
    reference.sum().backward()
    col, row = ColumnParallelLinear.from_linear(fc), RowParallelLinear.from_linear(proj)
    xr = x.detach().requires_grad_(True)
    with CommTracer() as forward:
        out = row(F.gelu(col(xr)))
    with CommTracer() as backward:
        out.sum().backward()
    # fp32 sums of up to 32 products, split in two partial sums plus the all-reduce: another order of the
    # same additions (~1e-7 apart here; the worst case 32ε·Σ|h·w| is a few 1e-6)
    assert torch.allclose(out, reference, rtol=1e-5, atol=1e-5) and torch.allclose(xr.grad, x.grad, rtol=1e-5, atol=1e-5)
    return (tuple(col.weight.shape), tuple(row.weight.shape), forward.summary(), backward.summary())

for rank, (cw, rw, fwd, bwd) in enumerate(run_on_ranks(mlp_on_ranks, world_size=2, **RANKS)):
    print(f"rank {rank}: fc weight {cw}, proj weight {rw}; forward {fwd}; backward {bwd}")
    assert fwd["all_reduce"]["calls"] == bwd["all_reduce"]["calls"] == 1

# %% [markdown]
# Each rank holds half of `fc`'s output rows (16 of 32) and half of `proj`'s input columns; the
# output and the input gradient equal the single-process ones.
#
# ## 3. Attention, split by heads
#
# Attention is the same pattern: heads are independent, so rank $r$ takes $a/tp$ whole heads.
# `qkv` is column-split (rank $r$ computes Q, K and V of its heads), attention runs per head
# with no communication, and `proj` is row-split (its input columns are the heads' outputs),
# followed by g. One all-reduce forward, one backward, for the whole attention block.
#
# The course GPT computes Q, K and V with **one fused** `qkv` weight whose rows are
# `[Q (d rows) | K (d rows) | V (d rows)]`. A contiguous third of those rows would give rank 0
# all of Q and part of K: wrong. Each rank must take the rows of its heads from each of the
# three parts (`qkv_rows`). With d = 8, 2 heads of 4 features, 2 ranks:

# %%
for rank, rows in enumerate(qkv_rows(8, 2).tolist()):
    print(f"rank {rank}: Q rows {rows[0:4]}  K rows {rows[4:8]}  V rows {rows[8:12]}")

# %% [markdown]
# **Predict.** If we split the fused `qkv` rows into contiguous halves instead, would the
# loss of the tensor-parallel model still match the single-process one?
#
# <details><summary>Answer</summary>
#
# No. Rank 0 would compute "queries" from Q rows and "keys" from other Q rows, and the shapes
# still fit, so nothing crashes: only the numbers are wrong. The comparison below catches it.
# </details>

# %%
def loss_vs_single_process(contiguous_qkv=False):
    x, y = get_batch(DATA, 4, torch.Generator().manual_seed(0))
    single = GPT(CONFIG, seed=0)(x, y)[1].item()
    wrong = contextlib.nullcontext()
    if contiguous_qkv:
        from course_lib.parallel.tp import apply as tp_apply
        wrong = mock.patch.object(tp_apply, "qkv_rows", lambda d, tp: torch.arange(3 * d).view(tp, -1))
    with wrong:
        model = apply_tensor_parallel(GPT(CONFIG, seed=0), None)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith(("blocks.0.", "tok_emb", "head"))}
    return single, model(x, y)[1].item(), shapes

res = run_on_ranks(loss_vs_single_process, world_size=2, **RANKS)
for name, shape in res[0][2].items():
    print(f"{name:<24} rank 0 holds {shape}")
single, tp_loss, _ = res[0]
bad = run_on_ranks(loss_vs_single_process, True, world_size=2, **RANKS)[0][1]
print(f"loss: single process {single:.4f}, heads split {tp_loss:.4f}, contiguous qkv split {bad:.4f}")
# the right split: the same loss up to fp32 summation order (~1e-7 here); the wrong one mixes heads (~6e-3 off)
assert abs(tp_loss - single) < 1e-5 and abs(bad - single) > 1e-3

# %% [markdown]
# Per rank: `qkv` 96 = 3 x 64 / 2 rows, `attn.proj` 32 input columns, `fc` 128 of 256 rows,
# `mlp.proj` 128 input columns; LayerNorms and the row-parallel biases stay whole (a bias is
# added once, after the sum). The embedding has 49 rows per rank: the next section explains why.
#
# ## 4. The vocabulary: a parallel embedding and a loss that never gathers the logits
#
# The embedding table ($V \times d$) and the output head ($d \times V$, here the same tied matrix)
# are split by **vocabulary rows**: rank $r$ holds tokens $[rV'/tp, (r+1)V'/tp)$. The course's
# 97-symbol vocabulary is not divisible by 2 or 4, so it is **padded** with rows of zeros to
# $V' = 98$ (or 100), the smallest multiple of `tp`. Megatron-LM pads further by default: to a
# multiple of $128 \cdot tp$ (its `--make-vocab-size-divisible-by`, default 128, times the
# tensor-parallel size), so that every rank's slice is a multiple of 128 rows, a shape GPU matmul
# kernels handle well. What that costs, in padded rows:

# %%
def padded(vocab, multiple):
    return -(-vocab // multiple) * multiple  # the smallest multiple of `multiple` that is >= vocab

assert padded(CONFIG.vocab_size, 2) == 2 * res[0][2]["tok_emb.weight"][0]  # the 49 rows per rank measured above

print(f"{'vocabulary':<22}{'tp':>4}{'course: multiple of tp':>26}{'Megatron: multiple of 128·tp':>32}")
for name, vocab in (("course, 97 symbols", CONFIG.vocab_size), ("GPT-2, 50,257", 50257), ("Llama 3, 128,256", 128256)):
    for tp in (2, 8):
        ours, megatron = padded(vocab, tp), padded(vocab, 128 * tp)
        print(f"{name:<22}{tp:>4}{f'{ours:,} (+{ours - vocab:,})':>26}{f'{megatron:,} (+{megatron - vocab:,})':>32}")

# %% [markdown]
# * **Embedding:** a rank looks up the tokens it owns and writes zeros for the others; g sums
#   the ranks' outputs, and exactly one rank contributed each token's row.
# * **Head:** column-parallel (f first); rank $r$ gets the logits of its vocabulary slice, $z_{i,V_r}$.
# * **Loss:** $\ell_i = \log\sum_j e^{z_{ij}} - z_{i,y_i}$ needs every column, but only three numbers
#   per token from each rank: its maximum $m_i$ (all-reduce MAX, for stability), its
#   $\sum_{j\in V_r} e^{z_{ij}-m_i}$ (all-reduce SUM) and the target logit if it owns $y_i$
#   (all-reduce SUM). Padded columns are set to $-\infty$, so $e^{-\infty} = 0$ changes nothing.
#   Sums go through g, so autograd hands each rank the gradient of its own slice,
#   $(\mathrm{softmax}_{ij} - [j = y_i])/N$ for $N$ tokens.
#
# ### The loss, worked by hand on 2 ranks
#
# Two tokens, a vocabulary of 6: rank 0 holds the logits of ids 0-2, rank 1 those of ids 3-5.
# Token 0's target is id 3 (on rank 1), token 1's is id 1 (on rank 0). Follow one column of
# the table at a time: each rank computes its local numbers from its three logits alone, and
# each "all-reduce" line is what every rank holds after the collective.
#
# **Predict.** Token 0's largest logit, 3.0, lives on rank 0, but its target lives on rank 1.
# Which rank ends up knowing token 0's loss?
#
# <details><summary>Answer</summary>
#
# Both. After the three all-reduces every rank holds the same $m$, $S$ and $t$ for every token,
# so every rank computes the same loss (and the gradient of its own slice of the logits).
# </details>

# %%
z = torch.tensor([[1.0, 3.0, 0.5, 2.0, -1.0, 0.0],    # token 0
                  [0.0, 1.5, 1.0, 2.5, 4.0, -0.5]],   # token 1
                 dtype=torch.float64)
y = torch.tensor([3, 1])
shards = {0: (0, z[:, :3]), 1: (3, z[:, 3:])}  # rank: (first vocabulary id it holds, its logits)

local_max = {r: zr.amax(dim=1) for r, (_, zr) in shards.items()}
m = torch.maximum(local_max[0], local_max[1])                                   # all-reduce MAX
local_sum = {r: (zr - m[:, None]).exp().sum(dim=1) for r, (_, zr) in shards.items()}
S = local_sum[0] + local_sum[1]                                                 # all-reduce SUM
local_t = {}
for r, (start, zr) in shards.items():
    mine = (y >= start) & (y < start + zr.shape[1])  # does this rank hold the target's logit?
    picked = zr.gather(1, (y - start).clamp(0, zr.shape[1] - 1)[:, None])[:, 0] - m
    local_t[r] = torch.where(mine, picked, torch.zeros_like(picked))
t = local_t[0] + local_t[1]                                                     # all-reduce SUM
loss = S.log() - t
full = F.cross_entropy(z, y, reduction="none")  # the single-process loss, from all 6 logits

W = 40  # label width
row = lambda label, v: print(f"{label:<{W}}" + "".join(f"{x:>20.4f}" for x in v.tolist()))
print(f"{'':<{W}}{'token 0 (target 3)':>20}{'token 1 (target 1)':>20}")
for r, (start, zr) in shards.items():
    print(f"{f'rank {r}: logits of ids {start}-{start + 2}':<{W}}" + "".join(f"{str(v):>20}" for v in zr.tolist()))
for r in shards:
    row(f"rank {r}: local max", local_max[r])
row("all-reduce MAX: m", m)
for r in shards:
    row(f"rank {r}: sum of exp(z - m) over its ids", local_sum[r])
row("all-reduce SUM: S", S)
for r in shards:
    row(f"rank {r}: z[target] - m if it holds it", local_t[r])
row("all-reduce SUM: t", t)
row("loss = log S - t (every rank)", loss)
row("cross-entropy of all 6 logits", full)
# float64, the same terms summed in another order: equal to ~1e-16; a wrong step is off by 1e-2 or more
assert torch.allclose(loss, full, rtol=1e-12, atol=0)
print(f"mean over the 2 tokens: {loss.mean().item():.4f} = F.cross_entropy's {full.mean().item():.4f}")

# %% [markdown]
# Subtracting the global maximum makes every exponential at most 1, so nothing overflows; a rank
# whose own maximum is smaller (rank 1 for token 0) just adds smaller terms. Three numbers per
# token leave each rank (its maximum, its sum of exponentials, its target logit or 0); its
# logits never do.
#
# **How much less it sends.** Gathering the logits instead would leave $N \cdot V$ numbers on
# every rank; the three all-reduces carry $3N$. Both are **logical sizes**: what each rank ends
# up holding (the all-gather) or hands to the collective (the all-reduces). On the wire, a ring
# all-gather puts $\frac{tp-1}{tp}$ of its output on each rank's link, an all-reduce twice
# $\frac{tp-1}{tp}$ of its payload (notebook 02), so on the wire the ratio is half the logical one:

# %%
V_LLAMA3 = 128256  # Llama 3's vocabulary (Llama Team 2024)
tp = 8
share = (tp - 1) / tp                          # cancels: the ratios hold for any tp
logical = V_LLAMA3 / 3                         # N*V numbers against 3N
wire = (share * V_LLAMA3) / (3 * 2 * share)    # a ring all-gather of N*V against 3 ring all-reduces of N
assert logical == 42752 and wire == logical / 2
print(f"Llama 3's vocabulary: the loss's all-reduces carry {logical:,.0f} times fewer numbers than an all-gather of "
      f"the logits (logical size), and put {wire:,.0f} times fewer bytes on each rank's link (ring)")

# %% [markdown]
# On 2 real ranks, the course GPT's loss, counted by the tracer (logical payload) and on the
# wire of a 2-rank ring:

# %%
def vocabulary_parallel():
    x, y = get_batch(DATA, 4, torch.Generator().manual_seed(0))
    logits_ref, loss_ref = GPT(CONFIG, seed=0)(x, y)
    model = apply_tensor_parallel(GPT(CONFIG, seed=0), None)
    local_logits, _ = model(x)
    with CommTracer() as tracer:
        loss = model.loss_fn(local_logits, y)
    gathered = full_logits(model, local_logits)  # only to compare with the single process
    return (tuple(local_logits.shape), loss.item() - loss_ref.item(),
            (gathered - logits_ref).abs().max().item(), tracer.summary()["all_reduce"])

gather_bytes = 4 * CONFIG.block_size * 98 * 4  # logical: every rank holding the (4, 64, 98) fp32 logits
n = 2  # ranks: a ring all-reduce puts 2(n-1)/n of its payload on each link, a ring all-gather (n-1)/n of its output
for rank, (shape, dloss, dlogits, ar) in enumerate(run_on_ranks(vocabulary_parallel, world_size=n, **RANKS)):
    print(f"rank {rank}: local logits {shape}; the loss: {ar['calls']} all-reduces, {ar['bytes_sent']:,} bytes "
          f"logical, {2 * (n - 1) / n * ar['bytes_sent']:,.0f} on the wire; an all-gather of the logits instead: "
          f"{gather_bytes:,} bytes logical, {(n - 1) / n * gather_bytes:,.0f} on the wire")
    # fp32: the same sums in another order (a loss of ~4.6 and logits of ~1, ~1e-7 apart here)
    assert abs(dloss) < 1e-5 and dlogits < 1e-5 and ar["calls"] == 3

# %% [markdown]
# ## 5. The whole model trains like the single process
#
# Put together, one transformer layer on one rank (`[...]` = this rank's slice):
#
# ```
#          replicated                  tensor-parallel region                    replicated
# x ── ln1 ── f ── qkv [a/tp heads] ── attention per head ── attn.proj [rows] ── g ── + x
#   ── ln2 ── f ── fc [d_ff/tp cols] ── GELU ─────────────── mlp.proj [rows] ─── g ── + ...
#
# with sequence parallelism (x holds s/tp tokens; f -> all-gather, g -> reduce-scatter):
# x_shard ── ln1 ── all-gather(seq) ── ... ── attn.proj ── reduce-scatter(seq) ── + x_shard ...
# ```
#
# `apply_tensor_parallel(model, group, sequence_parallel=False)` swaps the modules of a plain
# `GPT` in place (same weights on every rank; each keeps its shards) and returns it.
# `model(idx, targets)` still returns `(logits, loss)`: the logits are this rank's vocabulary
# slice, the loss is the single-process loss on every rank, and after `backward()` each shard's
# gradient is the matching slice of the single-process gradient. So a plain AdamW on each rank
# trains the same model; only gradient clipping needs the global norm, a sum of squares over
# every shard (`clip_grad_norm_`). `gather_full_state_dict` puts the shards back together.
#
# We train 5 steps at tp = 2, without and with sequence parallelism (section 7), and the same
# model through PyTorch's DTensor (section 13), next to the single-process run:

# %%
reference = train_reference(CONFIG, TRAIN)
runs = {"tp=2": run_tensor_parallel(ParallelDims(tp=2), CONFIG, TRAIN, **RANKS),
        "tp=2 + SP": run_tensor_parallel(ParallelDims(tp=2, sequence_parallel=True), CONFIG, TRAIN, **RANKS),
        "tp=2 DTensor": run_tensor_parallel(ParallelDims(tp=2), CONFIG, TRAIN, impl="dtensor", **RANKS)}
print(f"{'':<14}" + "".join(f"{'step ' + str(s + 1):>9}" for s in range(TRAIN.steps)))
print(f"{'1 process':<14}" + "".join(f"{v:>9.3f}" for v in reference.train_losses))
for name, per_rank in runs.items():
    print(f"{name:<14}" + "".join(f"{v:>9.3f}" for v in per_rank[0].train_losses))
    for out in per_rank:  # every rank, every step: the single-process loss, up to fp32 summation order
        assert max(abs(a - b) for a, b in zip(out.train_losses, reference.train_losses)) < 1e-5
for name in ("tp=2", "tp=2 + SP"):  # the gathered parameters after 5 AdamW steps
    diff = runs[name][0].final_params - flat_params(reference.model)
    # in RMS, against a hundredth of one AdamW step (lr): AdamW magnifies the rounding of gradients near zero,
    # which can move a single parameter by up to ~lr (notebooks 03 and 04); a wrong gradient moves most of them
    assert diff.pow(2).mean().sqrt() < TRAIN.lr / 100
print("losses equal on every rank and to the single process; gathered parameters equal up to rounding")

# %% [markdown]
# ## 6. Communication, counted
#
# Per layer and per forward pass, plain TP runs **2 all-reduces** of the whole activation,
# $b \cdot s \cdot h$ elements (g after `attn.proj` and after `mlp.proj`), and 2 more in backward
# (f before `qkv` and `fc`). Outside the layers: g after the embedding, f before the head, and
# the loss's 3 all-reduces of $b\cdot s$ numbers. With sequence parallelism each all-reduce
# becomes an all-gather (entering the region) and a reduce-scatter (leaving it).
#
# There are two ways to count a collective's bytes, and they differ:
#
# * the **logical payload**, what the tracer records: the buffer a rank hands to the
#   collective (an all-reduce's tensor $M$, an all-gather's input shard $M/tp$, a
#   reduce-scatter's full input $M$);
# * the **bytes on the wire**, what a ring algorithm actually puts on each rank's link
#   (notebook 02): $2\frac{tp-1}{tp}M$ for an all-reduce, $\frac{tp-1}{tp}M$ for an all-gather
#   (of its output $M$) or a reduce-scatter (of its input $M$).
#
# **Predict.** Replacing each all-reduce of $M$ by an all-gather plus a reduce-scatter: does the
# tracer's logical payload grow, shrink or stay? And the bytes on the wire?
#
# <details><summary>Answer</summary>
#
# The logical payload grows, from $M$ to $M/tp + M$ (at tp = 2, by half). The bytes on the wire
# stay the same: a ring all-reduce *is* a reduce-scatter followed by an all-gather (notebook 02),
# $2\frac{tp-1}{tp}M$ against $\frac{tp-1}{tp}M + \frac{tp-1}{tp}M$.
# </details>
#
# `step_communication` writes the counts down as formulas; the tracer counts what the ranks
# really called, and the wire column applies the ring's factor to each logical payload:

# %%
def traced_step(sequence_parallel):
    x, y = get_batch(DATA, 8, torch.Generator().manual_seed(0))
    model = apply_tensor_parallel(GPT(CONFIG, seed=0), None, sequence_parallel)
    with CommTracer() as forward:
        loss = model(x, y)[1]
    with CommTracer() as backward:
        loss.backward()
    return forward.summary(), backward.summary()


def ring_wire_bytes(op, logical, n):
    """Bytes a ring puts on each rank's link, from the tracer's logical payload (bytes_sent) of n ranks."""
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n * logical  # reduce-scatter + all-gather of the tensor
    if op.startswith("all_gather"):
        return (n - 1) * logical          # the logical payload is the shard: n-1 shards pass each link
    if op.startswith("reduce_scatter"):
        return (n - 1) / n * logical      # the logical payload is the full input
    raise ValueError(f"op={op!r}: no ring formula here")


B, S, L = 8, CONFIG.block_size, CONFIG.n_layer
totals = {}
for sp in (False, True):
    fwd, bwd = run_on_ranks(traced_step, sp, world_size=2, **RANKS)[0]
    want = step_communication(CONFIG, B, S, 2, sp)
    assert fwd == want["forward"] and bwd == want["backward"]
    print(f"sequence_parallel={sp}:  (rank 0: calls, logical payload, bytes on the wire of a 2-rank ring; "
          f"counts equal to the formula)")
    for phase, summary in (("forward", fwd), ("backward", bwd)):
        logical = sum(s["bytes_sent"] for s in summary.values())
        wire = sum(ring_wire_bytes(op, s["bytes_sent"], 2) for op, s in summary.items())
        totals[sp, phase] = (logical, wire)
        print(f"   {phase:<9}" + "   ".join(f"{op} {s['calls']} x, {fmt_bytes(s['bytes_sent'])}"
                                           for op, s in summary.items()))
        print(f"   {'':<9}in all {fmt_bytes(logical)} logical, {fmt_bytes(wire)} on the wire")
assert totals[True, "forward"][0] > totals[False, "forward"][0]   # logical: SP counts more ...
assert totals[True, "forward"][1] == totals[False, "forward"][1]  # ... on the wire, the same bytes
assert totals[True, "backward"][1] > totals[False, "backward"][1]  # the re-gathers of section 7

# %% [markdown]
# With 2 layers, forward: $2 \cdot 2 + 1 = 5$ all-reduces of $8 \cdot 64 \cdot 64 \cdot 4$ bytes = 128 KiB
# each, plus the loss's 3 small ones. Read the two columns apart: the logical payload of the
# forward pass grows with sequence parallelism, by the all-gathers' shards, but the bytes on the
# wire are exactly those of plain TP. The backward does send more on the wire with SP: one more
# all-gather per column-parallel layer (the re-gather of the saved sequence shard, section 7,
# which Megatron-LM launches asynchronously and overlaps with the input-gradient matmul) and one
# small all-reduce for the gradients of the LayerNorm weights and the other whole parameters,
# which each rank now applies to only its part of the sequence. One for all of them, flat, at
# the end of backward: every call costs a fixed start-up time, and there are dozens of such
# parameters.
#
# The same comparison at GPT-3's size, from the formulas, on the wire:

# %%
for tp in (2, 4, 8):
    plain, seq = (layer_communication(1, 2048, 12288, tp, sp, dtype_bytes=2) for sp in (False, True))
    assert plain["ring_bytes_forward"] == seq["ring_bytes_forward"]
    print(f"GPT-3 layer, b=1, s=2048, bf16, tp={tp}: {fmt_bytes(plain['message_bytes'])} per activation, "
          f"forward {fmt_bytes(plain['ring_bytes_forward'])} per rank on the ring, with or without SP")

# %% [markdown]
# ## 7. Sequence parallelism: what it saves
#
# Plain TP splits the attention and MLP activations by `tp` but **not** what lies between the
# regions: the LayerNorm inputs, the residual stream, dropout masks. Every rank holds all of
# them, the same on every rank. Korthikanti et al. (2022) split those along the **sequence**:
# each rank keeps $s/tp$ tokens of them. Entering a region becomes an all-gather along the
# sequence, leaving it a reduce-scatter. The column-parallel layer keeps only its sequence
# shard of the input for backward and gathers it again there, so that the gathered copy is not
# stored: that is the formula's assumption and the extra backward all-gathers counted above.
#
# **Predict.** At tp = 2 on the course GPT, which per-layer activation terms shrink with SP?
#
# <details><summary>Answer</summary>
#
# Everything that was replicated: the LayerNorm inputs and statistics, the `qkv` and `fc`
# inputs. The Q/K/V, the attention scores, the `proj` inputs and the MLP hidden were already
# split by TP. Notebook 01's `activation_bytes` has both versions; below, measured per layer
# with `SavedActivations` (2 layers minus 1 layer) at tp = 2 and 4.
# </details>

# %%
def memory_on_ranks(sequence_parallel):
    out = {}
    for n_layer in (1, 2):
        model = apply_tensor_parallel(GPT(GPTConfig.tiny(DATA.vocab_size, n_layer=n_layer), seed=0), None,
                                      sequence_parallel)
        x, y = get_batch(DATA, 8, torch.Generator().manual_seed(0))
        with SavedActivations(model) as saved:
            model(x, y)
        out[n_layer] = (saved.bytes, measured_state_bytes(model)["params"])
    return out

print(f"{'':<10}{'activations per layer (measured = formula)':>44}{'parameters per rank (= formula)':>34}")
for tp in (2, 4):
    per_layer = {}
    for sp in (False, True):
        res = run_on_ranks(memory_on_ranks, sp, world_size=tp, **RANKS)[0]
        per_layer[sp] = res[2][0] - res[1][0]
        assert per_layer[sp] == activation_bytes(CONFIG, 8, tp=tp, sequence_parallel=sp)["per_layer"]
    formula = per_gpu_memory(CONFIG, 8, recipe="fp32", tp=tp)["params"]
    assert res[2][1] == formula
    print(f"tp={tp:<6}{fmt_bytes(per_layer[False]):>22} -> {fmt_bytes(per_layer[True])} with SP"
          f"{fmt_bytes(res[2][1]):>30}")

# %% [markdown]
# The parameters per rank are notebook 01's `per_gpu_memory` to the byte, because it follows
# the split above rather than dividing every layer by `tp`: the two row-parallel biases stay
# whole on every rank (`d` numbers each, added once after the sum), and the vocabulary is
# padded with zero rows to a multiple of `tp` before its rows are split.
#
# ## 8. One TP step on a timeline
#
# A one-layer model, one training step on 2 ranks: compute spans (forward, backward, optimizer)
# with every collective drawn on top of them. The all-reduces sit **inside** the forward and
# backward: each layer waits for its sum before it can go on. Unlike DDP's gradient buckets
# (notebook 03), no independent work is queued behind them: the next matmul needs the result.
# That does not leave nothing to overlap: under sequence parallelism, section 9 splits each
# all-gather or reduce-scatter and the matmul that depends on it into pieces, so that each piece
# of communication travels while a piece of the matmul that does not need it runs.

# %% tags=["nbval-ignore-output"]
one_layer = GPTConfig.tiny(DATA.vocab_size, n_layer=1)
steps = run_tensor_parallel(ParallelDims(tp=2), one_layer, TrainConfig(steps=2, batch_size=8, progress=False),
                            record_timeline=True, **RANKS)
last_step = []
for out in steps:  # keep the second step (the first one warms up): what starts after step 1's optimizer
    first_step_end = min(e[2] for e in out.timeline_events if e[0] == "optimizer")
    last_step.append([e for e in out.timeline_events if e[1] >= first_step_end])
comm = sum(e[2] - e[1] for e in last_step[0] if e[3] == "comm")
total = max(e[2] for e in last_step[0]) - min(e[1] for e in last_step[0])
assert any(e[3] == "comm" for e in last_step[0]) and 0 < comm < total
plot_gantt(last_step,
           title=f"one TP step, 1 layer, 2 CPU ranks over gloo: collectives {comm / total:.0%} of rank 0's step")
plt.show()
print(f"rank 0's step: {total * 1e3:.1f} ms, {comm * 1e3:.1f} ms of it inside all-reduces ({comm / total:.0%}), "
      f"measured here: gloo between CPU processes")

# %% [markdown]
# The share in the title is this machine's, not a GPU's: each all-reduce here is a message
# between two CPU processes through gloo, and a rank inside one also waits for the other rank
# to arrive, however long the operating system kept that one off its core. It says how much
# of this small step the ranks spend waiting on each other, and that every all-reduce blocks
# the layer after it; section 11 prices a layer's all-reduces on GPU links.

# %% [markdown]
# ## 9. Asynchronous TP: hide the collective behind the matmul that needs it
#
# Under sequence parallelism a column-parallel layer starts with an all-gather of the sequence
# shards and a row-parallel layer ends with a reduce-scatter. The matmul cannot start until the
# whole gather has arrived: section 8's blocking pattern, with an all-gather in the place of the
# all-reduce. But a matmul
# treats the rows (tokens) of its input independently,
# $[X_0; X_1; \dots; X_{p-1}]\,W_r^\top = [X_0W_r^\top; \dots; X_{p-1}W_r^\top]$, so rank $r$ does not
# need all of $X$ to start: it can multiply the chunk it holds while the next chunk travels.
# Wang et al. (2023) decompose each such collective and its dependent matmul into $p$ steps around
# a ring of the $p$ ranks:
#
# * **all-gather + matmul** (`all_gather_matmul`): at step $t$ rank $r$ multiplies chunk
#   $c = (r - t) \bmod p$ and, at the same time, sends that chunk on to rank $r+1$ and receives
#   chunk $c - 1$ from rank $r-1$. After $p$ steps it has multiplied every chunk;
# * **matmul + reduce-scatter** (`matmul_reduce_scatter`): at step $t$ rank $r$ computes its
#   partial result for one chunk while the running sum of the previous chunk travels to $r-1$,
#   which adds its own partial; after $p$ steps the full sum of chunk $r$ ends on rank $r$.
#
# Each ring sends $p-1$ chunks of $M/p$ bytes per rank: exactly the $\frac{p-1}{p}M$ of the ring
# all-gather or reduce-scatter it replaces (notebook 02), now as point-to-point sends. Only the
# time changes: a step's exchange is hidden when it takes less time than that step's matmul. The
# backward of each is the other, applied to the gradients. Megatron-LM does this on GPUs with
# `--tp-comm-overlap` (through Transformer Engine), and PyTorch as **asynchronous TP**
# (a `torch.compile` pass over DTensor's tensor parallelism, used by torchtitan).
# `apply_tensor_parallel(model, group, sequence_parallel=True, async_tp=True)` swaps every block's
# four linears for these forms (`course_lib.parallel.tp.async_tp`). The schedule on 4 ranks:

# %%
fig, ax = plt.subplots(figsize=(10, 3.6))
plot_ring_steps(ax, p=4)
plt.show()

# %% [markdown]
# Every rank computes at every step; each exchange runs during a matmul, and the last step has
# nothing left to receive. First the check that nothing changed but the schedule:
# 5 steps at tp = 4 with sequence parallelism, plain and asynchronous, against the single process.

# %%
sp4 = ParallelDims(tp=4, sequence_parallel=True)
runs4 = {"tp=4 + SP": run_tensor_parallel(sp4, CONFIG, TRAIN, **RANKS),
         "tp=4 + SP, async": run_tensor_parallel(sp4, CONFIG, TRAIN, async_tp=True, **RANKS)}
print(f"{'':<18}" + "".join(f"{'step ' + str(s + 1):>9}" for s in range(TRAIN.steps)))
print(f"{'1 process':<18}" + "".join(f"{v:>9.3f}" for v in reference.train_losses))
for name, per_rank in runs4.items():
    print(f"{name:<18}" + "".join(f"{v:>9.3f}" for v in per_rank[0].train_losses))
    for out in per_rank:  # every rank, every step: fp32 sums in another order (chunk by chunk), ~1e-7 here
        assert max(abs(a - b) for a, b in zip(out.train_losses, reference.train_losses)) < 1e-5
    # RMS against a hundredth of one AdamW step (lr), as in section 5: rounding moves a few elements, a bug most
    assert (per_rank[0].final_params - flat_params(reference.model)).pow(2).mean().sqrt() < TRAIN.lr / 100
gap = (runs4["tp=4 + SP, async"][0].final_params - runs4["tp=4 + SP"][0].final_params).pow(2).mean().sqrt()
assert gap < TRAIN.lr / 100
print("async TP: the same losses and parameters as plain TP and as one process, up to fp32 rounding")

# %% [markdown]
# Now one tensor-parallel MLP (`fc` column-parallel, GELU, `proj` row-parallel; b = 8, s = 256,
# d = 256) under sequence parallelism, forward and backward, on 2 ranks, plain and asynchronous
# (`course_lib.parallel.tp.overlap.mlp_on_rank`). The tracer first: what crosses the link.
#
# **Predict.** The plain MLP's forward and backward run 3 all-gathers and 2 reduce-scatters of
# the $(b, s, d)$ activation, $M$ = 2 MiB in fp32. How many bytes does each rank send with async
# TP? And on these CPU ranks, will the step get faster?
#
# <details><summary>Answer</summary>
#
# The same bytes as the ring collectives it replaces: $5 \cdot \frac{p-1}{p} M$ = 5 MiB at
# p = 2, all as point-to-point sends (the row-parallel bias's small gradient all-reduce stays in
# both). The step: not necessarily faster, and the exposed communication (the time a rank sits
# waiting) not necessarily shorter. In principle a rank waits only for the part of an exchange
# that outlasts a chunk's matmul. But on CPU ranks the "overlap" is two jobs on the same cores:
# gloo moves the bytes with CPU threads that compete with the matmul for the 2 cores, the matmul
# runs on smaller pieces, every step costs a little bookkeeping, and a rank also waits whenever
# the other one is kept off its core. The timeline below shows what happened on this run.
# </details>

# %%
MLP_SHAPE = dict(batch=8, seq=256, d_model=256, repeats=5)
mlp_runs = {a: run_on_ranks(mlp_on_rank, a, **MLP_SHAPE, world_size=2, **RANKS) for a in (False, True)}
M = MLP_SHAPE["batch"] * MLP_SHAPE["seq"] * MLP_SHAPE["d_model"] * 4  # bytes of one fp32 activation
for a, per_rank in mlp_runs.items():
    for rank, res in enumerate(per_rank):
        traffic = res["traffic"]
        if not a:  # the ring bytes of the collectives (ring_wire_bytes of section 6), against the formula
            ring = sum(ring_wire_bytes(op, s["bytes_sent"], 2) for op, s in traffic.items() if op != "all_reduce")
            assert ring == 5 * (2 - 1) / 2 * M
        else:  # only point-to-point (plus the bias gradient's all-reduce both have), and the same bytes
            assert set(traffic) == {"isend", "irecv", "all_reduce"} and traffic["isend"]["bytes_sent"] == ring
        if rank == 0:
            print(f"{'async' if a else 'plain'} (rank 0, bytes sent; received for irecv): " + ", ".join(
                f"{op} {s['calls']} x, {fmt_bytes(s['bytes_sent'] or s['bytes_recv'])}" for op, s in traffic.items()))
print(f"on each rank: {fmt_bytes(ring)} through send/recv, the ring bytes of the collectives = 5 x (p-1)/p x {fmt_bytes(M)}")
# the same matmuls, summed chunk by chunk: equal up to fp32 rounding (sums of 256 to 2,048 products, ~1e-7 relative)
for got, want in zip(mlp_runs[True][0]["grads"], mlp_runs[False][0]["grads"]):
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

# %% [markdown]
# The tracer's logical payloads of the plain run (an all-gather's shard, a reduce-scatter's full
# input) become ring bytes through section 6's `ring_wire_bytes`; the async run's sends *are* the
# bytes on the wire. Now the time: each rank's thread on one row (red: blocked in a collective or
# waiting for an exchange, the **exposed** communication; blue: everything else), and under it the
# rank's link (an exchange from its post to the end of its wait), on the same clock.

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
median = lambda xs: sorted(xs)[len(xs) // 2]
exposed, step = {}, {}
for ax, (a, per_rank) in zip(axes, mlp_runs.items()):
    exposed[a] = median([e for res in per_rank for e in res["exposed"]])
    step[a] = median([s for res in per_rank for s in res["step"]])
    assert 0 < exposed[a] < step[a]
    main = per_rank[0]["lanes"][0]  # the repeat drawn: the last one
    shown = sum(e[2] - e[1] for e in main if e[3] == "comm")
    plot_lanes(per_rank, ax, f"{'async TP' if a else 'plain TP + SP'}: MLP forward + backward, 2 CPU ranks; last "
                             f"repeat, rank 0 exposed {shown * 1e3:.0f} ms of {(main[-1][2] - main[0][1]) * 1e3:.0f} ms")
plt.tight_layout()
plt.show()
less = exposed[True] < exposed[False]
faster = step[True] < step[False]
print(f"medians over ranks and repeats: exposed communication {exposed[False] * 1e3:.1f} ms plain, "
      f"{exposed[True] * 1e3:.1f} ms async ({'less' if less else 'no less'} with async TP); step "
      f"{step[False] * 1e3:.1f} ms plain, {step[True] * 1e3:.1f} ms async "
      f"({'faster' if faster else 'not faster'} with async TP, x{step[False] / step[True]:.2f} on this run)")

# %% [markdown]
# Read the sentence under the timeline, not a promise: it is this run's measurement on 2 CPU
# ranks that share 2 cores with each other (and here with other work on the machine). On CPU ranks
# the "overlap" is two jobs on the same cores: gloo moves the bytes with CPU threads, which take
# cycles from the matmul they are meant to hide behind, and the matmul on a chunk is less
# efficient than on the whole input. So a shorter exposed time need not give a shorter step, and
# both can come out either way from run to run.
#
# A GPU changes both halves. The transfer does not need the cores that compute: a GPU has copy
# engines (DMA) that move data over NVLink on their own, and NCCL's kernels use only a few of its
# many streaming multiprocessors, so a chunk's matmul and the next chunk's transfer really run at
# once. The matmul chunks stay large enough to keep the GPU busy when $b s / p$ is in the
# thousands of tokens. That is where the decomposition pays: Wang et al. (2023) report it on TPU
# clusters, and Megatron-LM and PyTorch ship it for GPUs. It helps only where the communication
# was exposed to begin with, and it never changes the bytes.
#
# ## 10. Fewer key/value heads than ranks: grouped-query attention
#
# Grouped-query attention (Ainslie et al. 2023) lets groups of query heads share one key/value
# head: `n_kv_head` K and V heads for `n_head` query heads, each shared by
# `n_head / n_kv_head` of them. It shrinks the KV cache at inference, and most recent large
# models use it: Llama 3 70B and 405B have 64 and 128 query heads but **8** key/value heads
# (Grattafiori et al. 2024, Table 3). Tensor parallelism splits attention by heads (section 3),
# and a rank needs the K and V of its query heads. Two cases:
#
# * `tp` divides `n_kv_head`: each rank takes `n_kv_head / tp` whole KV heads with the query
#   heads of their groups, as before;
# * `n_kv_head` divides `tp` (more ranks than KV heads): each KV head is **replicated** on the
#   `tp / n_kv_head` ranks whose query heads read it. Those ranks hold the same K and V rows of
#   `qkv`; each computes a gradient for them from its own query heads only, so the copies'
#   gradients are **summed** over those ranks: the single-process gradient, since every one of
#   that head's query heads contributed to it.
#
# The rule: `tp` divides `n_head` (whole query heads per rank), and either `tp` divides
# `n_kv_head` or `n_kv_head` divides `tp` (which rank reads which KV head is then unambiguous).
# At tp = 4 with 4 query heads of 16 features and 2 KV heads, the first `qkv` row each rank takes
# from Q, K and V (`qkv_rows`; Q rows are 0-63, K rows 64-95, V rows 96-127):

# %%
GQA = GPTConfig.tiny(DATA.vocab_size, n_kv_head=2)
for rank, rows in enumerate(qkv_rows(GQA.d_model, 4, GQA.n_head, GQA.n_kv_head).tolist()):
    d_head = GQA.d_model // GQA.n_head
    print(f"rank {rank}: query head {rows[0] // d_head} (Q rows {rows[0]}-{rows[d_head - 1]}), "
          f"KV head {(rows[d_head] - GQA.d_model) // d_head} (K rows {rows[d_head]}-{rows[2 * d_head - 1]})")

# %% [markdown]
# Ranks 0 and 1 hold KV head 0, ranks 2 and 3 KV head 1. Trained 5 steps at tp = 4 with
# `n_kv_head` = 2 and 1 (one KV head on all 4 ranks), against the single process:

# %%
gqa_runs = {}
for kv in (2, 1):
    cfg = GPTConfig.tiny(DATA.vocab_size, n_kv_head=kv)
    gqa_runs[kv] = (train_reference(cfg, TRAIN), run_tensor_parallel(ParallelDims(tp=4), cfg, TRAIN, **RANKS))
print(f"{'':<24}" + "".join(f"{'step ' + str(s + 1):>9}" for s in range(TRAIN.steps)))
for kv, (single, per_rank) in gqa_runs.items():
    print(f"{f'n_kv_head={kv}, 1 process':<24}" + "".join(f"{v:>9.3f}" for v in single.train_losses))
    print(f"{f'n_kv_head={kv}, tp=4':<24}" + "".join(f"{v:>9.3f}" for v in per_rank[0].train_losses))
    for out in per_rank:  # fp32 sums in another order, as in section 5 (without the copies' gradient sum: far off)
        assert max(abs(a - b) for a, b in zip(out.train_losses, single.train_losses)) < 1e-5
    assert (per_rank[0].final_params - flat_params(single.model)).pow(2).mean().sqrt() < TRAIN.lr / 100
try:  # 3 KV heads on 4 ranks: neither divides the other
    run_tensor_parallel(ParallelDims(tp=4), GPTConfig.tiny(DATA.vocab_size, n_head=12, d_model=96, n_kv_head=3), TRAIN)
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# For Llama 3 70B and 405B, the usual tp = 8 inside a node gives each rank exactly one of the
# 8 KV heads, with 8 or 16 query heads: no copies. Only beyond tp = 8 would KV heads be
# replicated, and their K, V weights and activations stop shrinking with `tp`:

# %%
for name, m in (("Llama 3 70B", LLAMA3_70B), ("Llama 3 405B", LLAMA3_405B)):
    for tp in (8, 16):
        kv = f"{m.n_kv_head // tp} KV head(s) of its own" if tp <= m.n_kv_head else f"1 KV head, a copy ({tp // m.n_kv_head} ranks hold each)"
        print(f"{name}, tp={tp:>2}: per rank {m.n_head // tp:>3} query heads and {kv}")

# %% [markdown]
# ## 11. Why TP stays inside a node
#
# Every layer does $24\,b s h^2$ matmul FLOPs in forward (with $d_{ff} = 4h$), split over `tp`
# GPUs, and sends 2 all-reduces of $b s h$ elements. Compute grows like $h^2$, communication like
# $h$, so the ratio grows like $h$; but the all-reduce's bandwidth term barely shrinks with `tp`
# ($2\frac{tp-1}{tp}$) while the compute per GPU falls as $1/tp$. The link decides: NVLink 4
# gives each H100 450 GB/s each way, an NDR InfiniBand port 50 GB/s (notebook 02's
# `CLUSTERS`). With the α-β model and the H100's 989 TFLOP/s dense bf16 peak:

# %%
dims = [1024, 2048, 4096, 8192, 12288, 16384, 25600]
fig, ax = plt.subplots(figsize=(7, 3.6))
for name in ("H100 NVLink 4 (intra-node)", "NDR InfiniBand 400 Gb/s (inter-node)"):
    ratio = [c / m for c, m in (compute_vs_comm(h, 8, CLUSTERS[name]) for h in dims)]
    ax.plot(dims, ratio, "o-", label=name)
ax.axhline(1, color="gray", linestyle="--", linewidth=1)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("hidden size h")
ax.set_ylabel("compute time / all-reduce time")
ax.set_title("one layer's forward at tp=8, b=1, s=2048, bf16")
ax.legend(fontsize=8)
plt.show()
nv = compute_vs_comm(12288, 8, CLUSTERS["H100 NVLink 4 (intra-node)"])
ib = compute_vs_comm(12288, 8, CLUSTERS["NDR InfiniBand 400 Gb/s (inter-node)"])
print(f"GPT-3 (h=12288), tp=8: compute {nv[0] * 1e3:.2f} ms, all-reduces {nv[1] * 1e3:.2f} ms on NVLink, "
      f"{ib[1] * 1e3:.2f} ms on InfiniBand")
assert nv[0] > nv[1] and ib[0] < ib[1]

# %% [markdown]
# Inside a node, at GPT-3's width the compute takes about twice as long as the all-reduces (and
# could partly hide them); across nodes the all-reduces take about four times longer than the compute.
# That is why Megatron keeps `tp` ≤ 8, the GPUs of one NVLink domain, and uses pipeline and data
# parallelism (notebooks 06, 10) across nodes (Narayanan et al. 2021).
#
# ## 12. Explore: one layer on one rank
#
# Pick `tp` (only the values that divide GPT-3's 96 heads and its MLP width) and sequence
# parallelism: the per-rank weight shapes, one layer's weights (bf16) and saved activations
# (b = 1, s = 2048, fused attention), and the bytes each rank sends per layer.

# %%
show_interactive(lambda: layer_view(GPT3_175B, 8, False), lambda: layer_widget(GPT3_175B, 8, False))

# %% [markdown]
# ## 13. The same model through DTensor
#
# PyTorch's `torch.distributed.tensor.parallel.parallelize_module` applies a **plan**,
# `{submodule name: style}`, to a plain model: `ColwiseParallel` is our column split,
# `RowwiseParallel` the row split with g, `SequenceParallel` a LayerNorm on a sequence shard,
# `PrepareModuleInput(Shard(1) -> Replicate())` the all-gather entering a region. The weights
# become DTensors, and DTensor decides the collectives from the layouts. The course's
# `apply_dtensor_tensor_parallel` builds such a plan for every block (the fused `qkv` rows
# permuted first, so that a contiguous split takes whole heads: DTensor cannot know about
# heads). Section 5 already showed it trains to the same losses. Its collectives run below the
# `torch.distributed` Python functions, so the tracer does not see them;
# `torch.distributed.tensor.debug.CommDebugMode` counts them:

# %%
def dtensor_forward_counts(sequence_parallel):
    from torch.distributed.tensor.debug import CommDebugMode
    x, y = get_batch(DATA, 8, torch.Generator().manual_seed(0))
    model = apply_dtensor_tensor_parallel(GPT(CONFIG, seed=0), None, sequence_parallel)
    with CommDebugMode() as mode:
        model(x, y)
    return {getattr(op, "__name__", str(op)).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}

for sp in (False, True):
    counts = run_on_ranks(dtensor_forward_counts, sp, world_size=2, **RANKS)[0]
    print(f"DTensor, sequence_parallel={sp}: forward {counts}")
    per_layer = layer_communication(8, S, CONFIG.d_model, 2, sp)["forward"]
    if sp:  # one more all-gather: the sequence is gathered before ln_f
        assert counts == {"all_gather_into_tensor": L * per_layer["all_gather"] + 1,
                          "reduce_scatter_tensor": L * per_layer["reduce_scatter"]}
    else:
        assert counts == {"all_reduce": L * per_layer["all_reduce"]}

# %% [markdown]
# The same per-layer counts as the course layers: 2 all-reduces, or 2 all-gathers and 2
# reduce-scatters. (Here the embeddings and head stay replicated; DTensor's vocabulary-parallel
# loss, `loss_parallel`, needs the logits as a DTensor.) DTensor wins on generality: one plan
# style works for any module, and the layouts compose with FSDP2 on a 2-D mesh. The course layers
# win on transparency: every collective is a line you can read, and the tracer sees it.
#
# ## 14. Bad input
#
# Layouts that cannot work are refused in the notebook process, before any rank starts:

# %%
for call in (lambda: run_tensor_parallel(ParallelDims(tp=3), CONFIG, TRAIN),
             lambda: run_tensor_parallel(ParallelDims(tp=8), GPTConfig.tiny(DATA.vocab_size, n_head=8, d_ff=100), TRAIN),
             lambda: run_tensor_parallel(ParallelDims(tp=4, sequence_parallel=True),
                                         GPTConfig.tiny(DATA.vocab_size, block_size=30), TRAIN),
             lambda: check_tensor_parallel(CONFIG, 0)):
    try:
        call()
    except ValueError as err:
        print("ValueError:", err)

# %% [markdown]
# and on the ranks, a model parallelised twice, or a sequence SP cannot split:

# %%
def misuse():
    model = apply_tensor_parallel(GPT(CONFIG), None, sequence_parallel=True)
    for call in (lambda: apply_tensor_parallel(model, None), lambda: model(torch.zeros(2, 31, dtype=torch.long))):
        try:
            call()
        except ValueError as err:
            print("ValueError:", err)

_ = run_on_ranks(misuse, world_size=2, **RANKS)

# %% [markdown]
# ## What to remember
#
# * Column split: each rank an output slice, no sum. Row split: each rank a partial sum, an
#   all-reduce. Column then row = one all-reduce (g) forward and one (f) backward per block.
# * Attention splits by whole heads (mind the fused QKV rows); the vocabulary splits the
#   embedding, the head and the loss, which needs 3 numbers per token from each rank, never the logits.
# * TP is exact: same loss on every rank, gradients are slices of the single-process ones.
# * Sequence parallelism turns each all-reduce into an all-gather + reduce-scatter (the same
#   bytes on the wire in forward, though a tracer's logical payload counts more) and divides the
#   rest of the activations by `tp`.
# * TP communicates inside every layer, on the critical path: keep it within NVLink.
# * Asynchronous TP splits each all-gather (or reduce-scatter) and its matmul into $p$ ring steps:
#   each chunk's send/recv runs while a chunk already held is multiplied. Same results up to
#   rounding, same bytes; what it saves is exposed time, and only where the transfer does not
#   compete with the compute for the same hardware (a GPU's copy engines, not CPU cores).
# * With fewer key/value heads than ranks (GQA), each KV head is replicated on tp / n_kv_head
#   ranks and its copies' gradients are summed: tp | n_head, and tp | n_kv_head or n_kv_head | tp.
#
# ## Self-check
#
# 1. Why must the MLP's first matrix be split by columns and not by rows?
# 2. In backward, which operator all-reduces, f or g, and why?
# 3. A model has 40 heads. Which `tp` values can split its attention?
# 4. The vocabulary-parallel loss all-reduces the maximum without a gradient. Why is that allowed?
# 5. With sequence parallelism, why do the LayerNorm weights need an all-reduce of their
#    gradients, when they did not without it?
# 6. A tracer reports an all-gather's input bytes and a reduce-scatter's input bytes. At tp = 4,
#    a pair of them on an activation of $M$ bytes reports how many bytes, and how many does a
#    ring put on each rank's link?
# 7. Which property of a matmul lets asynchronous TP start multiplying before the all-gather has
#    finished? And why does the course's `async_tp=True` require sequence parallelism?
# 8. A model has 32 query heads and 4 key/value heads. Which of tp = 2, 8, 16, 64 work, and at
#    which of them are KV heads replicated, on how many ranks each?
#
# <details><summary>Answers</summary>
#
# 1. GELU is applied element by element: with column slices each rank applies it to complete
#    values; with row slices the values are partial sums, and GELU of a partial sum is not a
#    part of GELU of the sum, so an all-reduce would be needed before it.
# 2. f: its input was used by every rank's columns, so its gradient is the sum of every rank's
#    contribution. g's forward summed, so its backward hands the same gradient to every rank.
# 3. The divisors of 40 (that also divide d_model and the MLP width): 1, 2, 4, 5, 8, 10, 20, 40.
# 4. Subtracting any constant $m_i$ leaves $\log\sum_j e^{z_{ij}} - z_{i,y_i}$ unchanged, so the loss
#    does not depend on it and neither does its gradient; $m_i$ only keeps the exponentials finite.
# 5. Each rank applies them to only $s/tp$ tokens, so each holds part of the gradient: the sum
#    over ranks is the single-process gradient. Without SP every rank saw all tokens.
# 6. Logical: $M/4 + M = 1.25M$. On the wire: $\frac{3}{4}M + \frac{3}{4}M = 1.5M$, exactly a ring
#    all-reduce's $2\cdot\frac{3}{4}M$.
# 7. Rows are independent: the output rows of sequence chunk $c$ need only the input rows of
#    chunk $c$, so each chunk can be multiplied as soon as it has arrived (and, for the
#    reduce-scatter, each chunk's partial sums sent as soon as they are computed). Without
#    sequence parallelism there is no all-gather to split: the column-parallel layer's input is
#    already whole on every rank, and the row-parallel layer's output is all-reduced. Sequence
#    parallelism turns those into an all-gather and a reduce-scatter along the sequence, which
#    come apart chunk by chunk.
# 8. tp = 2: it divides both 32 and 4, so each rank takes 2 whole KV heads, no copies. tp = 8 and
#    16: they divide 32, and 4 divides them, so each KV head is replicated on 8/4 = 2 and
#    16/4 = 4 ranks. tp = 64 does not divide 32: a rank would get half a query head, refused.
# </details>
#
# ## References
#
# * Shoeybi, M., Patwary, M., Puri, R., LeGresley, P., Casper, J., Catanzaro, B. (2019).
#   *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism.*
#   arXiv:1909.08053. The column and row splits, f and g, attention by heads, the
#   vocabulary-parallel embedding and loss.
# * Narayanan, D., Shoeybi, M., Casper, J., LeGresley, P., Patwary, M., Korthikanti, V., et al.
#   (2021). *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM.*
#   SC '21, arXiv:2104.04473. Tensor parallelism inside a node, pipeline and data parallelism
#   across nodes.
# * Korthikanti, V., Casper, J., Lym, S., McAfee, L., Andersch, M., Shoeybi, M., Catanzaro, B.
#   (2022). *Reducing Activation Recomputation in Large Transformer Models.* arXiv:2205.05198.
#   Sequence parallelism, selective activation recomputation, and the activation formula of
#   notebook 01.
# * Grattafiori, A., Dubey, A., Jauhri, A., et al. (Llama Team, AI @ Meta) (2024). *The Llama 3
#   Herd of Models.* arXiv:2407.21783. The 128,256-token vocabulary of section 4; 8 key/value
#   heads in the 70B and 405B models (Table 3), section 10.
# * Wang, S., Wei, J., Sabne, A., Davis, A., Ilbeyi, B., Hechtman, B., et al. (2023). *Overlap
#   Communication with Dependent Computation via Decomposition in Large Deep Learning Models.*
#   ASPLOS '23, pp. 93-106, doi:10.1145/3567955.3567959. The collective and its dependent matmul
#   decomposed into overlapped ring steps (section 9).
# * Ainslie, J., Lee-Thorp, J., de Jong, M., Zemlyanskiy, Y., Lebrón, F., Sanghai, S. (2023). *GQA:
#   Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints.* EMNLP 2023,
#   arXiv:2305.13245. Grouped-query attention (section 10).
# * Megatron-LM (NVIDIA), `--make-vocab-size-divisible-by` (default 128) and the vocabulary
#   padding to a multiple of it times `tp`; `--tp-comm-overlap`, tensor parallelism's
#   communication overlapped with its matmuls through Transformer Engine: github.com/NVIDIA/Megatron-LM.
# * PyTorch's asynchronous tensor parallelism: a `torch.compile` pass that decomposes DTensor's
#   all-gather + matmul and matmul + reduce-scatter on GPUs (torchtitan's
#   `enable_async_tensor_parallel`): github.com/pytorch/torchtitan.
#
# Further reading:
#
# * W. Liang, T. Liu, *Large Scale Transformer model training with Tensor Parallel (TP)*, PyTorch
#   tutorial (docs.pytorch.org/tutorials/intermediate/TP_tutorial.html): DTensor's
#   `parallelize_module`, sequence parallelism and `loss_parallel`, composed with FSDP2.
# * N. Tazi et al. (2025), *The Ultra-Scale Playbook: Training LLMs on GPU Clusters*, Hugging
#   Face (huggingface.co/spaces/nanotron/ultrascale-playbook): tensor and sequence parallelism
#   with measured throughput and memory.
# * J. Austin et al. (2025), *How to Scale Your Model*, Google DeepMind
#   (jax-ml.github.io/scaling-book): sharded matrix multiplications and their communication,
#   from first principles.
#
# Next: write f, g and the column- and row-parallel layers yourself in
# `exercises/ex05_tensor_parallel.ipynb`.
# Once its checks pass, its last cell points to the library's own version to compare with.
