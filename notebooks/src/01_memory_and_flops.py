# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/01_memory_and_flops.ipynb)

# %% [markdown]
# # 01 · Why one GPU is not enough: memory and FLOPs
#
# Before splitting a model across many GPUs, it pays to know *why* we must, and *how much*.
# Training hits two walls:
#
# * **Memory.** A GPU has to hold the parameters, their gradients, the optimizer's state and the
#   activations that backward needs. For a 175-billion-parameter model the first three alone are
#   a few TiB; one GPU holds between 80 and 288 GB (section 5).
# * **Compute.** Training costs about 6 FLOPs per parameter per token. For GPT-3 that is
#   3.15·10²³ FLOPs, decades of work for one GPU.
#
# **After this notebook you can**
#
# * count the parameters of a GPT-style or Llama-style model exactly, from its shape;
# * compute the bytes per parameter of model state under fp32, mixed precision, `torch.autocast`
#   and ZeRO stages 0-3, and explain why mixed precision does not shrink it;
# * list what autograd saves for backward in a transformer layer, compute its bytes, and say
#   which term grows with the square of the sequence length and what removes it;
# * estimate the FLOPs and the time to train a model (6·P·D, MFU), and the GPUs it needs;
# * judge whether a layout (dp, tp, pp, ZeRO, recomputation) fits on a given GPU.
#
# Each formula is built from what PyTorch really allocates and computes, and **checked against
# a measurement in the same run** (an `assert`): parameter and optimizer bytes against the real
# model and optimizer, activation bytes against the tensors autograd saves, FLOPs against
# PyTorch's FLOP counter. The formulas live in `course_lib/estimate/` (`params.py`, `memory.py`,
# `compute.py`, `per_gpu.py`; each docstring states its formula and source).
#
# **Units.** Bytes the course computes or measures are in binary (IEC) units: KiB, MiB, GiB,
# TiB = 2¹⁰, 2²⁰, 2³⁰, 2⁴⁰ bytes (`course_lib.units`). GPU vendors quote memory in decimal GB
# (10⁹ bytes): an "80 GB" GPU holds 80·10⁹ bytes = 74.5 GiB. Such figures are converted
# explicitly where they are used.

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
from torch.utils.flop_counter import FlopCounterMode

from course_lib import estimate, units
from course_lib.estimate import calculator, calculator_widget
from course_lib.techniques.amp import MixedPrecisionOptimizer
from course_lib.observe.memory import SavedActivations, measured_state_bytes
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, make_optimizer

torch.manual_seed(0)
torch.set_num_threads(1)  # small models: one thread is as fast, and leaves the CPU to others
fmt = units.fmt_bytes  # IEC: '74.5 GiB'
A100_BF16 = 312e12  # FLOP/s: A100 dense bf16 tensor-core peak
H100_BYTES = units.from_spec_gb(80)  # an H100's "80 GB" = 80e9 bytes = 74.5 GiB

# %% [markdown]
# ## 1. Counting parameters
#
# The course GPT (`course_lib.model`) is a GPT-2-style decoder. With hidden size $d$, MLP width
# $f = 4d$, vocabulary $V$, context $T$ and biases everywhere, one transformer block holds
#
# | part | weights | biases |
# |---|---|---|
# | two LayerNorms | $2d$ (gains) | $2d$ |
# | attention: `qkv` ($d\to3d$) and `proj` ($d\to d$) | $4d^2$ | $4d$ |
# | MLP: `fc` ($d\to f$) and `proj` ($f\to d$) | $2df = 8d^2$ | $f + d = 5d$ |
#
# so $12d^2 + 13d$ per block. Around the blocks: a token embedding $Vd$, a position embedding
# $Td$, a final LayerNorm $2d$, and an output head $Vd$ — unless it is **tied** to the token
# embedding (one tensor used twice, counted once). `estimate.param_count` uses the model's own
# closed form, `course_lib.model.expected_num_params`; here it meets `sum(p.numel())`.
#
# *Predict first:* the course GPT has $d = 64$, 2 layers, $V = 97$, $T = 64$ and a tied head.
# How many parameters does untying the head add?
#
# <details><summary>Answer</summary>
#
# $Vd = 97 \times 64 = 6{,}208$: the head becomes its own $V \times d$ matrix (no bias). The
# printout shows it as the difference of the two totals.
# </details>

# %%
for tie in (True, False):
    cfg = GPTConfig.tiny(tie_weights=tie)
    real = sum(p.numel() for p in GPT(cfg).parameters())
    formula = estimate.param_count(cfg)
    assert formula == real, (formula, real)
    parts = estimate.param_breakdown(cfg)
    print(f"tie_weights={tie!s:5}: formula {formula:,} == measured {real:,}   "
          f"(per layer: attention {parts['attention']:,}, mlp {parts['mlp']:,}, norms {parts['norms']:,}; "
          f"head {parts['head']:,})")
assert parts["head"] == cfg.vocab_size * cfg.d_model  # the untied case, printed last

# %% [markdown]
# The same count works at any size. GPT-3 175B (Brown et al. 2020) is this architecture with
# 96 layers, $d = 12288$, 96 heads, $V = 50257$ and $T = 2048$. Llama 3 (Dubey et al. 2024)
# changes the block: RMSNorm (a gain, no bias), no biases at all, an untied head, a **SwiGLU**
# MLP with three $d \times f$ matrices (gate, up, down), and **grouped-query attention**, where
# 8 key/value heads are shared by all query heads, so $K$ and $V$ projections are only
# $d \times 8 d_\text{head}$. `estimate.LlamaLikeConfig` holds those shapes. All published
# sizes come out within 1 %:

# %%
published = {"GPT-3 175B": 175e9, "Llama-3 8B": 8.0e9, "Llama-3 70B": 70.6e9, "Llama-3 405B": 405.8e9}
for name, expected in published.items():
    n = estimate.param_count(estimate.PRESETS[name])
    assert abs(n / expected - 1) < 0.01, (name, n)  # published sizes are rounded (and count some extras)
    print(f"{name:13} {n / 1e9:8.2f}e9 parameters (published {expected / 1e9:.1f}e9)")

# %% [markdown]
# ## 2. Model state: what training keeps per parameter
#
# Training holds, for every parameter, the parameter itself, its gradient, and whatever the
# optimizer remembers. AdamW keeps two running moments, $m$ (mean of gradients) and $v$ (mean of
# squared gradients), one number each per parameter. How many bytes that makes depends on the
# precision recipe:
#
# * **fp32**: everything in 4-byte floats: $4 + 4 + (4 + 4) = 16$ bytes/param.
# * **bf16 mixed precision with fp32 master weights**: forward and backward run on 2-byte
#   parameters and produce 2-byte gradients; the optimizer updates an **fp32 master copy** and
#   keeps $m$, $v$ in fp32: $2 + 2 + (4 + 4 + 4) = 16$ bytes/param. This is the master-weights
#   recipe of mixed-precision training (Micikevicius et al. 2018, who used fp16) applied to
#   bfloat16 (Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training"): bf16 has
#   fp32's 8 exponent bits, so its range is fp32's, but only **8 significant bits** (7 stored,
#   1 implicit). Between 1 and 2 its values are $2^{-7}$ apart, so with round-to-nearest an
#   update smaller than $2^{-8}$ of the weight (half the spacing) is rounded away: the weight
#   does not move at all. The fp32 master copy keeps those small updates.
# * **fp16 mixed**: the same bytes, plus a loss scaler (a single scale factor, not per parameter)
#   because fp16's range is narrow.
# * **bf16 with fp32 gradient accumulation**: gradients of many micro-batches are summed in an
#   fp32 buffer, $2 + (2 + 4) + 12 = 20$ bytes/param.
# * **`torch.autocast` (bf16)**: PyTorch's everyday mixed precision works differently. The
#   parameters, their gradients and AdamW's $m$, $v$ all stay fp32, $4 + 4 + 8 = 16$ bytes/param
#   as in plain fp32; autocast casts each weight to a bf16 copy for its matmul (2 bytes/param
#   more while those copies live) and saves bf16 activations. It saves compute and activation
#   memory, not model state.
#
# So mixed precision saves compute and activation memory, *not* model-state memory. Following
# the ZeRO paper, the master copy is counted as optimizer state ($K = 12$).
#
# The bf16 rounding, on real bf16 numbers (the update is added in fp32, then the sum rounded to
# bf16, as a bf16 weight update does):

# %%
weight = torch.tensor(1.0)
print(f"bf16 spacing at 1.0: {torch.finfo(torch.bfloat16).eps} = 2^-7")
for update in (2**-7, 1.01 * 2**-8, 2**-8, 2**-9):
    new = (weight + update).to(torch.bfloat16).item()
    print(f"  1.0 + {update:.6f} -> {new:.7f} in bf16  ({'kept' if new != 1.0 else 'lost'})")
assert (weight + 2**-8).to(torch.bfloat16).item() == 1.0 and (weight + 1.01 * 2**-8).to(torch.bfloat16).item() > 1.0

# %%
print(f"{'recipe':16} {'param':>5} {'grad':>5} {'optim':>5} {'total':>5}  what is kept")
for name, r in estimate.RECIPES.items():
    print(f"{name:16} {r.param:5} {r.grad:5} {r.optimizer:5} {r.total:5}  {r.description[:70]}...")

# %% [markdown]
# (Exactly $2^{-8}$ is a tie between 1 and $1 + 2^{-7}$; round-to-nearest-even picks 1.)
#
# *Predict first:* the course GPT in fp32 with AdamW, after one optimizer step. How many bytes
# per parameter do the parameters, the gradients and the optimizer hold?
#
# <details><summary>Answer</summary>
#
# 4 + 4 + 8 = 16: fp32 parameters and gradients, and two fp32 moments per parameter. The
# optimizer's step counter is one number per tensor, not per parameter, and is not counted.
# </details>
#
# **Measured, fp32.** Build the course GPT and the course's AdamW (`course_lib.train.make_optimizer`),
# take one step so the optimizer has allocated $m$ and $v$, run a second backward so gradients
# exist, and count every byte the model and optimizer hold (`course_lib.observe.memory.measured_state_bytes`,
# which counts a tied tensor once). The formula must match **exactly**.

# %%
cfg = GPTConfig.tiny()
x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
model = GPT(cfg)
opt = make_optimizer(model, TrainConfig())
for _ in range(2):
    opt.zero_grad()
    model(x, x)[1].backward()
    if _ == 0:
        opt.step()
measured = measured_state_bytes(model, opt)
predicted = estimate.model_state_bytes(model.num_params(), "fp32")
assert measured == predicted, (measured, predicted)
P = model.num_params()
print(f"{P:,} parameters, fp32 + AdamW")
for k in predicted:
    print(f"  {k:9} predicted {predicted[k]:>9,} B   measured {measured[k]:>9,} B   ({predicted[k] / P:.0f} B/param)")

# %% [markdown]
# **Measured, bf16 mixed precision, built for real.** `course_lib.techniques.amp.MixedPrecisionOptimizer`
# turns the model's parameters into bf16 and gives AdamW an fp32 master copy; after backward it
# casts the gradients to fp32, steps on the master weights and copies them back into the bf16
# model. Its state holds the master copy plus $m$, $v$. With `fp32_grad_accum=True` it also keeps
# fp32 gradient buffers: the 20-byte recipe.

# %%
for recipe, accum in (("bf16_mixed", False), ("bf16_fp32_accum", True)):
    model16 = GPT(cfg)
    mp = MixedPrecisionOptimizer(model16, lambda m: make_optimizer(m, TrainConfig()), torch.bfloat16,
                                 fp32_grad_accum=accum)
    for step in range(2):
        mp.backward(model16(x, x)[1])
        if step == 1:  # after backward, before the step frees the 16-bit gradients
            measured = measured_state_bytes(model16, mp)
            measured["grads"] += sum(g.numel() * g.element_size() for g in mp.fp32_grads)
            measured["total"] = measured["params"] + measured["grads"] + measured["optimizer"]
        mp.step()
    assert next(model16.parameters()).dtype == torch.bfloat16
    predicted = estimate.model_state_bytes(P, recipe)
    assert measured == predicted, (recipe, measured, predicted)
    per = {k: v / P for k, v in measured.items()}
    print(f"{recipe:16} measured params {per['params']:.0f} + grads {per['grads']:.0f} + "
          f"optimizer {per['optimizer']:.0f} = {per['total']:.0f} B/param  == formula")

# torch.autocast: the model and AdamW stay fp32; only the compute inside the block is bf16.
model_ac = GPT(cfg)
opt_ac = make_optimizer(model_ac, TrainConfig())
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits, loss = model_ac(x, x)
loss.backward()
opt_ac.step()
assert logits.dtype == torch.bfloat16 and next(model_ac.parameters()).dtype == torch.float32
measured = measured_state_bytes(model_ac, opt_ac)
assert measured == estimate.model_state_bytes(P, "bf16_autocast")
per = {k: v / P for k, v in measured.items()}
print(f"{'bf16_autocast':16} measured params {per['params']:.0f} + grads {per['grads']:.0f} + "
      f"optimizer {per['optimizer']:.0f} = {per['total']:.0f} B/param  == formula (bf16 logits, fp32 state)")

# %% [markdown]
# ### ZeRO: stop replicating the state
#
# Plain data parallelism gives each of $N_d$ GPUs a full copy of all 16 bytes/param.
# ZeRO (Rajbhandari et al. 2020) splits what does not need to be replicated: each rank owns
# $1/N_d$ of the parameters and keeps the state only for its share.
#
# | stage | sharded | bytes per param per GPU (mixed precision, $K=12$) |
# |---|---|---|
# | 0 (plain DP) | nothing | $2 + 2 + K = 16$ |
# | 1 | optimizer state | $2 + 2 + K/N_d$ |
# | 2 | + gradients | $2 + (2 + K)/N_d$ |
# | 3 | + parameters | $(2 + 2 + K)/N_d$ |
#
# Stages 1 and 2 cost no extra communication over plain data parallelism (a reduce-scatter plus
# an all-gather moves what one all-reduce moves); stage 3 all-gathers every layer's parameters
# again in forward and backward.

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.6))
dps = [2**i for i in range(11)]
for stage in range(4):
    per = [estimate.model_state_bytes(10**9, "bf16_mixed", stage, dp)["total"] / 10**9 for dp in dps]
    ax.plot(dps, per, "o-", label=f"ZeRO-{stage}")
assert estimate.model_state_bytes(64 * 10**6, "bf16_mixed", 3, 64)["total"] == 16 * 10**6  # 16/64 B/param
ax.set(xscale="log", yscale="log", xlabel="data-parallel ranks $N_d$", ylabel="bytes per parameter per GPU",
       title="Model state per GPU, bf16 mixed + AdamW")
ax.set_xticks(dps, [str(d) for d in dps])
ax.xaxis.set_minor_locator(plt.NullLocator())
ax.legend()
plt.show()
for stage in range(4):
    b = estimate.model_state_bytes(10**9, "bf16_mixed", stage, 8)["total"] / 10**9
    print(f"ZeRO-{stage}, N_d = 8: {b:6.3f} bytes/param per GPU")

# %% [markdown]
# ## 3. Activations: what autograd keeps for backward
#
# Backward needs, for every operation, some of its inputs or outputs: a linear layer needs its
# input (to form the weight gradient), GELU its input, softmax its output, LayerNorm its input
# plus the per-token mean and 1/std. These **saved tensors** are the activation memory, and they
# grow with batch $b$ and sequence $s$ while the model state does not.
#
# Reading them off the course GPT op by op gives, for one layer in fp32 ($e = 4$ bytes), with
# $n = bs$ tokens and $a$ heads:
#
# * $d$ per token each for: the `ln1` input, the `qkv` input, $Q$, $K$, $V$ (3d), the attention
#   `proj` input, the `ln2` input, the `fc` input — $8d$;
# * $f$ per token each for the GELU input and the MLP `proj` input — $2f$;
# * **the attention weights**: the softmax output, $a \cdot s \times s$ per sequence, and the bool
#   causal mask ($s^2$ bytes) — this term grows with $s^2$;
# * LayerNorm statistics: 2 norms × (mean, rstd) in fp32 = 16 bytes per token.
#
# $$\text{bytes per layer} = e\,n\,(8d + 2f) + e\,a\,s^2 b + s^2 + 16n.$$
#
# Outside the layers: token and position ids, the final LayerNorm and head inputs, the
# log-softmax over the vocabulary ($4nV$) and the targets. `SavedActivations` counts what autograd
# really saves (through saved-tensor hooks, each storage once, parameters excluded).
#
# *Predict first:* one layer of the course GPT ($d = 64$, 4 heads, $f = 256$) on a batch of
# 4 sequences of 64 tokens, in fp32. Which single term of the formula is the largest: the
# attention weights ($4as^2b$) or the MLP hidden activations ($2 \cdot 4nf$)? What if the
# sequence were 1,024 tokens long?
#
# <details><summary>Answer</summary>
#
# At $s = 64$ the MLP hidden term: $2 \cdot 4 \cdot 256 \cdot 256 = 524{,}288$ bytes against
# $4 \cdot 4 \cdot 64^2 \cdot 4 = 262{,}144$ for the softmax output. The attention term grows
# with $s^2$ and the MLP term with $s$, so at $s = 1{,}024$ the attention weights are
# $16\times$ larger relative to it and dominate.
# </details>
#
# Side by side for a one-layer model:

# %%
def saved_bytes(cfg, batch, seq):
    """Bytes autograd saves during one forward pass of GPT(cfg) on a batch x seq input."""
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    with SavedActivations(model) as saved:
        model(idx, targets)
    return saved


one = GPTConfig.tiny(n_layer=1)
saved = saved_bytes(one, 4, 64)
est = estimate.activation_bytes(one, batch=4, seq=64, dtype_bytes=4)
print("formula, one layer:")
for term, b in est["layer_terms"].items():
    print(f"  {term:22} {b:>8,} B")
print(f"  + outside the layers: inputs {est['input_side']:,} B, final norm/head/loss {est['output_side']:,} B")
print(f"  = {est['total']:,} B\nmeasured: {saved.bytes:,} B in {sum(saved.by_shape().values())} storages:")
for (shape, dtype), count in sorted(saved.by_shape().items(), key=str):
    print(f"  {count} x {dtype:8} {shape}")
assert saved.bytes == est["total"] + 4  # bytes are exact: the formula leaves out only the 4-byte scalar loss

# %% [markdown]
# Now the formula against the measurement for several shapes: more layers, a wider model, longer
# sequences, the fused attention kernel (`attn_impl="fused"`, which keeps only a log-sum-exp per
# row instead of the $s \times s$ weights and recomputes them in backward), and dropout (each
# dropout keeps a mask; on the CPU PyTorch stores it in the input's dtype, hence `mask_bytes=4`).
# Each agrees to the byte, up to the 4-byte scalar loss (the cell asserts it).

# %%
cases = [
    ("tiny, b=4, s=64", GPTConfig.tiny(), 4, 64),
    ("tiny, fused attention", GPTConfig.tiny(attn_impl="fused"), 4, 64),
    ("tiny, dropout 0.1", GPTConfig.tiny(dropout=0.1), 4, 64),
    ("4 layers, d=128, s=128", GPTConfig.tiny(n_layer=4, d_model=128, block_size=128), 2, 128),
    ("6 heads, d_ff=200, untied", GPTConfig.tiny(n_head=6, d_model=96, d_ff=200, tie_weights=False), 3, 48),
]
print(f"{'config':28} {'formula':>12} {'measured':>12}  ratio")
for label, c, b, s in cases:
    measured = saved_bytes(c, b, s).bytes
    predicted = estimate.activation_bytes(c, b, s, dtype_bytes=4, mask_bytes=4)["total"]
    assert measured == predicted + 4, (label, predicted, measured)  # to the byte, but for the 4-byte loss
    print(f"{label:28} {predicted:>12,} {measured:>12,}  {predicted / measured:.4f}")

# %% [markdown]
# ### The 16-bit form, and recomputation
#
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count
# the same inventory for 16-bit training with dropout on a GPU (1-byte masks), ignoring the tiny
# LayerNorm statistics: per layer
#
# $$s\,b\,h\left(34 + 5\,\frac{a\,s}{h}\right) \text{ bytes}$$
#
# ($h = d$, $f = 4h$): the $34\,sbh$ are the per-token tensors, the $5as^2b$ the softmax output
# (2 bytes), its dropout mask (1) and dropped-out copy (2). `estimate.activation_bytes` with
# `dtype_bytes=2, dropout=True` reproduces it. Two ways to shrink it:
#
# * **selective recomputation**: keep $Q, K, V$, recompute the $s^2$ attention part in backward
#   (cheap in FLOPs, large in bytes) → $34\,sbh$. Fused (flash) attention does exactly this.
# * **full recomputation** (activation checkpointing): keep only each layer's input, $2sbh$, and
#   rerun the layer's forward in backward (≈ +33 % compute); one layer's full set is live again
#   while it is recomputed.

# %%
s, b, h, a = 2048, 1, 12288, 96
g3 = estimate.activation_bytes(estimate.GPT3_175B, b, s, dtype_bytes=2, attention="naive", dropout=True)
paper = s * b * h * (34 + 5 * a * s / h)
assert abs(g3["per_layer"] / paper - 1) < 0.005  # the paper leaves out the LayerNorm statistics (0.15 %)
print(f"GPT-3 layer, s={s}, b={b}: inventory {fmt(g3['per_layer'])}, Korthikanti sbh(34 + 5as/h) = {fmt(paper)}")

fig, ax = plt.subplots(figsize=(6.5, 3.8))
seqs = [256, 512, 1024, 2048]
at_2048 = {}
for label, kw in [("naive attention, no recompute", dict(attention="naive")),
                  ("fused attention (or selective)", dict(attention="fused")),
                  ("full recompute", dict(attention="fused", recompute="full"))]:
    totals = [estimate.activation_bytes(estimate.GPT3_175B, 1, q, 2, dropout=True, **kw)["total"] for q in seqs]
    at_2048[label] = totals[-1]
    ax.plot(seqs, [t / units.GiB for t in totals], "o-", label=label)
ax.axhline(H100_BYTES / units.GiB, color="black", linestyle="--", linewidth=1, label="H100: 80 GB = 74.5 GiB")
ax.set(xscale="log", yscale="log", xlabel="sequence length s", ylabel="activations, GiB",
       title="GPT-3 175B activations for ONE sequence (bf16, all 96 layers)")
ax.set_xticks(seqs, [str(q) for q in seqs])
ax.minorticks_off()
ax.legend(fontsize=8)
plt.show()
for label, b in at_2048.items():
    print(f"s = 2048, {label:32} {fmt(b):>10}  ({b / H100_BYTES:.2f} x an H100's memory)")
naive_b, fused_b, full_b = at_2048.values()
assert naive_b > fused_b > H100_BYTES > full_b  # only full recomputation fits one sequence

# %% [markdown]
# Even a single 2048-token sequence through GPT-3 needs more activation memory than an 80 GB
# GPU has, with naive and even with fused attention; only full recomputation brings it under. Activations also scale linearly with the
# micro-batch: the reason micro-batches of 1 are common at this size.
#
# ## 4. FLOPs: what a training step costs
#
# A matmul of an $m\times k$ by a $k\times n$ matrix costs $2mkn$ FLOPs (a multiply and an add).
# Per token, the forward pass multiplies by every weight matrix once: $2N_\text{mm}$ FLOPs, where
# $N_\text{mm}$ counts the weights used in matmuls (attention and MLP matrices, and the output
# head, which multiplies even when tied; embeddings are lookups). Attention adds two matmuls whose
# size depends on the context: $QK^\top$ and (weights)·$V$, $2 \cdot 2sd$ per token per layer.
# Backward computes two matmuls per forward matmul (gradient w.r.t. the input and w.r.t. the
# weight), so a training step is 3× the forward:
#
# $$\text{FLOPs per token} = 3\left(2N_\text{mm} + 4\,L\,s\,d\right) \approx 6N.$$
#
# The attention term counts the full $s\times s$ square, as the plain kernel computes it;
# Kaplan et al. 2020 count half of it ($2 L s d$ forward) assuming the masked half is skipped
# (`causal=True`). `torch.utils.flop_counter.FlopCounterMode` counts the matmuls PyTorch really
# runs in forward and backward; the formula must agree exactly (a count of the same matmuls).
#
# *Predict first:* the course GPT has about 110,000 parameters and trains on 64-token
# sequences. Is its exact training cost per token above or below $6N$, and by roughly how much?
#
# <details><summary>Answer</summary>
#
# Above, by the attention term: relative to the $6 \cdot 12Ld^2$ of the layer weights it adds
# $s/(6d) = 64/384 \approx 17\%$. Two things pull the other way: the position table and the
# biases count in $N$ but are never multiplied, and the tied head multiplies although it is
# counted once. The printout below shows the net ratio.
# </details>

# %%
print(f"{'config':28} {'formula':>14} {'FlopCounter':>14}  ratio")
for label, c, b, s in cases:
    if c.attn_impl == "fused":  # FlopCounterMode has no formula for the CPU flash kernel: it would miss its FLOPs
        continue
    model = GPT(c)
    idx = torch.randint(0, c.vocab_size, (b, s))
    counter = FlopCounterMode(display=False)
    with counter:
        model(idx, idx)[1].backward()
    predicted = estimate.flops_per_token(c, s) * b * s
    measured = counter.get_total_flops()
    assert predicted == measured, (label, predicted, measured)  # FLOPs are counted, not measured: exact
    print(f"{label:28} {predicted:>14,.0f} {measured:>14,}  {predicted / measured:.4f}")

# %% [markdown]
# How good is the famous shortcut "6 FLOPs per parameter per token"? The attention term adds
# $12Lsd$ to roughly $6 \cdot 12Ld^2$, a relative excess of $s/(6d)$: 17 % for the tiny course model
# ($s = d = 64$; its measured ratio is lower because its position table and biases, a few
# percent of its parameters, are never multiplied), under 3 % for GPT-3 ($s = 2048$,
# $d = 12288$). At scale, $6N$ is a good estimate.

# %%
for name in ("course GPT", "GPT-3 175B"):
    c = estimate.PRESETS[name]
    exact = estimate.flops_per_token(c)
    rule = 6 * estimate.param_count(c)
    if name == "GPT-3 175B":
        assert 1 < exact / rule < 1 + 2048 / (6 * 12288) + 0.005
    print(f"{name:11} exact {exact:.4g} FLOPs/token, 6N = {rule:.4g}, ratio {exact / rule:.3f}")

# %% [markdown]
# ## 5. Scaling up: GPT-3 175B
#
# **How much memory does a GPU have?** Data-centre GPUs of 2022-2025, as their vendors quote
# them (decimal GB), and in the binary units the course computes in:

# %%
GPU_MEMORY_GB = {  # vendor spec sheets; B200 is sold in 180 and 192 GB versions
    "NVIDIA H100 (SXM)": 80, "NVIDIA H200": 141, "NVIDIA B200": 180, "AMD MI300X": 192,
    "NVIDIA B300": 288, "AMD MI355X": 288,
}
print(f"{'GPU':18} {'spec sheet':>10} {'= bytes':>16} {'in GiB':>10}")
for gpu, gb in GPU_MEMORY_GB.items():
    print(f"{gpu:18} {gb:>7} GB {units.from_spec_gb(gb):>16,} {units.spec_gb_to_gib(gb):>6.1f} GiB")
assert round(units.spec_gb_to_gib(80), 1) == 74.5

# %% [markdown]
# The rest of this section measures models in H100s (80 GB = 74.5 GiB), the most common
# training GPU of these years; divide by 1.8 for a 141 GB H200 or by 3.6 for a 288 GB B300.
#
# *Predict first:* GPT-3 has 175 billion parameters. How many H100s does it take just to hold
# its weights in bf16? And its whole model state for training with AdamW in mixed precision?
#
# <details><summary>Answer</summary>
#
# Weights: $2 \times 175 \cdot 10^9$ bytes $= 350 \cdot 10^9$ bytes, about 4.4 H100s. The model
# state is 16 bytes per parameter, 8× more: about 35 H100s, before any activation. The cell
# below computes both with the exact parameter count.
# </details>

# %%
P3 = estimate.param_count(estimate.GPT3_175B)
weights16 = 2 * P3
print(f"GPT-3: {P3 / 1e9:.1f}e9 parameters -> 16-bit weights alone {fmt(weights16)} "
      f"= {weights16 / H100_BYTES:.1f} x an H100's {fmt(H100_BYTES)}")
print(f"\n{'recipe':16} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10}  H100s for the state")
for name in estimate.RECIPES:
    st = estimate.model_state_bytes(P3, name)
    print(f"{name:16} {fmt(st['params']):>10} {fmt(st['grads']):>10} {fmt(st['optimizer']):>10} "
          f"{fmt(st['total']):>10}  {st['total'] / H100_BYTES:5.1f}")
z3 = estimate.model_state_bytes(P3, "bf16_mixed", zero_stage=3, dp=64)["total"]
assert z3 < H100_BYTES < estimate.model_state_bytes(P3, "bf16_mixed", zero_stage=3, dp=32)["total"]
print(f"\nZeRO-3 over 64 GPUs: {fmt(z3)} of state per GPU, fits an H100 (over 32 GPUs it would not)")

# %% [markdown]
# **Compute.** The 6·P·D rule for 300 billion training tokens gives
# $6 \times 175\cdot10^9 \times 300\cdot10^9 = 3.15\cdot10^{23}$ FLOPs. An A100 (the GPU GPT-3's
# generation trained on) peaks at 312 TFLOP/s in bf16; real training reaches 30-55 % of peak
# (the **model FLOPs utilisation**, MFU), so even the peak figure is optimistic.

# %%
total = estimate.training_flops(175e9, 300e9)
assert abs(total - 3.15e23) < 1e20  # 6 x 175e9 x 300e9 in float64: exact to ~1e8
year = 365.25 * 86400
t_peak = estimate.training_time(total, 1, A100_BF16, mfu=1.0)
t_real = estimate.training_time(total, 1, A100_BF16, mfu=0.4)
assert 31 < t_peak / year < 33
print(f"6PD = {total:.3g} FLOPs")
print(f"one A100 at 100% of peak: {t_peak:.3g} s = {t_peak / year:.0f} years; at 40% MFU: {t_real / year:.0f} years")
for n in (8, 64, 512, 1024, 4096):
    print(f"  {n:5} A100s at 40% MFU: {estimate.fmt_duration(estimate.training_time(total, n, A100_BF16, 0.4))}")
n4w = estimate.gpus_needed(total, 28 * 86400, A100_BF16, 0.4)
assert estimate.training_time(total, n4w, A100_BF16, 0.4) <= 28 * 86400
print(f"four weeks at 40% MFU need {n4w} A100s")

# 6PD leaves out the attention term; the calculator below counts it (flops_per_token).
exact = estimate.flops_per_token(estimate.GPT3_175B) * 300e9
days_6pd, days_exact = (estimate.training_time(f, 1024, A100_BF16, 0.4) / 86400 for f in (total, exact))
print(f"1024 A100s: {days_6pd:.1f} days by 6PD ({total:.3g} FLOPs), {days_exact:.1f} days with attention "
      f"counted ({exact:.3g} FLOPs, {exact / total - 1:+.1%})")
assert days_6pd < days_exact

# %% [markdown]
# The two day counts differ only by the attention FLOPs that 6PD leaves out (and by 174.6e9
# exact parameters against the rounded 175e9): the calculator of section 6 uses the exact count.
#
# So training at this scale needs **both** kinds of splitting: the state and activations must be
# spread so each GPU holds a slice (ZeRO, tensor, pipeline and expert parallelism, recomputation,
# offload), and the work must be spread over about a thousand GPUs (data parallelism on top).
# The rest of the course builds each of these.
#
# ## 6. A per-GPU memory calculator
#
# `estimate.per_gpu_memory` puts everything together for the busiest GPU of a
# $dp \times ep \times tp \times pp$ mesh (the layout of `course_lib.parallel.mesh`):
#
# * **tp** (tensor parallel) splits attention heads, MLP columns, embedding and head rows by $tp$;
#   activations inside those regions too (and all of them with sequence parallelism, on with tp > 1).
# * **pp** (pipeline parallel) gives each stage $L/pp$ layers, the embedding to the first and the
#   head to the last. Under the 1F1B schedule the first stage keeps $pp$ micro-batches in
#   flight, so it holds as many activations as one micro-batch through all $L$ layers.
# * **ep** (expert parallel) only exists for mixture-of-experts models: set `n_experts` (the model
#   becomes an `estimate.MoEConfig`: each MLP turns into `n_experts` expert MLPs, `top_k` per token)
#   and $ep$ splits the experts. The ranks of an ep group read different data, so dense weights
#   are replicated (and ZeRO-sharded) over $dp\cdot ep$ ranks, expert weights over $dp$.
# * **ZeRO** shards over the data-parallel ranks as above; **offload** moves the optimizer state
#   to CPU memory (ZeRO-Offload).
#
# The static figure below is the calculator's answer for GPT-3 175B, one memory-saving step per
# bar (micro-batch 1, 2048 tokens, A100s at 40 % MFU for the time under each bar).

# %%
ladder = calculator.gpt3_ladder()
fig = calculator.plot_scenarios(ladder)
fig.suptitle("GPT-3 175B: memory on the busiest GPU", fontsize=11)
plt.show()
results = [calculator.evaluate(s) for _, s in ladder]
assert not results[0]["fits"] and results[-2]["fits"] and results[-1]["fits"]
for (label, _), r in zip(ladder, results):
    print(f"{label.replace(chr(10), ' '):38} {fmt(r['memory']['total']):>9}  {'fits' if r['fits'] else 'does not fit'}")

# %% [markdown]
# Invalid layouts are rejected with the rule they break, before anything is computed:

# %%
for bad in (dict(tp=5), dict(pp=97), dict(ep=2), dict(zero_stage=4)):
    try:
        estimate.per_gpu_memory(estimate.GPT3_175B, **bad)
    except ValueError as err:
        print(f"{bad}: ValueError: {err}")
    else:
        raise AssertionError(f"{bad} was accepted")

# %% [markdown]
# **Try it.** In a live Jupyter kernel the widget below lets you pick a preset (the course GPT,
# GPT-3 175B, Llama-3 8B/70B/405B), change the shape (hidden size, layers, heads, vocabulary,
# experts), micro-batch and sequence, precision recipe, recomputation, attention kernel, ZeRO
# stage, the dp/tp/pp/ep degrees and optimizer offload, and see the stacked per-GPU bar against
# the 80 GB line with the time to train. Things to try:
#
# * Llama-3 405B at 8192 tokens with tp=8, pp=9 (14 of its 126 layers per stage), dp=16, ZeRO-1:
#   with selective recomputation the activations alone exceed the GPU; full recomputation fits.
# * The same model with ZeRO-3 over dp=1024 and no recomputation: the model state is tiny per
#   GPU, the activations are not — ZeRO does not touch activations.
# * Llama-3 8B as an 8-expert MoE (top-2): compare ep=1 with ep=8.
#
# It starts at the fifth bar of the ladder above (tp=8, pp=8, dp=16, ZeRO-1, selective
# recomputation, 300B tokens). Token counts are typed (300B, 15T) and used exactly; the
# sliders offer only layouts that divide the model (tp the heads, pp the layers, ep the experts).

# %% tags=["nbval-ignore-output"]
from course_lib.widgets import show_interactive

show_interactive(lambda: calculator_widget.calculator_view(), lambda: calculator_widget.MemoryCalculator())

# %% [markdown]
# ## What to remember
#
# * Parameters: $12d^2$ per GPT layer; count them exactly, tied weights once.
# * Model state: 16 bytes/param with AdamW in fp32, in bf16 with fp32 master weights
#   (2 + 2 + 12) and under `torch.autocast` (4 + 4 + 8); 20 with fp32 gradient accumulation.
#   ZeRO divides it by the number of data-parallel ranks, stage by stage.
# * bf16 keeps 8 significant bits: updates below $2^{-8}$ of a weight are lost, hence fp32
#   master weights.
# * Activations: $sbh(34 + 5as/h)$ per layer in 16 bits; fused attention and recomputation remove
#   most of it, at the price of recomputed FLOPs.
# * Compute: $6PD$ FLOPs (plus attention); divide by GPUs × peak × MFU for the time.
#
# ## Self-check
#
# 1. A 7-billion-parameter model is trained with AdamW in bf16 with fp32 master weights on 8
#    data-parallel GPUs. How many GiB of model state does each GPU hold under ZeRO-0, 1, 2, 3?
# 2. Why does switching from fp32 to `torch.autocast(dtype=torch.bfloat16)` not reduce the
#    model state, and what does it reduce?
# 3. A bf16 weight equals 3.0. Which of the updates 0.02, 0.01, 0.005 change it?
# 4. Doubling the sequence length with naive attention: by what factor do the softmax
#    activations grow? The MLP activations?
# 5. How many days does a 70-billion-parameter model trained on 15·10¹² tokens take on
#    4,096 GPUs of 989 TFLOP/s bf16 peak at 40 % MFU (6·P·D)?
#
# <details><summary>Answers</summary>
#
# 1. $7\cdot10^9 \times$ (16, 4 + 12/8, 2 + 14/8, 16/8) bytes = 104.3, 35.9, 24.4, 13.0 GiB.
# 2. Autocast keeps the parameters, gradients and optimizer moments in fp32 (4 + 4 + 8 bytes per
#    parameter); it runs the matmuls on bf16 copies and saves bf16 activations, so it reduces
#    compute time and activation memory.
# 3. Between 2 and 4 the bf16 spacing is $2^{-6} = 0.015625$; an update is kept only if it is
#    more than half of that, 0.0078: 0.02 and 0.01 change the weight (to 3.015625), 0.005 does
#    not.
# 4. The softmax output is $a s^2 b$: 4×. The MLP activations are linear in $s$: 2×.
# 5. $6 \times 70\cdot10^9 \times 15\cdot10^{12} = 6.3\cdot10^{24}$ FLOPs, divided by
#    $4096 \times 989\cdot10^{12} \times 0.4$ FLOP/s = 3.9·10⁶ s ≈ 45 days.
# </details>

# %% [markdown]
# ## References
#
# What this notebook relies on:
#
# * Brown et al. (2020). *Language Models are Few-Shot Learners*, NeurIPS 2020: GPT-3's shape
#   (section 1) and its 300 billion training tokens (section 5).
# * Dubey et al. (2024). *The Llama 3 Herd of Models*, arXiv:2407.21783: the Llama 3 shapes
#   (RMSNorm, SwiGLU, grouped-query attention, untied head) counted in section 1.
# * Kingma & Ba (2015). *Adam: A Method for Stochastic Optimization*, ICLR 2015, and Loshchilov &
#   Hutter (2019). *Decoupled Weight Decay Regularization*, ICLR 2019: the two moments $m$, $v$
#   that AdamW keeps per parameter (section 2).
# * Micikevicius et al. (2018). *Mixed Precision Training*, ICLR 2018: fp32 master weights and
#   loss scaling, the recipe behind the 16 bytes/param of section 2.
# * Kalamkar et al. (2019). *A Study of BFLOAT16 for Deep Learning Training*, arXiv:1905.12322:
#   bf16 (fp32's range, 8 significant bits) as a training format.
# * Rajbhandari et al. (2020). *ZeRO: Memory Optimizations Toward Training Trillion Parameter
#   Models*, SC20: $K = 12$ and the bytes per parameter of stages 1-3.
# * Ren et al. (2021). *ZeRO-Offload: Democratizing Billion-Scale Model Training*, USENIX ATC
#   2021: optimizer state in CPU memory, the calculator's offload option.
# * Korthikanti et al. (2022). *Reducing Activation Recomputation in Large Transformer Models*,
#   arXiv:2205.05198 (MLSys 2023): $sbh(34 + 5as/h)$ and selective recomputation (section 3).
# * Dao et al. (2022). *FlashAttention: Fast and Memory-Efficient Exact Attention with
#   IO-Awareness*, NeurIPS 2022: fused attention keeps a log-sum-exp per row instead of the
#   $s \times s$ weights.
# * Kaplan et al. (2020). *Scaling Laws for Neural Language Models*, arXiv:2001.08361: about
#   $6N$ training FLOPs per token, and the attention term beside it (section 4).
# * Chowdhery et al. (2022). *PaLM: Scaling Language Modeling with Pathways*, arXiv:2204.02311:
#   model FLOPs utilisation (MFU), the efficiency measure of section 5.
#
# Further reading:
#
# * Anthony, Biderman & Schoelkopf (2023). [*Transformer Math 101*](https://blog.eleuther.ai/transformer-math/),
#   EleutherAI blog: this notebook's memory and FLOPs accounting on one page, a handy
#   checklist when sizing a run.
# * Korthikanti et al. (2022), its activation-memory section: the inventory of section 3 term by
#   term for a 16-bit GPU run, extended to tensor, sequence and pipeline parallelism.
# * Chowdhery et al. (2022), Appendix B: how MFU is computed from measured throughput, and why
#   it differs from hardware FLOPs utilisation when activations are recomputed.
#
# **Next:** exercise 01 (`exercises/ex01_memory_math.ipynb`) asks you to plan a real training
# layout with these formulas; then the following notebooks build the parallel strategies that
# make the numbers of section 6 real.
