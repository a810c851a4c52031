# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/04_memory_techniques.ipynb)

# %% [markdown]
# # 04 · Fitting more in memory: mixed precision, activation checkpointing, gradient accumulation
#
# Notebook 01 split a training step's memory into two piles:
#
# * **model state**: parameters, gradients and optimizer state, 16 bytes per parameter for
#   fp32 AdamW, whatever the batch;
# * **activations**: the tensors autograd keeps from the forward pass for the backward pass,
#   proportional to batch × sequence × layers.
#
# Before splitting a model across GPUs (the notebooks after this one), three single-device
# techniques move those piles around. Each trades something for memory:
#
# | technique | what it shrinks | what it costs |
# |---|---|---|
# | **mixed precision** (bf16 / fp16 compute) | activations (~half), and on GPUs the time of every matmul | numerics: fp16 needs *loss scaling*; the fp32 *master weights* keep the model state at 16 B/param |
# | **activation checkpointing** | activations: from every layer's to one tensor per segment | one more forward pass of the checkpointed layers (a third more compute when backward costs two forwards; §2.4 measures it) |
# | **gradient accumulation** | activations for a given batch: divided by the number of micro-batches | the micro-batches run one after another |
| **FP8 and FP4 matmuls** (§1.7-1.10) | the matmul inputs saved for backward (1 byte), FSDP's parameter all-gather (half of bf16), and on GPUs the matmul time | numerics: 3 or 2 mantissa bits, so every tensor needs a *scale*, and the grain of the scales decides what outliers cost |
#
# **After this notebook you can**
#
# * explain why fp16 training needs loss scaling and bf16 does not, and why both keep fp32
#   master weights (bf16: 8 significant bits, so updates below 2^-8 of a weight are lost);
# * run a dynamic loss scaler by hand and check it against `torch.amp.GradScaler`;
# * count the bytes per parameter of each mixed-precision recipe (16 for 2 + 2 + 12);
# * predict the activation memory of checkpointing every k blocks, find the best k for a
#   given depth and block size, and say when "checkpoint every block" is the right choice;
# * accumulate gradients over micro-batches so that they equal the big-batch gradient, and
#   spot the missing 1/k;
# * read the FP8 formats' range and spacing, scale a tensor into e4m3 per tensor, row, tile,
#   block or MX block, say which granularity survives an outlier channel or token, and count
#   what FP8 saves in memory and traffic (and why its speed is a GPU's);
# * quantize by hand into e2m1's eight magnitudes with MXFP4's power-of-two and NVFP4's e4m3 and
#   fp32 scales, and say what the NVFP4 training recipe adds (random Hadamard transforms,
#   stochastic rounding, 2D weight blocks, layers kept in higher precision) and why.
#
# Every claim below is measured on the course GPT and held against the formulas of
# notebook 01 (`course_lib.estimate`) with an `assert`. The code lives in
# `course_lib/techniques/`: `amp.py`, `activation_checkpointing.py`, `accumulation.py`, `fp8.py` and `fp4.py`.

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
import math
import statistics
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from course_lib import estimate
from course_lib.techniques.accumulation import accumulate_gradients
from course_lib.techniques.amp import DynamicLossScaler, MixedPrecisionOptimizer
from course_lib.techniques.activation_checkpointing import Chain, best_every_k, checkpoint_memory, checkpointed_forward
from course_lib.data import CharDataset, get_batch
from course_lib.observe.memory import SavedActivations, measured_state_bytes
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, make_optimizer, train_step

torch.manual_seed(0)
torch.set_num_threads(1)  # tiny models: one thread is as fast here, and the numbers are reproducible
%matplotlib inline

train_data = CharDataset("train", block_size=64)
V = train_data.vocab_size
fmt = estimate.fmt_bytes


def batch(b, seq=64, seed=0):
    """A fixed batch of real text: (x, y) of shape (b, seq)."""
    return get_batch(train_data, b, torch.Generator().manual_seed(seed))


def loss_fp32(model, x, y):
    """Cross-entropy computed in fp32 from the model's logits, whatever their dtype (what
    autocast does: the softmax over the vocabulary is a reduction that needs the range)."""
    logits, _ = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

# %% [markdown]
# ## 1. Mixed precision
#
# ### 1.1 Three number formats
#
# A floating-point number is sign × 2^exponent × 1.mantissa. The exponent bits set the
# **range**, the mantissa bits the **precision** (the gap between 1 and the next number, `eps`).
# bf16 keeps fp32's 8 exponent bits and cuts the mantissa to 7 stored bits: with the implicit
# leading 1 that is **8 significant bits**, so the numbers next to 1.0 are spaced
# 2^-7 ≈ 0.0078 apart (`eps`), and rounding to nearest loses any update smaller than half that
# spacing, 2^-8 ≈ 0.0039 relative to the weight. fp16 spends its bits the other way: 5 exponent
# bits (tiny range), 10 mantissa bits (11 significant). Below the smallest *normal* number,
# *subnormals* trade precision for a little more range, down to 2^-24 ≈ 6e-8 in fp16: anything
# smaller rounds to zero.

# %%
print(f"{'':5} {'bits':>4} {'exp':>3} {'mant':>4} {'max':>9} {'min normal':>10} {'min subnormal':>13} {'eps':>8}")
for name, dt, e_bits in (("fp32", torch.float32, 8), ("bf16", torch.bfloat16, 8), ("fp16", torch.float16, 5)):
    fi = torch.finfo(dt)
    m_bits = fi.bits - 1 - e_bits
    subnormal = fi.smallest_normal * fi.eps  # 2^(emin - mantissa bits)
    print(f"{name:5} {fi.bits:>4} {e_bits:>3} {m_bits:>4} {fi.max:>9.2e} {fi.smallest_normal:>10.2e} "
          f"{subnormal:>13.2e} {fi.eps:>8.1e}")

h = torch.tensor([1e-8, 7e4, 1 + 1e-3])
print(f"\n{'stored as':10}{'1e-8':>12}{'7e4':>12}{'1 + 1e-3':>12}")
for dt in (torch.float16, torch.bfloat16):
    print(f"{str(dt)[6:]:10}" + "".join(f"{v:>12.6g}" for v in h.to(dt).float().tolist()))
assert h.half()[0] == 0 and h.half()[1] == math.inf and h.bfloat16()[2] == 1.0
assert torch.finfo(torch.bfloat16).eps == 2**-7
one = torch.ones((), dtype=torch.bfloat16)
assert one + 0.99 * 2**-8 == 1 and one + 1.01 * 2**-8 == 1 + 2**-7  # half the spacing: the rounding edge

# %% [markdown]
# Each format has its own failure: fp16 flushes `1e-8` to zero and overflows `7e4` to inf;
# bf16 holds both but cannot tell `1 + 1e-3` from `1`. The first is the gradient problem
# (§1.3, loss scaling), the second the weight-update problem (§1.5, master weights).
#
# ### 1.2 bf16 autocast on the CPU
#
# `torch.autocast` runs each op in the precision that suits it: matmuls in bf16, numerically
# touchy ops (LayerNorm, softmax, the loss) in fp32. The parameters stay fp32: autocast casts
# weights to bf16 on the fly. The model code does not change.
#
# **Predict first.** Under bf16 autocast, what fraction of the fp32 run's saved activation
# bytes does backward keep: 1/2, more, or less?
#
# <details><summary>Answer</summary>
#
# More than half (about 0.6-0.7 here): only the matmul inputs and outputs become bf16.
# LayerNorm inputs, the residual stream and the loss stay fp32, and autocast also saves the
# bf16 copies of the weights it made for each matmul.
# </details>

# %%
cfg = GPTConfig.tiny(V)
model = GPT(cfg)
x, y = batch(8)
with SavedActivations(model) as saved32:
    logits32, loss32 = model(x, y)
with SavedActivations(model) as saved16, torch.autocast("cpu", dtype=torch.bfloat16):
    logits16, loss16 = model(x, y)
loss16.backward()

by_dtype = {}
for (shape, dt), count in saved16.by_shape().items():
    by_dtype[dt] = by_dtype.get(dt, 0) + count
print(f"logits: {logits16.dtype}, loss: {loss16.dtype}, gradients: {next(model.parameters()).grad.dtype}")
print(f"saved for backward: fp32 {fmt(saved32.bytes)}, autocast {fmt(saved16.bytes)} "
      f"({saved16.bytes / saved32.bytes:.2f}x); saved tensors by dtype: {dict(sorted(by_dtype.items()))}")
assert logits16.dtype == torch.bfloat16 and loss16.dtype == torch.float32
assert next(model.parameters()).grad.dtype == torch.float32  # parameters and gradients stay fp32
# How far can autocast move the loss? Cross-entropy moves by at most twice the largest change of a logit
# (log-sum-exp by at most that change, the target's logit by at most that change), on any CPU; + 1e-5 for
# the fp32 rounding of two means of 512 token losses near 4.6
dlogits = (logits16.float() - logits32.detach()).abs().max().item()
assert abs(loss16.item() - loss32.item()) <= 2 * dlogits + 1e-5
# and the logits move by bf16 rounding only: a logit passes through the matmuls of 2 blocks and the head,
# whose inputs and outputs round by at most 2^-8 relative: to first order, 16 such roundings of the largest
# logit is a generous ceiling
assert dlogits <= 16 * 2**-8 * logits32.abs().max().item() and saved16.bytes < 0.75 * saved32.bytes

# %% tags=["nbval-ignore-output"]
# bf16 kernels differ between CPUs (instruction sets, thread counts): the last digits vary.
print(f"loss fp32 {loss32.item():.4f}  vs  autocast {loss16.item():.4f}; largest logit change {dlogits:.1e} "
      f"({dlogits / logits32.abs().max().item() / 2**-8:.1f} x 2^-8 of the largest logit)")

# %% [markdown]
# The activations shrink, though not to half: LayerNorm inputs, the residual stream and the
# loss stay fp32, and autocast saves the bf16 *copies of the weights* it made for each matmul
# (they count as activations: they exist only for this step). Model state does not shrink at all
# under autocast: fp32 weights, fp32 gradients, fp32 AdamW moments, still 16 B/param. On a GPU the
# big win of bf16 is speed (tensor cores run bf16 matmuls many times faster than fp32). On a CPU
# it depends on the chip: with bf16 matrix instructions (recent Xeons) autocast is faster, without
# them it can be slower than fp32 (`benchmarks/bench_memory.py` measures your machine).
#
# ### 1.3 fp16 gradients underflow; loss scaling lifts them
#
# Our tiny, freshly initialised model has large gradients. Large models, later in training,
# have many gradient values far smaller, below fp16's 2^-24 (Micikevicius et al. 2018,
# "Mixed Precision Training", plot such a histogram). We emulate that regime honestly by
# multiplying the loss by $c = 2^{-20}$: by the chain rule every gradient is multiplied by $c$
# too. Then we run backward with the model in fp16 and the loss multiplied by a **scale S**,
# divide the gradients by S in fp32, and compare with the fp32 gradients of the same loss.
#
# **Predict first.** We try S = 2^0, 2^4, ..., 2^44. Which scales give the fp32 gradients
# back (to fp16 precision), and what goes wrong at either end?
#
# <details><summary>Answer</summary>
#
# Too small a scale leaves the gradients below fp16's smallest subnormal (2^-24): they flush to
# zero. Too large a scale overflows the largest ones past 65504: inf, then nan. In between
# there is a wide window (here roughly 2^20 to 2^36) where the scaled gradients fit.
# </details>
#
# (fp16 arithmetic on a CPU runs different kernels on different processors, so the printed
# fractions may differ in their last digits from one machine to another; the asserts hold.)

# %% tags=["nbval-ignore-output"]
c = 2.0**-20
x4, y4 = batch(4)


def grads_with_scale(dtype, S):
    m = GPT(cfg).to(dtype)
    (loss_fp32(m, x4, y4) * (c * S)).backward()
    return torch.cat([p.grad.float().flatten() / S for p in m.parameters()])


ref = grads_with_scale(torch.float32, 1.0)
nonzero = ref != 0
print(f"fp32 gradients below 2^-24: {(ref.abs() < 2**-24).float().mean():.1%}")
sweep = {}
for e in range(0, 45, 4):
    g = grads_with_scale(torch.float16, 2.0**e)
    finite = bool(torch.isfinite(g).all())
    zero = ((g == 0) & nonzero).sum().item() / nonzero.sum().item()
    err = ((g - ref).norm() / ref.norm()).item() if finite else math.nan
    sweep[e] = (zero, finite, err)
    print(f"S = 2^{e:<2}  flushed to zero {zero:7.2%}   "
          + (f"relative error {err:.1e}" if finite else "inf/nan in the gradients: step must be skipped"))
assert sweep[0][0] > 0.99  # unscaled: every gradient underflows
# scaled: the fp32 result to fp16 precision. Each gradient passes through fp16 roundings of at most
# 2^-11 ≈ 4.9e-4 relative, which largely average out in the norm: 5e-3 allows ten of them
assert sweep[24][0] < 1e-3 and sweep[24][2] < 5e-3
assert not sweep[44][1]  # too large a scale overflows

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
ax1.hist(torch.log2(ref[nonzero].abs()).numpy(), bins=80, color="tab:blue", alpha=0.7, label="gradients (fp32)")
ax1.hist(torch.log2(ref[nonzero].abs()).numpy() + 20, bins=80, color="tab:green", alpha=0.5, label="× S = 2^20")
for v, lab in ((-24, "fp16 smallest subnormal"), (-14, "fp16 smallest normal"), (16, "fp16 max")):
    ax1.axvline(v, color="k", ls="--", lw=0.8)
    ax1.text(v + 0.5, ax1.get_ylim()[1] * 0.9, lab, rotation=90, va="top", fontsize=8)
ax1.set_xlabel("log2 |gradient|")
ax1.set_ylabel("count")
ax1.set_xlim(-50, 20)
ax1.legend(loc="upper left", fontsize=8)
ax1.set_title("scaling shifts the histogram into fp16's range")
es = list(sweep)
ax2.semilogy(es, [max(sweep[e][0], 1e-6) for e in es], "o-", label="fraction flushed to zero")
ax2.semilogy(es, [sweep[e][2] for e in es], "s-", label="relative error vs fp32")
ax2.axvspan(min(e for e in es if not sweep[e][1]) - 2, max(es) + 2, color="red", alpha=0.15, label="overflow (inf)")
ax2.set_xlabel("log2 S")
ax2.legend(fontsize=8)
ax2.set_title("too small: underflow; too large: overflow")
plt.tight_layout()
plt.show()

# %% [markdown]
# The window of good scales is wide (here about 2^20 to 2^36) but its position depends on the
# model and moves during training. Hence a **dynamic** scale: start high, halve whenever the
# gradients overflow (and skip that step: its gradients are garbage), and try doubling again
# after `growth_interval` steps without overflow:
#
# ```
# overflow (inf/nan):  S ← S × backoff_factor (0.5),  skip the optimizer step,  good_steps ← 0
# otherwise:           step;  good_steps += 1;  if good_steps == growth_interval: S ← S × growth_factor (2), good_steps ← 0
# ```
#
# ### 1.4 `DynamicLossScaler` against `torch.amp.GradScaler`
#
# `course_lib.techniques.amp.DynamicLossScaler` is that rule in a few lines. PyTorch's `GradScaler` runs
# the same rule (on the CPU too, since torch 2.3). We feed both the same sequence of gradients
# with infs and a nan injected at chosen steps; they must pick the same scales and skip the same
# steps.

# %%
flags = [False] * 7 + [True] + [False] * 4 + ["nan", True] + [False] * 10 + [True] + [False] * 4
GROWTH = 4


def fake_grad(scale, flag):
    g = torch.full((8,), 1e-3) * scale  # the gradient backward would produce for a scaled loss
    if flag:
        g[3] = math.nan if flag == "nan" else math.inf
    return g


mine = DynamicLossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=GROWTH)
p = torch.nn.Parameter(torch.zeros(8))
opt = torch.optim.SGD([p], lr=1.0)
for flag in flags:
    p.grad = fake_grad(mine.scale, flag)
    mine.step(opt)
mine_scales = [s for s, _ in mine.history]
mine_skips = [skipped for _, skipped in mine.history]

try:
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=GROWTH)
except (AttributeError, TypeError, RuntimeError) as exc:
    gs = None
    print(f"skipped the comparison: this torch ({torch.__version__}) has no CPU GradScaler ({exc})")
if gs is not None:
    q = torch.nn.Parameter(torch.zeros(8))
    opt_q = torch.optim.SGD([q], lr=1.0)
    ref_scales, ref_skips = [], []
    for flag in flags:
        gs.scale(torch.ones(()))  # GradScaler creates its scale tensor on first use
        ref_scales.append(gs.get_scale())
        before = q.detach().clone()
        q.grad = fake_grad(gs.get_scale(), flag)
        gs.step(opt_q)
        gs.update()
        ref_skips.append(torch.equal(before, q.detach()))
    assert mine_scales == ref_scales and mine_skips == ref_skips and torch.equal(p, q)
    print(f"{len(flags)} steps: same scale at every step, same {sum(ref_skips)} skipped steps, same parameters")
print("log2 scale:", [int(math.log2(s)) for s in mine_scales])
print("skipped:   ", [i for i, s in enumerate(mine_skips) if s])

# %% [markdown]
# ### 1.5 fp32 master weights
#
# bf16 has 8 significant bits: next to a weight of 1.0 the representable numbers are 2^-7
# apart, so with rounding to nearest any update smaller than 2^-8 ≈ 0.0039 of the weight
# rounds away (§1.1). Learning rates times normalised gradients are often that small, so a model whose
# weights *live* in bf16 stops learning in exactly the parameters that need fine adjustment. The
# cure: keep an fp32 **master copy** for the optimizer, and use the 16-bit weights only for
# forward and backward.
#
# **Predict first.** A weight of 1.0 receives 100 updates of $+10^{-3}$, once stored in bf16
# and once in fp32. What does each end at?
#
# <details><summary>Answer</summary>
#
# The bf16 weight stays at exactly 1.0: each update is below $2^{-8} \approx 0.0039$, so every
# single sum rounds back to 1.0, and the hundred updates never accumulate. The fp32 weight ends
# at 1.1, up to fp32 rounding.
# </details>

# %%
w16, w32 = torch.ones((), dtype=torch.bfloat16), torch.ones(())
for _ in range(100):
    w16 += 1e-3
    w32 += 1e-3
print(f"100 updates of +1e-3:  bf16 weight {w16.item():.4f}   fp32 master {w32.item():.4f}")
assert w16.item() == 1.0 and abs(w32.item() - 1.1) < 1e-4  # 100 fp32 roundings of at most 2^-24 x 1.1 each

# %% [markdown]
# `course_lib.techniques.amp.MixedPrecisionOptimizer` does the bookkeeping: the model's parameters become
# fp16/bf16; an fp32 copy of the model is what AdamW updates. Each step: gradients → fp32,
# divide by the loss scale (if any), skip on inf/nan, AdamW on the master, copy the master back
# into the 16-bit model. Thirty steps of real training in three recipes, and, as a yardstick for
# "trains as well as fp32", the fp32 recipe again from three other initialisation seeds. The
# printed losses come from 16-bit kernels that differ between processors, so they vary from
# machine to machine; what the cell asserts (every recipe ends closer to fp32 than fp32 runs
# from different seeds end from each other, and the fp16 scaler hit the overflow edge at least
# once) holds on any of them.

# %% tags=["nbval-ignore-output"]
tc = TrainConfig(lr=3e-3)


def train_30(model, dtype=None):
    """30 AdamW steps on the same batches, clipped at 1.0: (losses, fp16 loss scaler or None).
    dtype None trains the fp32 model as it is; bf16 or fp16 keep fp32 master weights."""
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=3) if dtype == torch.float16 else None
    if dtype is None:
        opt = make_optimizer(model, tc)
    else:
        mp = MixedPrecisionOptimizer(model, lambda master: make_optimizer(master, tc), dtype, loss_scaler=scaler)
    gen, losses = torch.Generator().manual_seed(1), []
    for step in range(30):
        xb, yb = get_batch(train_data, 8, gen)
        loss = loss_fp32(model, xb, yb)
        if dtype is None:
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            mp.backward(loss)
            mp.step(grad_clip=1.0)
        losses.append(loss.item())
    return losses, scaler


def last10(losses):
    return sum(losses[-10:]) / 10


recipes = {"fp32": None, "bf16 + fp32 master": torch.bfloat16, "fp16 + fp32 master + loss scaling": torch.float16}
mp_runs = {name: train_30(GPT(cfg), dtype) for name, dtype in recipes.items()}
curves = {name: r[0] for name, r in mp_runs.items()}
scales = mp_runs["fp16 + fp32 master + loss scaling"][1].history
seed_tails = [last10(curves["fp32"])] + [last10(train_30(GPT(cfg, seed=seed))[0]) for seed in (1, 2, 3)]
spread = max(seed_tails) - min(seed_tails)  # GPT(cfg) is seed 0
last = {name: last10(v) for name, v in curves.items()}
for name, v in last.items():
    print(f"{name:34} loss {curves[name][0]:.2f} -> {v:.3f} (mean of the last 10 steps)")
print(f"fp32 from initialisation seeds 0-3: {', '.join(f'{v:.3f}' for v in seed_tails)}: spread {spread:.3f}")
print("fp16 loss scale, log2 per step:", [int(math.log2(s)) for s, _ in scales])
# The yardstick is measured, not a fixed number: 16-bit rounding (2^-8 relative in bf16, 2^-11 in fp16)
# nudges every step and 30 steps of a tiny model amplify it, so how far a recipe ends from fp32 depends on
# the CPU's kernels and threads (+0.02 to +0.06 on the CPUs tried), while the seeds' spread (0.137 on
# each of them) has no 16-bit arithmetic in it. The spread must itself be real and small: above 0.05
# (the seeds do differ) and below a quarter of what the 30 steps lower the loss (~1.4).
fall = curves["fp32"][0] - last["fp32"]
assert fall > 1.0 and 0.05 < spread < fall / 4, (seed_tails, fall)
assert all(abs(v - last["fp32"]) < spread for v in last.values()), (last, spread)  # "trains as well as fp32"
assert any(skipped for _, skipped in scales)  # the scaler found the overflow edge and backed off

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
for name, v in curves.items():
    ax1.plot(range(1, 31), v, label=name)
ax1.set_xlabel("step")
ax1.set_ylabel("train loss")
ax1.legend(fontsize=8)
ax1.set_title("same training, three precisions")
ax2.step(range(len(scales)), [math.log2(s) for s, _ in scales], where="post", label="log2 S")
sk = [i for i, (_, s) in enumerate(scales) if s]
ax2.plot(sk, [math.log2(scales[i][0]) for i in sk], "rx", ms=9, label="overflow: step skipped")
ax2.set_xlabel("step")
ax2.set_ylabel("log2 loss scale")
ax2.legend(fontsize=8)
ax2.set_title("fp16: the dynamic loss scale (growth_interval = 3)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### 1.6 Bytes per parameter, measured
#
# Mixed precision does **not** shrink the model state: the 16-bit weights and gradients (2 + 2
# bytes) come with the fp32 master copy and Adam's two fp32 moments (4 + 4 + 4 = 12 bytes, the
# ZeRO paper's K = 12, counting the master copy as optimizer state). Keeping an fp32 buffer to
# accumulate gradients over micro-batches adds 4 more. We build each recipe for real and count
# every byte (`course_lib.observe.memory.measured_state_bytes`, with gradients present, as at the peak of
# a step) against notebook 01's `estimate.model_state_bytes`.

# %%
small = GPTConfig.tiny(V, n_layer=1)
xs, ys = batch(2, seq=16)
P = GPT(small).num_params()
print(f"{P:,} parameters")
for recipe in ("fp32", "bf16_mixed", "fp16_mixed", "bf16_fp32_accum"):
    m = GPT(small)
    if recipe == "fp32":
        opt = torch.optim.AdamW(m.parameters())
        m(xs, ys)[1].backward()
        opt.step()
        m(xs, ys)[1].backward()
        measured = measured_state_bytes(m, opt)
    else:
        dtype = torch.float16 if recipe == "fp16_mixed" else torch.bfloat16
        scaler = DynamicLossScaler(init_scale=1024.0) if recipe == "fp16_mixed" else None
        mp = MixedPrecisionOptimizer(m, lambda master: torch.optim.AdamW(master.parameters()), dtype,
                                     loss_scaler=scaler, fp32_grad_accum=recipe == "bf16_fp32_accum")
        mp.backward(loss_fp32(m, xs, ys))
        mp.step()
        mp.backward(loss_fp32(m, xs, ys))
        measured = measured_state_bytes(m, mp)
        buffers = sum(g.untyped_storage().nbytes() for g in mp.fp32_grads)  # fp32 accumulation buffers
        measured["grads"] += buffers
        measured["total"] += buffers
    predicted = estimate.model_state_bytes(P, recipe)
    assert measured == predicted, (recipe, measured, predicted)
    print(f"{recipe:16} params {measured['params'] / P:.0f} + grads {measured['grads'] / P:.0f} + optimizer "
          f"{measured['optimizer'] / P:>2.0f} = {measured['total'] / P:.0f} B/param  (formula: {predicted['total'] / P:.0f})")

# %% [markdown]
# So what does mixed precision buy in memory? Activations (§1.2), and it makes ZeRO's sharding
# pay off: of the 16 bytes, the 12 bytes of optimizer state are exactly what ZeRO-1 splits
# across data-parallel ranks (notebook 01).

# %% [markdown]
# ### 1.7 Eight bits: FP8 and MX
#
# GPUs since the H100 multiply 8-bit floats at twice their bf16 rate, and large runs now train
# their matmuls in FP8 (DeepSeek-AI 2024, for DeepSeek-V3). Eight bits leave two sensible splits
# (Micikevicius et al. 2022, *FP8 Formats for Deep Learning*, standardised by the OCP 8-bit
# floating point specification): **e4m3**, 4 exponent and 3 mantissa bits, and **e5m2**, the
# range of fp16 with 2 mantissa bits. The first FP8 recipes, with one scale per tensor, used e4m3
# for weights and activations and e5m2 for gradients (the "hybrid" split); the recipes with finer
# scales below use e4m3 for every tensor (§1.8). e4m3 (the specification's E4M3, torch's
# `float8_e4m3fn`: *fn* for finite) has no infinities and only two NaN encodings, S.1111.111 with
# either sign, which frees the other patterns of the top exponent to reach 448 instead of 240;
# e5m2 keeps IEEE's infinities and NaNs (OCP 8-bit floating point specification, 2023, Table 2).
# We read each format off its bit patterns.

# %%
from course_lib.techniques.fp8 import FP8Linear, all_gather_fp8, apply_fp8, dequantize, quantize
from course_lib.techniques.fp8_figures import (format_gpu_table, format_values, gpu_measurement, number_lines,
                                              outlier_errors, plot_outlier_errors)
from course_lib import CommTracer, run_on_ranks
from course_lib.comm.compat import all_gather_single

print(f"{'':5} {'max':>8} {'min normal':>11} {'min subnormal':>14} {'values > 0':>11} {'spacing at 1':>13}")
for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
    vals, fi = format_values(name), torch.finfo(dt)
    above_one = vals[vals > 1][0].item() - 1
    print(f"{name:5} {vals[-1].item():>8g} {fi.smallest_normal:>11.3g} {vals[1].item():>14.3g} {len(vals) - 1:>11} {above_one:>13g}")
assert format_values("e4m3")[-1] == 448 and format_values("e5m2")[-1] == 57344  # 1.75 * 2^8, 1.75 * 2^15
assert format_values("e4m3")[1] == 2**-9 and format_values("e5m2")[1] == 2**-16  # smallest subnormals
every = {name: torch.arange(256, dtype=torch.uint8).view(dt).float() for name, dt in
         (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))}  # all 256 bit patterns
nan_e4m3 = [f"{i:08b}" for i in range(256) if every["e4m3"][i].isnan()]
print(f"e4m3: NaN bit patterns {nan_e4m3}, {int(every['e4m3'].isinf().sum())} infinities;  "
      f"e5m2: {int(every['e5m2'].isnan().sum())} NaN patterns, {int(every['e5m2'].isinf().sum())} infinities")
assert nan_e4m3 == ["01111111", "11111111"] and not every["e4m3"].isinf().any()  # S.1111.111, either sign
assert every["e5m2"].isnan().sum() == 6 and every["e5m2"].isinf().sum() == 2  # S.11111.{01,10,11}, S.11111.00

big = torch.tensor([[500.0, 1e5]])
print(f"\ntorch's plain casts of {big[0].tolist()}: e4m3 -> {big.to(torch.float8_e4m3fn).float()[0].tolist()}, "
      f"e5m2 -> {big.to(torch.float8_e5m2).float()[0].tolist()}")
sat = {f: dequantize(*quantize(big, f, "tensor", scales=torch.ones(1, 1)), "tensor")[0].tolist() for f in ("e4m3", "e5m2")}
print(f"saturating casts (scale 1):          e4m3 -> {sat['e4m3']}, e5m2 -> {sat['e5m2']}")
assert sat == {"e4m3": [448.0, 448.0], "e5m2": [512.0, 57344.0]}  # 500 rounds to 512 in e5m2 (spacing 64 there)

# %%
number_lines()
plt.show()

# %% [markdown]
# Eight ticks per power of two in e4m3, four in e5m2: next to 1 the numbers are 2^-3 and 2^-2
# apart, so rounding costs up to 2^-4 ≈ 6 % (e4m3) of a value, against bf16's 2^-8. And the range
# is short: e4m3 spans 2^-9 to 448, about 18 powers of two. A tensor must be **scaled** into it:
#
# $$s = \frac{\text{amax}}{448}, \qquad q = \text{round}\big(\text{clamp}(x/s, -448, 448)\big), \qquad x \approx q\,s$$
#
# The clamp is the specification's saturating mode (torch's plain cast above overflowed e5m2 to
# inf). Which elements share one scale is the **granularity**
# (`course_lib.techniques.fp8.quantize(x, fmt, granularity)`):
#
# | granularity | one scale per | used by |
# |---|---|---|
# | `tensor` | the whole tensor | the first FP8 recipes (Micikevicius et al. 2022) |
# | `row` | row (a token, or an output channel of a weight) | torchao's row-wise recipe |
# | `tile128` | 1×128 tile of a row | DeepSeek-V3's activations and gradients |
# | `block128` | 128×128 block | DeepSeek-V3's weights |
# | `mx32` | 32 consecutive elements, a power of two in 8 bits (e8m0) | the OCP MX formats (MXFP8), Blackwell GPUs |
#
# **Predict first.** Take real activations (the GELU outputs entering the MLP's second matmul,
# 512 tokens × 256 channels) and make one *channel* 10^4 times larger, the kind of outlier feature
# large language models develop (Dettmers et al. 2022). Rank the five granularities by the error
# they leave on the other, ordinary entries. Then make one *token* 10^4 times larger instead.
#
# <details><summary>Answer</summary>
#
# Channel outlier: `tensor` is worst, since the outlier sets the one scale and pushes small entries
# into the subnormals or to zero; `block128` next (its blocks hold the channel). `row` helps
# partly (each row's scale comes from its own outlier entry, large or small), `tile128` more (half
# of every row is in a tile without the channel), and `mx32` hardly notices (7 blocks of 8 never
# see the channel). Token outlier: `row`, `tile128` and `mx32` are untouched (the token's own
# scales absorb it); `tensor` and `block128` suffer.
# </details>

# %% tags=["nbval-ignore-output"]
# real activations; the printed errors depend on fp32 matmul rounding, which differs between CPUs
grab = {}
probe = GPT(cfg)
hook = probe.blocks[0].mlp.proj.register_forward_hook(lambda mod, inp, out: grab.update(a=inp[0].detach().flatten(0, 1)))
probe(*batch(8))
hook.remove()
acts = grab["a"]
chan_x, tok_x = acts.clone(), acts.clone()
chan_x[:, 5] *= 1e4
tok_x[7] *= 1e4
chan_mask, tok_mask = torch.ones_like(acts, dtype=torch.bool), torch.ones_like(acts, dtype=torch.bool)
chan_mask[:, 5], tok_mask[7] = False, False
outlier_rows = {"no outlier": outlier_errors(acts, torch.ones_like(chan_mask)),
                "channel x 1e4": outlier_errors(chan_x, chan_mask), "token x 1e4": outlier_errors(tok_x, tok_mask)}
print(f"{'granularity':12}" + "".join(f"{k:>28}" for k in outlier_rows))
for g in outlier_rows["no outlier"]:
    print(f"{g:12}" + "".join(f"{r[g][0]:>10.3f} ({r[g][1]:6.1%} to 0)" for r in outlier_rows.values()))
clean, ch, tk = (outlier_rows[k] for k in outlier_rows)
# e4m3 rounds by at most 2^-4 = 0.0625 in its normal range: ~0.02-0.03 on average without an outlier
assert all(v[0] < 0.04 for v in clean.values())
assert ch["tensor"][0] > 2 * ch["mx32"][0] and ch["tensor"][0] == max(v[0] for v in ch.values())
assert all(tk[g][0] < 1.1 * clean[g][0] for g in ("row", "tile128", "mx32"))  # the token's own scales absorb it
assert tk["tensor"][0] > 1.5 * clean["tensor"][0]

# %%
plot_outlier_errors(outlier_rows)
plt.show()

# %% [markdown]
# A coarse scale does not make large values wrong; it makes small ones vanish. Finer groups
# cost more scales (one fp32 number per 128 elements for tiles, one byte per 32 for MX) and,
# on a GPU, matmul kernels that apply them along the inner dimension.
#
# ### 1.8 Training the course GPT with FP8 matmuls
#
# `FP8Linear` is a drop-in `nn.Linear` (same parameters): forward multiplies e4m3 copies of the
# input and the weight; backward multiplies an FP8 copy of the output gradient by the e4m3
# copies forward saved; products accumulate in fp32. The gradient's format is the recipe's: e5m2
# in the per-tensor recipes (`tensorwise`, `rowwise`, `delayed`), whose one scale per tensor or
# row must span a gradient's whole range; e4m3 in the fine-grained ones (`blockwise`, `mxfp8`),
# whose small groups supply the range, as in DeepSeek-V3 (DeepSeek-AI 2024, §3.3.2) and as
# NVIDIA's Transformer Engine does by default for its block-scaled and MXFP8 recipes.
#
# One subtlety: a scaled matmul wants its scales to run along the dimension it sums over, and
# backward sums over other dimensions than forward (dX = dY·W over the output features, dW =
# dYᵀ·X over the tokens). Scales along rows (`row`, `tile128`, `mx32`) must then be remade.
# `FP8Linear` does what the kernels do: it dequantizes the e4m3 copies forward saved, transposes
# them and quantizes them again along the other dimension (DeepSeek-V3 turns its 1×128 activation
# tiles into 128×1 tiles this way, §3.5.2), and quantizes the output gradient both ways. A
# per-tensor scale, or a square 128×128 block, is the same group either way round.
# `apply_fp8(model, recipe)` swaps every linear layer except the output head, which stays in
# higher precision, as in DeepSeek-V3.
# **On this CPU the matmuls run in fp32 on the exact dequantized values**: the numerics are those
# of FP8 training, the speed is not (that needs FP8 hardware, §1.9). The fp32 master weights and
# AdamW are unchanged.
#
# **Predict first.** Same 30 steps and batches as §1.5. The FP8 runs round every matmul input
# by up to 2^-4, sixteen times bf16's 2^-8. Do they still train, and how far from the fp32 and
# bf16 curves do they end? Is FP8's effect larger or smaller than §1.5's yardstick, a change of
# initialisation seed?
#
# <details><summary>Answer</summary>
#
# They train, and end closer to fp32 and bf16 than fp32 runs from different seeds end from each
# other: FP8's rounding moves the mean loss of the last 10 steps less than the luck of the
# initial weights does. Rounding errors of up to 6 % per element largely average out in sums of
# 64 to 256 products. How far exactly varies from CPU to CPU (30 steps of a tiny model amplify
# every rounding difference), so the cell prints this machine's numbers and asserts the yardstick.
# </details>

# %% tags=["nbval-ignore-output"]
# FP8 numerics are exact arithmetic, but the fp32 matmuls and AdamW's steps round differently on
# each CPU, so the printed losses vary from machine to machine; the asserts hold on any of them.
fp8_curves = {recipe: train_30(apply_fp8(GPT(cfg), recipe))[0] for recipe in ("tensorwise", "rowwise", "mxfp8")}
tail = {k: last10(v) for k, v in {**curves, **{f"FP8 {k}": v for k, v in fp8_curves.items()}}.items()}
for name, v in tail.items():
    print(f"{name:34} mean loss of the last 10 steps {v:.3f}")
print(f"the yardstick, §1.5: fp32 from initialisation seeds 0-3 ends {spread:.3f} apart")
# FP8 moves the curve less than a new initialisation seed does, measured with §1.5's yardstick (the
# seeds' spread, checked there to be real and small). Not a fixed number: FP8's distance from fp32
# depends on the CPU's kernels and threads (+0.02 to +0.11 on the CPUs tried), the seeds' spread not.
for k in fp8_curves:
    for ref in ("fp32", "bf16 + fp32 master"):
        assert abs(tail[f"FP8 {k}"] - tail[ref]) < spread, (k, ref, tail, spread)

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
for name in ("fp32", "bf16 + fp32 master"):
    ax.plot(range(1, 31), curves[name], label=name, lw=2, alpha=0.6)
for name, v in fp8_curves.items():
    ax.plot(range(1, 31), v, label=f"FP8 {name}", lw=1)
ax.set_xlabel("step")
ax.set_ylabel("train loss")
ax.set_title("the same 30 steps with FP8 matmuls")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The tiny GPT's layers are 64 wide, too narrow for 128-element tiles; a recipe that needs them is
# refused, naming the layer and the rule:

# %%
try:
    apply_fp8(GPT(cfg), "blockwise")
except ValueError as err:
    print(f"ValueError: {err}")
else:
    raise AssertionError("a 64-wide layer was given 128-element tiles")

# %% [markdown]
# **What FP8 stores.** The model state does not change: the optimizer still updates fp32 master
# weights, so notebook 01's estimator gives the `fp8` recipe bf16's 2 + 2 + 12 = 16 B/param.
# (DeepSeek-V3 too keeps its master weights, and the gradients it accumulates, in fp32, but
# stores AdamW's two moments in bf16, DeepSeek-AI 2024, §3.3.3: 4 bytes per parameter less than
# this recipe's fp32 moments, a saving independent of FP8.) What shrinks is
# what forward saves for backward: each FP8 linear saves its input in e4m3, 1 byte instead of 4,
# plus an e4m3 copy of its weight (1 B/param) and two scales. LayerNorm, GELU, attention and the
# loss save what they saved before. So, per layer, with n tokens, width d and MLP width f
# (the four linears' inputs: qkv, attention output, MLP input, GELU output):
#
# $$\text{saved}_\text{FP8} = \text{saved}_\text{fp32} - 3\,(3nd + nf)\,L + (4d^2 + 2df)\,L + 2 \cdot 4 \cdot 4L \text{ bytes}$$
#
# **Predict first.** How much of the fp32 run's saved activations does the FP8 model keep here?
#
# <details><summary>Answer</summary>
#
# About three quarters: only the matmul inputs shrink (to a quarter), and the attention scores,
# LayerNorm and GELU inputs, which dominate this small model, stay fp32.
# </details>

# %%
xm, ym = batch(8)
n_tok, d, f_w, L = 8 * 64, cfg.d_model, cfg.ff_dim, cfg.n_layer
m32, m8 = GPT(cfg), apply_fp8(GPT(cfg), "tensorwise")
with SavedActivations(m32) as saved32:
    m32(xm, ym)
with SavedActivations(m8) as saved8:
    m8(xm, ym)
predicted8 = saved32.bytes - 3 * (3 * n_tok * d + n_tok * f_w) * L + (4 * d * d + 2 * d * f_w) * L + 2 * 4 * 4 * L
assert saved32.bytes == estimate.activation_bytes(cfg, 8, 64)["total"] + 4 and saved8.bytes == predicted8
print(f"saved for backward: fp32 {fmt(saved32.bytes)}, FP8 linears {fmt(saved8.bytes)} "
      f"({saved8.bytes / saved32.bytes:.2f}x, = the formula)")
P_tiny = GPT(cfg).num_params()
state8, state16 = estimate.model_state_bytes(P_tiny, "fp8"), estimate.model_state_bytes(P_tiny, "bf16_mixed")
assert state8 == state16
print(f"model state, estimator's fp8 recipe: {state8['total'] / P_tiny:.0f} B/param (as bf16_mixed): "
      f"{estimate.RECIPES['fp8'].description}")

# %% [markdown]
# **What FP8 sends.** ZeRO-3 and FSDP (notebook 08) all-gather every parameter before using it. A
# run whose matmuls take FP8 weights anyway can gather them in FP8. The course shows the simplest
# design: each rank quantizes its shard with its own scale, the ranks gather the bytes and the
# scales, and every rank dequantizes each shard with the scale that came with it. Per all-gather
# each rank receives N·S/N = S bytes of FP8 against 2S of bf16, plus N scales. (torchao's float8
# all-gather for FSDP2 does it the other way round: after each optimizer step one all-reduce of
# every parameter's local amaxes, for all parameters at once, gives each parameter one
# tensor-wise scale that every rank shares, `precompute_float8_dynamic_scale_for_fsdp`; then only
# the FP8 bytes travel, and the gathered tensor has a single scale, as a per-tensor matmul wants.)
# `all_gather_fp8` does the course's version on two ranks; the tracer counts the bytes.

# %%
def gather_both(full):
    rank, n = torch.distributed.get_rank(), torch.distributed.get_world_size()  # two gloo ranks
    shard = full.chunk(n)[rank].clone()
    with CommTracer() as t8:
        got8, _ = all_gather_fp8(shard, fmt="e4m3", granularity="tensor")
    with CommTracer() as t16:
        got16 = torch.empty(full.numel(), dtype=torch.bfloat16)
        all_gather_single(got16, shard.to(torch.bfloat16))
    received = lambda t: sum(v["bytes_recv"] for v in t.summary().values())  # noqa: E731
    return received(t8), received(t16), (got8 - got16.float()).abs().max().item()


weights = torch.randn(P_tiny - P_tiny % 2, generator=torch.Generator().manual_seed(0)) * 0.02
for rank, (b8, b16, err) in enumerate(run_on_ranks(gather_both, weights, world_size=2)):
    assert b16 == 2 * weights.numel() and b8 == weights.numel() + 2 * 4  # FP8: half, plus one fp32 scale per rank
    assert err <= (2**-4 + 2**-8) * weights.abs().max().item()  # e4m3 and bf16 rounding of the largest weight
    print(f"rank {rank}: received bf16 {fmt(b16)}, FP8 {fmt(b8)} ({b8 / b16:.4f}x); every value within e4m3's rounding")

# %% [markdown]
# **Inside ZeRO-3.** Notebook 08's FSDP takes the same option: `apply_zero(model, 3, ...,
# gather_dtype="fp8")` quantizes each rank's fp32 shard of every unit before each all-gather and
# sends the scale's 4 bytes in the same message, so a gather of a unit padded to N·S elements
# brings N(S + 4) bytes instead of bf16's 2NS. Backward's reduce-scatter keeps the bf16
# gradients, and the optimizer still updates fp32 shards.
#
# **Predict first.** One forward and backward of the tiny GPT on two ranks gathers the root once
# and each block twice (forward, backward). What fraction of the bf16 run's all-gather bytes does
# the FP8 run receive?
#
# <details><summary>Answer</summary>
#
# Just over a half: half of the elements' bytes, plus 4 bytes of scale per rank per gather, a
# few dozen bytes against tens of kilobytes here.
# </details>

# %%
from course_lib.parallel.zero import apply_zero
from course_lib.parallel.zero.fp8_gather import gather_bytes


def zero3_gathers(cfg, x, y):
    """Rank code: one forward and backward under ZeRO-3 with bf16 compute, parameters gathered in
    bf16, then in FP8; the all-gather bytes this rank received, as the tracer counts them."""
    out = {}
    for g in ("bf16", "fp8"):
        model, _ = apply_zero(GPT(cfg, seed=0), 3, torch.optim.AdamW, lr=1e-3, compute_dtype=torch.bfloat16,
                              gather_dtype=None if g == "bf16" else g)
        with CommTracer() as tracer:
            model(x, y)[1].backward()
        out[g] = sum(v["bytes_recv"] for op, v in tracer.summary().items() if op.startswith("all_gather"))
    return out


units = [P_tiny - sum(p.numel() for p in GPT(cfg).blocks.parameters())] + \
        [sum(p.numel() for p in b.parameters()) for b in GPT(cfg).blocks]
padded = [-(-u // 2) * 2 for u in units]  # N * ceil(P_u / N), N = 2 ranks
gathers = [(padded[0], 1)] + [(u, 2) for u in padded[1:]]  # root once, blocks twice
want = {g: sum(k * gather_bytes(u, 2, g, 2) for u, k in gathers) for g in ("bf16", "fp8")}  # bf16: 2 B each
for rank, got in enumerate(run_on_ranks(zero3_gathers, cfg, *batch(4), world_size=2)):
    assert got == want
print(f"one forward and backward under ZeRO-3, all-gathers a rank receives: bf16 {fmt(want['bf16'])}, FP8 {fmt(want['fp8'])} "
      f"({want['fp8'] / want['bf16']:.4f}x) = N(S + 4) per gather, the formula, on both ranks")

# %% [markdown]
# **At scale, in the estimator.** The `fp8` recipe keeps bf16_mixed's model state; its
# activations are the formula above (`activation_bytes(..., fp8_linears=True)`); the step-time
# model runs the blocks' linear matmuls at the GPU's FP8 rate (75% of NVIDIA's 1,979 TFLOP/s
# dense for an H100, against 75% of 989 for bf16) and, with `gather_dtype="fp8"`, ZeRO-3's
# all-gathers at one byte per parameter. GPT-3 175B on 64 H100s, ZeRO-3, one 2,048-token
# sequence per GPU:

# %%
from course_lib.dims import ParallelDims
from course_lib.estimate.clusters import gpu_cluster
from course_lib.estimate.step_time import step_time
from course_lib.estimate.traffic import step_traffic

gpt3, h100, zero3 = estimate.PRESETS["GPT-3 175B"], gpu_cluster("H100 SXM 80 GB", 64), ParallelDims(dp=64, zero=3)
rows = {}
for label, recipe, gather in (("bf16_mixed", "bf16_mixed", None), ("fp8", "fp8", None), ("fp8 + FP8 gather", "fp8", "fp8")):
    state = estimate.model_state_bytes(estimate.param_count(gpt3), recipe, 3, 64)["total"]
    act = estimate.activation_bytes(gpt3, 1, 2048, 2, fp8_linears=recipe == "fp8")["per_layer"]
    t = step_time(gpt3, zero3, h100, 64, 2048, recipe=recipe, gather_dtype=gather)
    local = estimate.per_gpu_memory(gpt3, 1, 2048, recipe, 3, 64)["params_on_gpu"]
    dp = step_traffic(gpt3, zero3, 64, 2048, 2, 2, 1 if gather else 2, local)["dp"]
    gathered = sum(r.calls * r.nbytes for r in dp if r.op == "all_gather")
    rows[label] = (state, act, gathered, t["compute"], t["dp_total"])
    print(f"{label:17} state/GPU {fmt(state):>10}  saved per layer {fmt(act):>10}  all-gathered/step "
          f"{fmt(gathered):>10}  compute {t['compute']:6.2f} s  ZeRO-3 traffic {t['dp_total']:6.2f} s")
assert rows["fp8"][0] == rows["bf16_mixed"][0] and rows["fp8 + FP8 gather"][2] == rows["fp8"][2] / 2
d_, f_ = gpt3.d_model, gpt3.ff_dim
assert rows["bf16_mixed"][1] - rows["fp8"][1] == (3 * 2048 * d_ + 2048 * f_) - (4 * d_ * d_ + 2 * d_ * f_) - 32
even = (4 * d_ * d_ + 2 * d_ * f_ + 32) / (3 * d_ + f_)  # tokens per micro-batch where the two terms cancel
print(f"FP8 saves (e - 1)(3d + f) = {3 * d_ + f_:,} bytes per token per layer and adds 4d^2 + 2df + 32 = "
      f"{fmt(4 * d_ * d_ + 2 * d_ * f_ + 32)} of weight copies: it saves memory past {even:,.0f} tokens per micro-batch")

# %% [markdown]
# The compute term falls by less than half (attention's score matmuls and the head stay bf16),
# and the traffic by a third, not a half: the reduce-scatter of the gradients still carries
# bf16. Whether the saved activations fall depends on the tokens per micro-batch: each FP8 linear
# keeps an e4m3 copy of its weight until backward (4d² + 2df bytes per layer, divided by tp under
# tensor parallelism), which a single sequence's inputs do not pay back. (An implementation can
# quantize the weight again in backward instead of keeping the copy, as ZeRO-3 gathers it again.)

# %% [markdown]
# ### 1.9 Speed is a GPU property
#
# Nothing above is faster on this CPU: it has no FP8 multiplier, so the course emulates FP8 with
# fp32 matmuls on the dequantized values. The speed comes from hardware. NVIDIA's H100 SXM
# datasheet gives 989 TFLOP/s for dense bf16 and 1,979 for dense FP8: twice the peak for the
# matmuls only. Whole training steps gain less, since attention, norms, communication and the
# casts themselves stay as they were: the torchao documentation reports end-to-end throughput up
# to 1.25× at 8 GPUs for an 8B model and up to 1.5× at 512 GPUs for a 405B model (float8 training
# with `torch.compile`). DeepSeek-AI (2024) trained DeepSeek-V3 with its FP8 framework; they
# compared FP8 with bf16 training on two smaller models, of about 16B and 230B parameters trained
# on about a trillion tokens each, where the relative loss error stayed below 0.25% (§3.3 and
# Appendix B.1). V3 itself had no bf16 twin to compare with. `benchmarks/gpu_fp8_matmul.py` measures bf16 against FP8
# matmuls (`torch._scaled_mm`) on a GPU.
#
# **Predict:** on one H200 (the same peaks as the H100: 989 and 1,979 TFLOP/s), how much faster
# is an FP8 matmul than a bf16 one, for square matrices of 4096 to 16384? The table below was
# measured by that benchmark on the course's GPU machine and stored with the course; this
# machine cannot measure it.

# %%
print(format_gpu_table(gpu_measurement()))

# %% [markdown]
# <details><summary>Answer</summary>
#
# About 1.6× at n = 4096 and 1.8× at 8192 and 16384: less than the peaks' 2×, because neither
# format reaches its peak (at n = 8192 bf16 ran at about 80% of 989 TFLOP/s, FP8 at about 74% of
# 1,979), and the smaller the matmul, the more its fixed costs weigh. One scale per row instead of
# one per tensor cost 2 to 9% here. A training step gains less again (the torchao figures above):
# FP8 speeds up the linear layers only.
# </details>

# %% [markdown]
# ### 1.10 Four bits: MXFP4 and NVFP4
#
# NVIDIA's Blackwell GPUs also multiply 4-bit floats, and NVIDIA (2025) pretrained a 12B-parameter
# model on 10 trillion tokens with its matmuls in a 4-bit format, to a loss and downstream accuracy
# close to its FP8 twin. Four bits leave one sensible float: **e2m1**, 1 sign, 2 exponent and
# 1 mantissa bit, exponent bias 1, no infinities or NaN (OCP Microscaling Formats (MX)
# Specification v1.0, 2023). It has eight magnitudes, 0, 0.5, 1, 1.5, 2, 3, 4 and 6: 0.5 apart
# below 2, two apart between 4 and 6, and nothing past 6 = 1.5 × 2². One scale per tensor cannot
# hold a tensor in that, so every short block of a row gets its own scale, as `mx32` did for FP8:
#
# | | MXFP4 (OCP MX v1.0, 2023) | NVFP4 (NVIDIA 2025) |
# |---|---|---|
# | block | 32 elements of a row | 16 elements of a row |
# | block scale | e8m0, a power of two: $X = 2^{\lfloor \log_2 \text{amax} \rfloor - 2}$ | e4m3: $\text{amax}_b / 6$ times $g$, rounded to e4m3 |
# | tensor scale | none | fp32: $g = 6 \cdot 448 / \text{amax}$ of the whole tensor, undone by $1/g$ |
# | bits per element | 4 + 8/32 = 4.25 | 4 + 8/16 = 4.5, plus 32 per tensor |
#
# The MX rule (its 2 is e2m1's largest exponent, 6 = 1.5 × 2²) puts a block's amax somewhere in
# [4X, 8X): an amax above 6X saturates to 6, and one just above 4X wastes the top of the grid. A
# power of two cannot put the amax on 6; an e4m3 scale can, up to e4m3's rounding (3 mantissa
# bits). NVFP4's fp32 tensor scale $g$ maps the largest block scale onto 448, e4m3's max, so
# that the block scales fit e4m3's range whatever the tensor's magnitude. `quantize(x, "mxfp4", "mx32")`
# and `quantize(x, "nvfp4", "nv16")` return the e2m1 values (as float32 on this CPU) and the scales.

# %%
from course_lib.techniques import fp4

print("e2m1, codes 0000 to 1111:", fp4.decode(torch.arange(16, dtype=torch.uint8)).tolist())
assert fp4.decode(torch.arange(8, dtype=torch.uint8)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4])  # one MX block of 32 elements, amax 7
q4, s4 = quantize(ties, "mxfp4", "mx32")
print(f"MXFP4: amax 7, scale 2^(2 - 2) = {s4.float().item():g}: {ties[0, :8].tolist()} -> {q4[0, :8].tolist()}")
assert s4.float().item() == 1 and q4[0, :8].tolist() == [0, 1, 1, 2, 2, 4, 4, 6]  # ties to even; 7 saturates to 6
block12 = torch.tensor([[12.0, 3.0, -1.5, 0.625] + [0.0] * 28])
q4, s4 = quantize(block12, "mxfp4", "mx32")
print(f"MXFP4: amax 12, scale 2^(3 - 2) = {s4.float().item():g}: {block12[0, :4].tolist()} -> "
      f"{dequantize(q4, s4, 'mx32')[0, :4].tolist()}")
assert s4.float().item() == 2 and dequantize(q4, s4, "mx32")[0, :4].tolist() == [12, 3, -2, 1]
two = torch.tensor([[12.0, 3.0, -1.5, 0.625] + [0.0] * 12 + [1.0, 0.5] + [0.0] * 14])  # two NVFP4 blocks
q4, s4 = quantize(two, "nvfp4", "nv16")
back = dequantize(q4, s4, "nv16")
print(f"NVFP4: g = 6 * 448 / 12 = {1 / s4.tensor.item():g}; block scales e4m3(12/6 * 224) = "
      f"{s4.block[0, 0].float().item():g} and e4m3(1/6 * 224 = 37.3) = {s4.block[0, 1].float().item():g}")
print(f"       block 1 {two[0, :4].tolist()} -> {back[0, :4].tolist()};  block 2 {two[0, 16:18].tolist()} -> "
      f"{[round(v, 4) for v in back[0, 16:18].tolist()]} (1 / (36/224) = 6.22 saturates to 6)")
assert s4.block.float().tolist() == [[448, 36]] and back[0, :4].tolist() == [12, 3, -2, 1]
# 1 * 224/36 = 6.22 saturates to 6, 0.5 * 224/36 = 3.11 rounds to 3; fp32 rounds 1/224 and the product (2^-23 each)
assert all(math.isclose(got, want, rel_tol=2**-22) for got, want in zip(back[0, 16:18].tolist(), (6 * 36 / 224, 3 * 36 / 224)))
print({f: fp4.bits_per_element(f) for f in ("mxfp4", "nvfp4")}, "bits per element with the block scales")

# %% [markdown]
# **Predict first.** Back to §1.7's activations (512 tokens × 256 channels) and their channel
# made 10^4 times larger. MXFP8 (e4m3 elements in the same 32-element blocks) left about 2 %
# mean relative error on the ordinary entries, with or without the outlier. How much do MXFP4
# and NVFP4 leave, which of the two less, and does the outlier channel now cost something?
#
# <details><summary>Answer</summary>
#
# About ten times FP8's: e2m1 rounds a value by up to a quarter of its power of two, and every
# entry below a quarter of its block's scale flushes to zero (a tenth or so of these activations,
# whose GELU leaves many near zero). NVFP4 less than MXFP4: its e4m3 scale puts each block's
# amax on 6 rather than anywhere in [4, 8), and its blocks are half as long. And the outlier now
# costs: e2m1 spans only 0.5 to 6, three and a half powers of two, so in the outlier's block the
# ordinary entries flush to zero (up to 31 of the 255 per row for MXFP4, 15 for NVFP4). e4m3's
# eighteen powers of two kept them; in four bits, the block size is what bounds an outlier's damage.
# </details>

# %% tags=["nbval-ignore-output"]
# the same activations as §1.7 (fp32 matmul outputs, which differ in the last bits between CPUs)
fp4_rows = {}
for label, x, mask in (("no outlier", acts, torch.ones_like(chan_mask)), ("channel x 1e4", chan_x, chan_mask)):
    fp4_rows[label] = {"e4m3 tensor": outlier_errors(x, mask, "e4m3", ("tensor",))["tensor"],
                       "MXFP8": outlier_errors(x, mask, "e4m3", ("mx32",))["mx32"],
                       "MXFP4": outlier_errors(x, mask, "mxfp4", ("mx32",))["mx32"],
                       "NVFP4": outlier_errors(x, mask, "nvfp4", ("nv16",))["nv16"]}
print(f"{'':12}" + "".join(f"{k:>28}" for k in fp4_rows))
for f in fp4_rows["no outlier"]:
    print(f"{f:12}" + "".join(f"{r[f][0]:>10.3f} ({r[f][1]:6.1%} to 0)" for r in fp4_rows.values()))
clean4, chan4 = fp4_rows["no outlier"], fp4_rows["channel x 1e4"]
for r in (clean4, chan4):  # four bits: several times FP8's error (e2m1 spacing 2^-1 vs e4m3's 2^-3 relative)
    assert min(r["MXFP4"][0], r["NVFP4"][0]) > 4 * r["MXFP8"][0] and r["NVFP4"][0] < r["MXFP4"][0]
for f in ("MXFP4", "NVFP4"):  # the outlier's block flushes: more entries to 0, a larger error
    assert chan4[f][1] > clean4[f][1] and chan4[f][0] > clean4[f][0]
assert chan4["NVFP4"][1] - clean4["NVFP4"][1] < chan4["MXFP4"][1] - clean4["MXFP4"][1]  # 15 entries per row, not 31

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
fmts4 = list(clean4)
for j, (label, r) in enumerate(fp4_rows.items()):
    ax.bar([i + 0.4 * j for i in range(len(fmts4))], [r[f][0] for f in fmts4], 0.4, label=label)
ax.set_xticks([i + 0.2 for i in range(len(fmts4))], fmts4)
ax.set_yscale("log")
ax.set_ylabel("mean relative error of\nthe ordinary entries")
ax.set_title("four bits: ten times FP8's error, and an outlier empties its block")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **Training with FP4 matmuls.** The recipes `"mxfp4"` and `"nvfp4"` run `FP8Linear` (§1.8) on
# the 4-bit formats: every matmul input in e2m1 with its block scales, regrouped along each
# backward matmul's summed dimension as before, products accumulated in fp32; the output head,
# the embeddings, attention's own matmuls, norms and the fp32 master weights and AdamW stay as
# they were.
#
# **Predict first.** Same 30 steps and batches as §1.5 and §1.8. Rounding is now four times
# coarser than FP8's. Does the course GPT still train, and how far from fp32 does it end?
#
# <details><summary>Answer</summary>
#
# It trains, and at this scale it ends about as close to fp32 as FP8 did, within the spread of
# initialisation seeds on the CPUs tried. Thirty steps of a tiny model learn the characters'
# frequencies, which survive coarse rounding; the damage NVIDIA (2025) fights shows over long
# runs (trillions of tokens), where the small biases of every step accumulate. The cell allows
# twice the seeds' spread, and prints where this machine's run lands.
# </details>

# %% tags=["nbval-ignore-output"]
# 4-bit numerics are exact arithmetic, but the fp32 matmuls round differently on each CPU: the printed
# losses vary from machine to machine, the asserts hold on any of them
fp4_curves = {recipe: train_30(apply_fp8(GPT(cfg), recipe))[0] for recipe in ("mxfp4", "nvfp4")}
tail4 = {**{k: tail[k] for k in ("fp32", "bf16 + fp32 master", "FP8 mxfp8")},
         **{f"FP4 {k}": last10(v) for k, v in fp4_curves.items()}}
for name, v in tail4.items():
    print(f"{name:20} mean loss of the last 10 steps {v:.3f} ({v - tail4['fp32']:+.3f} from fp32)")
print(f"the yardstick, §1.5: fp32 from initialisation seeds 0-3 ends {spread:.3f} apart")
# Tolerance: twice the seeds' spread (about 0.27, a fifth of what the 30 steps lower the loss). FP4 ended
# -0.01 to +0.05 from fp32 on the CPUs tried (AVX-512, AVX2, scalar kernels), FP8 up to +0.11 on another
# machine (§1.8); e2m1's rounding is four times e4m3's, so one spread would leave an untried CPU little room.
for k in fp4_curves:
    for ref in ("fp32", "bf16 + fp32 master"):
        assert abs(tail4[f"FP4 {k}"] - tail4[ref]) < 2 * spread, (k, ref, tail4, spread)
    assert fp4_curves[k][0] - tail4[f"FP4 {k}"] > 0.75 * fall  # it trains: most of fp32's fall
within = [k for k in fp4_curves if abs(tail4[f"FP4 {k}"] - tail4["fp32"]) < spread]
print(f"within one seed spread of fp32 on this machine: {', '.join(within) if within else 'neither'}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
for name in ("fp32", "bf16 + fp32 master"):
    ax.plot(range(1, 31), curves[name], label=name, lw=2, alpha=0.6)
ax.plot(range(1, 31), fp8_curves["mxfp8"], label="FP8 mxfp8", lw=1)
for name, v in fp4_curves.items():
    ax.plot(range(1, 31), v, label=f"FP4 {name}", lw=1, ls="--")
ax.set_xlabel("step")
ax.set_ylabel("train loss")
ax.set_title("the same 30 steps with FP4 matmuls")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **What the NVFP4 recipe adds.** Thirty steps hide what trillions of tokens show. NVIDIA (2025,
# §4) found that a 12B model diverged with every linear layer in NVFP4, and trained it stably
# to 10T tokens with four additions:
#
# 1. **Some layers in higher precision**: about 15 % of the linear layers, most of them the last
#    blocks (whose weight gradients showed the largest quantization errors), stay in bf16, as do
#    the embeddings, the output head, norms, attention's softmax and score matmuls; master weights,
#    gradients and optimizer state stay fp32. The course's `apply_fp8` keeps the head out, and
#    the rest of that list never enters `FP8Linear`.
# 2. **2D blocks for weights**: 16×16 blocks, the same group whether forward reads a weight along
#    its rows or backward along its columns, so both passes multiply the same quantized weight
#    (DeepSeek-V3's 128×128 blocks of §1.8, for the same reason); activations and gradients keep
#    1×16 blocks.
# 3. **Stochastic rounding for gradients**: round up with probability equal to the distance from
#    the lower neighbour, so that the rounded value is right *on average* (Gupta et al. 2015);
#    weights and activations keep round-to-nearest, whose error is smaller but has a sign.
# 4. **Random Hadamard transforms** (16×16, random signs) applied to the two inputs of the
#    weight-gradient matmul: an orthogonal mix of each 16-element group along the summed
#    dimension, undone by the matmul itself since $(AH)(H^\top B) = AB$. It spreads a block's
#    outlier over its 16 elements, so the block's distribution is closer to a Gaussian's.
#
# The last two are cheap to see. Stochastic rounding first: a gradient entry worth 0.3 of its
# block's scale arrives 10,000 times (the same small update, step after step).

# %%
y = torch.full((10_000,), 0.3)  # between the grid's 0 and 0.5
nearest = fp4.round_e2m1(y)
stoch = fp4.round_e2m1(y, stochastic=True, generator=torch.Generator().manual_seed(0))
print(f"sum of 10,000 x 0.3 = {y.sum().item():,.0f}:  round-to-nearest {nearest.sum().item():,.0f}, "
      f"stochastic {stoch.sum().item():,.1f}")
print(f"error of one rounding, root mean square: nearest {(nearest - y).pow(2).mean().sqrt().item():.3f}, "
      f"stochastic {(stoch - y).pow(2).mean().sqrt().item():.3f}")
assert torch.all(nearest == 0.5)  # 0.3 is nearer 0.5 than 0: every rounding adds 0.2, always the same way
# unbiased: the sum of 10,000 draws of 0 or 0.5 (p = 0.6) has standard deviation 0.5 sqrt(10,000 * 0.6 * 0.4) = 24.5
assert abs(stoch.sum().item() - 3000) < 6 * 24.5
assert set(stoch.unique().tolist()) == {0.0, 0.5}

# %% [markdown]
# Round-to-nearest adds the same 0.2 every time: the sum is two thirds too large. Stochastic
# rounding is right on average, at the price of a larger error per rounding, which is why the
# recipe spends it on the gradients (sums of many such roundings) only.
#
# The Hadamard transform next, on a heavy-tailed tensor (Student's t with 3 degrees of freedom,
# the shape of tails gradients often have): each 16-element group is multiplied by
# $\text{diag}(\pm 1)\, H_{16} / 4$, quantized, dequantized and multiplied back.

# %% tags=["nbval-ignore-output"]
# torch.randn's vectorized kernels differ in the last bits between CPUs: the printed errors vary slightly
gen = torch.Generator().manual_seed(0)
heavy = torch.randn(512, 256, generator=gen) / ((torch.randn(3, 512, 256, generator=gen) ** 2).sum(0) / 3).sqrt()
rht = fp4.random_hadamard(16, gen)
assert torch.allclose(rht @ rht.T, torch.eye(16), atol=1e-6)  # orthogonal, up to fp32 rounding (2^-23 per term)
rotated = fp4.blockwise(heavy, rht)


def crest(t):
    """Mean over the 16-element groups of amax / root mean square: 4 for a lone spike, about 2 for a Gaussian."""
    g = t.reshape(-1, 16)
    return (g.abs().amax(1) / g.pow(2).mean(1).sqrt()).mean().item()


def rel_mse(x, back):
    return ((back - x).pow(2).sum() / x.pow(2).sum()).item()


rht_err = {}
for f, g in (("mxfp4", "mx32"), ("nvfp4", "nv16")):
    plain = dequantize(*quantize(heavy, f, g), g)
    mixed = fp4.blockwise(dequantize(*quantize(rotated, f, g), g), rht.T)
    rht_err[f] = (rel_mse(heavy, plain), rel_mse(heavy, mixed))
print(f"amax / rms per group of 16: {crest(heavy):.2f} before, {crest(rotated):.2f} after the transform")
for f, (a, b) in rht_err.items():
    print(f"{f}: relative squared error {a:.4f} without, {b:.4f} with the transform ({b / a - 1:+.0%})")
assert crest(rotated) < 0.9 * crest(heavy)  # the spikes are spread: measured 2.5 -> 2.0
assert rht_err["mxfp4"][1] < 0.85 * rht_err["mxfp4"][0]  # MXFP4's power-of-two scales gain: measured -37%
assert rht_err["nvfp4"][1] > rht_err["nvfp4"][0]  # NVFP4's e4m3 scales fit each block already: measured +19%

# %% [markdown]
# The transform spreads the spikes, and MXFP4, whose power-of-two scale wastes up to half of the
# grid on a block with a spike, gains. NVFP4's own scale already fits each 16-element block,
# and on this tensor its error rises instead: the element error is not where the transform
# pays for NVFP4. NVIDIA (2025) applies it to the weight-gradient inputs only and judges each of the
# four additions by training with and without it; one tensor's error is where such a choice
# starts, not where it ends.

# %% [markdown]
# ## 2. Activation checkpointing
#
# Backward needs, for every op, what that op saved in forward. Activation checkpointing keeps only a few
# tensors and recomputes the rest when backward gets there:
#
# ```
# forward:   x0 ─[blocks 0..k-1]─ x_k ─[blocks k..2k-1]─ x_2k ─ ... ─ x_L ─ head ─ loss
#            kept               kept                  kept           (segment insides: dropped)
# backward:  for the last segment first: rerun its forward from its kept input, back-propagate
#            through it, free it, move to the previous segment.
# ```
#
# `course_lib.techniques.activation_checkpointing.checkpointed_forward(model, idx, targets, every_k)` is `GPT.forward`
# with the block loop run in segments of `every_k` blocks, each under
# `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. The model stays plain.
#
# ### 2.1 Same gradients, bit for bit
#
# The recomputation repeats the same arithmetic on the same inputs, so the gradients are not
# just close: they are identical.

# %%
cfg8 = GPTConfig.tiny(V, n_layer=8)
model8 = GPT(cfg8)
x, y = batch(4)


def grads_of(fwd):
    model8.zero_grad(set_to_none=True)
    fwd()[1].backward()
    return [p.grad.clone() for p in model8.parameters()]


plain_grads = grads_of(lambda: model8(x, y))
for k in (1, 2, 3, 4, 8):
    g = grads_of(lambda: checkpointed_forward(model8, x, y, every_k=k))
    assert all(torch.equal(a, b) for a, b in zip(g, plain_grads))
    print(f"every_k={k}: all {len(g)} gradient tensors identical to the plain model's")

# %% [markdown]
# ### 2.2 What stays saved, measured against the formula
#
# **Predict first.** The 8-layer GPT below, checkpointed every block (k = 1): what fraction of
# its saved activations remains, roughly: a half, a tenth, a fiftieth?
#
# <details><summary>Answer</summary>
#
# Less than a tenth (about 7% here). The blocks' insides are gone, one (B, T, d) tensor per block remains
# (a block normally saves ~20 of them), and what lies outside the blocks stays: the head's
# logits and log-softmax over the vocabulary are a large part of what is left.
# </details>
#
# Notebook 01's `estimate.activation_bytes` gives the bytes saved per layer without
# recomputation ($a_\text{full}$: inputs of every LayerNorm and matmul, Q, K, V, the softmax
# output, GELU input and output, LayerNorm statistics) and, with `recompute="full"`, one layer
# input ($b = 4\,B T d$ bytes in fp32). Checkpointing every $k$ blocks keeps
# $\lceil L/k\rceil$ segment inputs, plus what lies outside the blocks (token ids, final norm and
# head inputs, the log-softmax, the targets):
#
# $$\text{saved}(k) = \text{outside} + \lceil L/k \rceil\, b .$$

# %%
B, T, L = 4, 64, cfg8.n_layer
est_none = estimate.activation_bytes(cfg8, B, T, dtype_bytes=4)
est_full = estimate.activation_bytes(cfg8, B, T, dtype_bytes=4, recompute="full")
b = est_full["per_layer"]  # one (B, T, d) fp32 layer input
outside = est_full["input_side"] + est_full["output_side"]
measured_saved = {}
with SavedActivations(model8) as s:
    model8(x, y)
measured_saved[None] = s.bytes
for k in (1, 2, 4, 8):
    with SavedActivations(model8) as s:
        checkpointed_forward(model8, x, y, every_k=k)
    measured_saved[k] = s.bytes
print(f"{'':18} {'measured':>10} {'formula':>10} {'ratio':>6}")
for k, got in measured_saved.items():
    formula = est_none["total"] if k is None else outside + math.ceil(L / k) * b
    label = "no checkpointing" if k is None else f"every_k = {k}"
    print(f"{label:18} {fmt(got):>10} {fmt(formula):>10} {got / formula:6.3f}")
    assert got == formula + 4  # bytes are exact: the formula leaves out only the 4-byte scalar loss
print(f"checkpointing every block keeps {measured_saved[1] / measured_saved[None]:.1%} of the activations")

# %% [markdown]
# ### 2.3 The peak, and the choice of k
#
# Saved-after-forward is not the whole story: when backward reaches a segment, its $k$ layers
# are recomputed and *their* activations are alive at once. With $a$ = bytes one layer's
# activations take, the peak is
#
# $$M(k) \approx \lceil L/k\rceil\, b + k\, a, \qquad \text{minimised at } k^* = \sqrt{L\, b / a}.$$
#
# Few segments keep few boundaries but recompute long stretches; many segments the reverse.
# For a chain of small layers that each save about one tensor of their input's size ($a = b$,
# the setting of Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost") the best
# segment length is $\sqrt{L}$ and the peak drops from $L b$ to $2\sqrt{L}\, b$. A transformer
# block saves ~20 times its input ($a \approx 20\, b$ for the course GPT), so $k^*$ is small,
# but how small depends on the depth: $k^* = \sqrt{L b / a}$ grows with $L$. The integer
# optimum is $k = 1$ as long as $L b + a \le \lceil L/2\rceil b + 2a$, that is
# $L \lesssim 2a/b$: about 40 layers for this block. The 8-layer course GPT is well inside
# (checkpoint every block), but a GPT-3-sized stack of $L = 96$ such blocks has
# $k^* = \sqrt{96/20} \approx 2.2$: there two blocks per segment lower the peak by about a
# quarter. (Large trainers often checkpoint every block anyway, or recompute only the cheap,
# memory-hungry attention parts: Korthikanti et al. 2022, "Reducing Activation Recomputation
# in Large Transformer Models".)
#
# **Predict first.** For the 16-layer chain of small layers ($a = b$) and for the 8-layer
# GPT ($a \approx 20 b$): which $k$ gives the lowest peak?
#
# <details><summary>Answer</summary>
#
# The chain: $k = \sqrt{16} = 4$. The GPT: $k^* = \sqrt{8/20} \approx 0.6$, so the smallest
# possible segment, $k = 1$.
# </details>
#
# We measure both terms: the kept part from the checkpointed forward, the recompute part by
# running one segment's $k$ layers plainly from a boundary tensor (exactly what the
# recomputation does), minus that boundary (already counted among the kept). In the chain each
# layer saves its output, the next layer's input: $a = b$ exactly. A GPT block saves its own
# input too ($a$ = notebook 01's full per-layer bytes), so for it we subtract the one boundary
# counted twice: $M(k) = \text{outside} + \lceil L/k\rceil b + k a - b$.

# %%
def chain_peak(chain, x, k):
    with SavedActivations(chain) as kept:
        chain(x, every_k=k)
    segment = Chain(k, x.shape[1])
    with SavedActivations(segment) as seg:
        segment(x)
    return kept.bytes + seg.bytes - x.numel() * x.element_size()


chain = Chain(n_layer=16, width=256)
xc = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
bc = xc.numel() * 4
chain_measured = {k: chain_peak(chain, xc, k) for k in range(1, 17)}
with SavedActivations(chain) as s:
    chain(xc)
chain_plain = s.bytes
chain_formula = {k: checkpoint_memory(16, k, bc, bc)["peak"] for k in range(1, 17)}
assert min(chain_measured, key=chain_measured.get) == 4 == math.isqrt(16)
assert chain_measured == chain_formula  # bytes are exact: the formula to the byte
print(f"chain, L = 16: no checkpointing {chain_plain / bc:.0f} b; best k = 4 = sqrt(16) with "
      f"{chain_measured[4] / bc:.0f} b = 2 sqrt(L) b")

a_gpt = est_none["per_layer"]  # everything one GPT block saves, its input included
x_in = torch.randn(B, T, cfg8.d_model)
gpt_measured, gpt_formula = {}, {}
for k in (1, 2, 4, 8):
    h = x_in
    with SavedActivations(model8) as seg:  # one segment of k blocks, run plainly
        for blk in model8.blocks[:k]:
            h = blk(h)
    gpt_measured[k] = measured_saved[k] + seg.bytes - b
    gpt_formula[k] = outside + checkpoint_memory(L, k, a_gpt, b)["peak"] - b
    assert gpt_measured[k] == gpt_formula[k] + 4  # to the byte, but for the 4-byte scalar loss
assert min(gpt_measured, key=gpt_measured.get) == 1
print(f"GPT, L = 8: a / b = {a_gpt / b:.1f}, so k* = sqrt(L b / a) = {math.sqrt(L * b / a_gpt):.2f} -> every block; "
      f"peak {fmt(gpt_measured[1])} vs {fmt(measured_saved[None])} without checkpointing")
# The same blocks, stacked deeper: k = 1 stops being the best choice near L = 2 a / b.
for depth in (8, 24, 40, 48, 96):
    best = best_every_k(depth, a_gpt, b)
    peaks = {k: checkpoint_memory(depth, k, a_gpt, b)["peak"] for k in (1, best)}
    print(f"L = {depth:>2}: k* = sqrt(L b / a) = {math.sqrt(depth * b / a_gpt):.1f}, best integer k = {best}"
          + (f", peak {peaks[best] / peaks[1]:.0%} of k = 1's" if best != 1 else ""))
assert best_every_k(40, a_gpt, b) == 1 and best_every_k(96, a_gpt, b) == 2

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
ks = list(chain_measured)
ax1.plot(ks, [chain_formula[k] / bc for k in ks], "-", label="formula  ⌈L/k⌉ b + k a")
ax1.plot(ks, [chain_measured[k] / bc for k in ks], "o", label="measured")
ax1.axhline(chain_plain / bc, color="gray", ls="--", label="no checkpointing")
ax1.axvline(4, color="k", lw=0.6)
ax1.set_xlabel("k (layers per segment)")
ax1.set_ylabel("peak saved activations (units of b)")
ax1.set_title("chain of 16 small layers (a = b): best k = √L")
ax1.legend(fontsize=8)
ks = list(gpt_measured)
ax2.plot(ks, [gpt_formula[k] / 2**20 for k in ks], "-", label="formula")
ax2.plot(ks, [gpt_measured[k] / 2**20 for k in ks], "o", label="measured")
ax2.axhline(measured_saved[None] / 2**20, color="gray", ls="--", label="no checkpointing")
ax2.set_xlabel("k (blocks per segment)")
ax2.set_ylabel("peak saved activations (MiB)")
ax2.set_title(f"course GPT, L = 8 (a ≈ {a_gpt / b:.0f} b): best k = 1")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# **Explore** $M(k) = \lceil L/k\rceil b + k a$ for other depths and layer sizes (the sliders
# need a live kernel; the figure above is the static version).

# %% tags=["nbval-ignore-output"]
from course_lib.techniques.checkpoint_viz import checkpoint_view, checkpoint_widget
from course_lib.widgets import show_interactive

show_interactive(lambda: checkpoint_view(L=16, a_over_b=1), lambda: checkpoint_widget(L=16, a_over_b=1))

# %% [markdown]
# ### 2.4 The price: recomputation time
#
# Each checkpointed block runs its forward twice. With backward ≈ 2 × forward, a step costs
# about (1 + 1 + 2) / (1 + 2) = 4/3 of a plain step, whatever k (every block is recomputed once).
#
# **Predict first.** Will the measured ratio on these tiny blocks be below, at, or above 4/3?
#
# <details><summary>Answer</summary>
#
# Usually above. Layers this small also pay checkpoint's fixed bookkeeping per segment (saving
# and restoring the RNG state, hooks, Python calls), and for small matrices backward is often
# more than twice a forward, so the recomputation is not the only extra cost. Large layers
# come close to 4/3. The cell prints what this machine measured.
# </details>
#
# How the cell measures: the CPU time of the Python thread (`time.thread_time`), which on one
# thread is what the step costs; when other programs share the machine they add waiting to the
# wall-clock time, not to this. Plain and checkpointed steps take turns, round after round, so a
# machine whose speed drifts affects both alike, and each ratio is the median over the rounds.

# %% tags=["nbval-ignore-output"]
def step_cpu_time(fwd):
    """CPU seconds this thread spends on one forward + backward (torch runs them all on it: one thread)."""
    model8.zero_grad(set_to_none=True)
    t0 = time.thread_time()
    fwd()[1].backward()
    return time.thread_time() - t0


xb, yb = batch(8)
runs = {"plain": lambda: model8(xb, yb)}
runs.update({k: (lambda k=k: checkpointed_forward(model8, xb, yb, every_k=k)) for k in (1, 2, 4, 8)})
for fwd in runs.values():
    step_cpu_time(fwd)  # warm-up: first calls allocate and initialise
ROUNDS = 7
times = {name: [] for name in runs}
for _ in range(ROUNDS):  # interleaved: plain and every k in each round
    for name, fwd in runs.items():
        times[name].append(step_cpu_time(fwd))
ratios = {k: statistics.median(t / p for t, p in zip(times[k], times["plain"])) for k in (1, 2, 4, 8)}
print(f"no checkpointing: {statistics.median(times['plain']) * 1e3:.1f} ms of CPU per forward+backward")
for k, r in ratios.items():
    print(f"every_k = {k}: {statistics.median(times[k]) * 1e3:.1f} ms  ({r:.2f}x, median of {ROUNDS} rounds)")
# A checkpointed step does all of a plain step's arithmetic plus a second forward of every block and
# checkpoint's bookkeeping: it cannot cost less. No margin above 1 is asserted, since how much more
# is what the cell measures; the median of interleaved rounds keeps one disturbed round from deciding.
assert all(r >= 1 for r in ratios.values()), ratios
lo, hi = min(ratios.values()), max(ratios.values())
verdict = "above" if lo > 4 / 3 else ("below" if hi < 4 / 3 else "on both sides of")
print(f"measured {lo:.2f}x to {hi:.2f}x of a plain step: {verdict} the estimate's 4/3")

# %% [markdown]
# ## 3. Gradient accumulation
#
# The loss is a mean over the batch. Split a batch of $B$ examples into $k$ micro-batches of
# $m = B/k$; a mean of equal-sized means is the overall mean, so
#
# $$\nabla \frac{1}{B}\sum_{i=1}^{B} \ell_i \;=\; \sum_{j=1}^{k} \nabla\Big(\frac{1}{k}\cdot\frac{1}{m}\sum_{i \in j} \ell_i\Big).$$
#
# Back-propagate each micro-batch loss **divided by k**, let `.backward()` add into `p.grad`,
# step once: the update of the big batch, while only one micro-batch's activations ever exist.
# (`course_lib.techniques.accumulation.accumulate_gradients`; the step around it is `train_step(..., accum_steps=k)`.)
#
# ### 3.1 k micro-batches = one k-times larger batch

# %%
cfg2 = GPTConfig.tiny(V)
xb, yb = batch(16)
ref = GPT(cfg2)
ref_loss = ref(xb, yb)[1]
ref_loss.backward()
for k in (2, 4, 8):
    m = GPT(cfg2)
    res = accumulate_gradients(m, xb, yb, k)
    for a, r in zip(m.parameters(), ref.parameters()):
        # fp32 sums over the batch in another order: about 1e-7 relative, with atol for the
        # gradients that are (near) zero; the margin to these tolerances is 5x or more
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-7)
    assert abs(res.loss - ref_loss.item()) < 1e-5  # a mean of 1,024 fp32 token losses: ~1e-7 apart here
    print(f"k = {k}: batch loss {res.loss:.3f} = big batch's {ref_loss.item():.3f}; every gradient equal to the "
          f"big batch's up to float rounding (asserted: 1e-5 relative)")

# %% [markdown]
# The gradients agree up to rounding, so the optimizer step should too. It does, but AdamW shows
# something worth knowing. Its first step moves each parameter by
# $\text{lr}\cdot g/(|g| + \varepsilon)$ with $\varepsilon = 10^{-8}$: about lr for any gradient much
# larger than $\varepsilon$, whatever its size, but with slope $\text{lr}/\varepsilon = 3\cdot10^5$
# where $g$ is near 0. A rounding difference $\Delta g = 10^{-10}$ in a gradient of order $10^{-8}$
# (a gradient that nearly cancels, or one that is exactly zero in exact arithmetic and
# rounding noise on the computer, like the key bias's: softmax ignores a shift shared by all
# keys) moves the parameter by up to $3\cdot10^{-5}$. So after an Adam step two runs whose
# gradients differ only in the last bits can differ by
# $\text{lr}\cdot\min(2, |\Delta g|/\varepsilon)$ per parameter, and which parameters move depends
# on the CPU's summation order. That is the bound the cell asserts, parameter by parameter; with
# SGD, whose step $\text{lr}\cdot g$ is linear in $g$, the difference is only $\text{lr}\cdot|\Delta g|$.

# %%
# one real training step with clipping: accumulation (4 micro-batches) vs one big batch, AdamW then SGD
optimizers = {"AdamW": lambda m: make_optimizer(m, tc), "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=tc.lr)}
fp32_eps = torch.finfo(torch.float32).eps
after = {}
for opt_name, make_opt in optimizers.items():
    big, acc = GPT(cfg2), GPT(cfg2)
    opt = make_opt(big)
    train_step(big, opt, xb, yb, grad_clip=1.0)
    train_step(acc, make_opt(acc), xb, yb, grad_clip=1.0, accum_steps=4)
    after[opt_name] = []
    for a, r in zip(acc.parameters(), big.parameters()):
        # the (clipped) gradients the step used: equal up to fp32 reduction order, as above
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-7)
        dg = (a.grad - r.grad).abs()
        if opt_name == "AdamW":  # lr·g/(|g| + eps): at most lr, slope at most lr/eps
            step_diff = tc.lr * torch.clamp(dg / opt.defaults["eps"], max=2)
        else:  # lr·g: slope lr
            step_diff = tc.lr * dg
        bound = step_diff + 8 * fp32_eps * (r.detach().abs() + tc.lr)  # + a few fp32 roundings of the update
        assert ((a - r).abs() <= bound).all(), opt_name
        after[opt_name].append(((a - r).detach().abs(), r.grad))
print("after one AdamW step: every parameter within lr·min(2, |Δg|/eps) + fp32 rounding of the big batch's")
print("after one SGD step:   every parameter within lr·|Δg| + fp32 rounding of the big batch's")

# %% [markdown]
# How far apart did the runs end up on this machine? The largest AdamW difference sits on a
# parameter with a tiny gradient, near or below $\varepsilon$; the SGD differences are
# rounding-sized. (Which parameter, and how far, depends on the CPU's summation order.)

# %% tags=["nbval-ignore-output"]
for opt_name, pairs in after.items():
    d, g = max(pairs, key=lambda pair: pair[0].max().item())
    i = d.argmax()
    print(f"{opt_name:5}: largest parameter difference {d.flatten()[i]:.1e} (lr = {tc.lr:g}), "
          f"at a parameter whose gradient is {g.flatten()[i]:.1e}")

# %% [markdown]
# **Forgetting the 1/k** is a classic silent bug. With SGD the update becomes k times too
# large. With Adam it is almost invisible, because Adam divides the gradient by its own running
# magnitude: scaling every gradient by k barely changes the step (only through `eps` and weight
# decay). Gradient clipping, however, sees a k-times larger norm.

# %%
def one_step(optimizer_name, divide):
    m = GPT(cfg2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1) if optimizer_name == "SGD" else torch.optim.AdamW(m.parameters(), lr=1e-3)
    for xm, ym in zip(xb.chunk(4), yb.chunk(4)):
        loss = m(xm, ym)[1]
        (loss / 4 if divide else loss).backward()
    opt.step()
    return torch.cat([p.detach().flatten() for p in m.parameters()])


w0 = torch.cat([p.detach().flatten() for p in GPT(cfg2).parameters()])
for name in ("SGD", "AdamW"):
    good, bad = one_step(name, True) - w0, one_step(name, False) - w0
    ratio = (bad.norm() / good.norm()).item()
    print(f"{name:5}: update without 1/k is {ratio:.2f}x the correct one")
    # SGD: exactly 4 up to fp32 rounding; AdamW: 1 up to eps and weight decay (1.0004 measured)
    assert (abs(ratio - 4) < 0.01) if name == "SGD" else (abs(ratio - 1) < 0.05)

# %% [markdown]
# ### 3.2 Activation memory stays flat as the effective batch grows
#
# Micro-batches of 2 sequences; k = 1, 2, 4, 8 of them per step, so the effective batch grows
# from 2 to 16. We measure the saved activations of every micro-batch, and of one big batch of
# the same effective size for comparison, and hold them against `estimate.activation_bytes`.
#
# **Predict first.** Going from k = 1 to k = 8 micro-batches of 2, how do the peak saved bytes
# per micro-batch change? And for one big batch of 16?
#
# <details><summary>Answer</summary>
#
# Not at all with accumulation: each micro-batch's activations are freed by its backward
# before the next forward, so the peak is one micro-batch's. One big batch of 16 keeps 8 times
# the activations of a batch of 2 (activations are linear in the batch).
# </details>

# %%
micro = 2
rows = []
for k in (1, 2, 4, 8):
    xk, yk = batch(micro * k)
    res = accumulate_gradients(GPT(cfg2), xk, yk, k, measure=True)
    m_big = GPT(cfg2)
    with SavedActivations(m_big) as big:
        m_big(xk, yk)
    rows.append((k, micro * k, max(res.micro_batch_saved_bytes), big.bytes))
per_micro_formula = estimate.activation_bytes(cfg2, micro, 64)["total"]
print(f"{'k':>2} {'batch':>5} {'peak per micro-batch':>21} {'one big batch':>14}")
for k, eff, per_micro, big_bytes in rows:
    print(f"{k:>2} {eff:>5} {fmt(per_micro):>21} {fmt(big_bytes):>14}")
    assert per_micro == rows[0][2]  # flat
    # bytes are exact: the formula leaves out only the 4-byte scalar loss
    assert per_micro == per_micro_formula + 4 and big_bytes == estimate.activation_bytes(cfg2, eff, 64)["total"] + 4
print(f"formula for one micro-batch of {micro}: {fmt(per_micro_formula)}")

# %%
fig, ax = plt.subplots(figsize=(6, 3.4))
effs = [r[1] for r in rows]
ax.plot(effs, [r[3] / 2**20 for r in rows], "o-", label="one big batch")
ax.plot(effs, [r[2] / 2**20 for r in rows], "s-", label=f"accumulation (micro-batch {micro})")
ax.set_xlabel("effective batch size (sequences)")
ax.set_ylabel("saved activations (MiB)")
ax.set_title("accumulation: memory of the micro-batch, batch of the step")
ax.legend()
plt.show()

# %% [markdown]
# ## 4. All three together
#
# The techniques compose: accumulate over micro-batches, run each under bf16 autocast, and
# checkpoint every block. Checkpointing replays the forward under the same autocast state. For
# an effective batch of 16 sequences of the 8-layer GPT, saved activations per micro-batch:
#
# **Predict first.** Starting from one batch of 16 in fp32, add in turn 4 micro-batches of 4,
# then checkpointing every block, then bf16 autocast. Which step shrinks the saved bytes the
# most, and which the least?
#
# <details><summary>Answer</summary>
#
# Accumulation divides them by about 4 (a quarter of the sequences per forward).
# Checkpointing every block divides them by much more: a block saves about 20 times its
# input, and only the input is kept. Autocast helps least here: what checkpointing keeps (the
# residual stream between blocks, and the loss side) autocast leaves in fp32.
# </details>

# %%
def plain_loss(model, x, y):
    return model(x, y)[1]


def ckpt_loss(model, x, y):
    return checkpointed_forward(model, x, y, every_k=1)[1]


def ckpt_autocast_loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return ckpt_loss(model, x, y)


xb, yb = batch(16)
with SavedActivations(model8) as s:
    model8(xb, yb)
combos = {"fp32, one batch of 16": s.bytes}
for label, loss_fn in (("4 micro-batches of 4", plain_loss), ("+ checkpoint every block", ckpt_loss),
                       ("+ bf16 autocast", ckpt_autocast_loss)):
    res = accumulate_gradients(model8, xb, yb, 4, loss_fn=loss_fn, measure=True)
    combos[label] = max(res.micro_batch_saved_bytes)
plain = combos["fp32, one batch of 16"]
for label, v in combos.items():
    print(f"{label:26} {fmt(v):>9}" + ("" if v == plain else f"  ({plain / v:4.1f}x smaller)"))
values = list(combos.values())
assert all(big > small for big, small in zip(values, values[1:]))  # each technique helps further

# %% [markdown]
# Accumulation divides by the number of micro-batches, activation checkpointing by ~14 more. Autocast adds
# little *on top of* checkpointing: what checkpointing keeps is the residual stream between
# blocks and the loss side, both of which autocast leaves in fp32. (These are the bytes kept by
# the forward; the backward peak adds one recomputed block, §2.3.)

# %% [markdown]
# ## Summary
#
# * **Mixed precision.** bf16 autocast halves most activations with no code change; fp16 needs a
#   loss scale to keep small gradients from flushing to zero, found dynamically (halve and skip on
#   overflow, double after `growth_interval` good steps; our scaler matches `GradScaler` step for
#   step). fp32 master weights keep tiny updates from rounding away, so the model state stays at
#   16 B/param (2 + 2 + 12), or 20 with fp32 gradient accumulation, as notebook 01's formulas say.
# * **FP8.** e4m3 (max 448, 3 mantissa bits) and e5m2 (max 57344, 2 bits): per-tensor recipes
#   give gradients e5m2's range, fine-grained ones use e4m3 for every tensor. Every tensor is
#   scaled into range, and the finer the scale's grain (tensor, row, 1×128 tile, 128×128 block,
#   32-element MX block) the less an outlier costs the small entries; backward regroups the
#   scales along the dimension each of its matmuls sums over. FP8 matmuls train the course GPT
#   closer to fp32 than a change of initialisation seed does; they save the matmul inputs for
#   backward in one byte and halve FSDP's parameter all-gather; the model state stays at
#   16 B/param; the speed is the GPU's.
# * **FP4.** e2m1 has eight magnitudes (0 to 6, one mantissa bit), so every block carries a
#   scale: MXFP4 a power of two per 32 elements, NVFP4 an e4m3 scale per 16 plus an fp32 scale per
#   tensor, which puts each block's amax on 6. About ten times FP8's rounding error, and an outlier
#   empties its block; the course GPT still trains for 30 steps. At scale NVIDIA (2025) added
#   layers kept in bf16, 16×16 weight blocks, stochastic rounding of the gradients (unbiased)
#   and random Hadamard transforms of the weight-gradient inputs (spreading a block's outliers).
# * **Activation checkpointing** keeps one tensor per segment and recomputes the rest: same
#   gradients bit for bit, the saved bytes of `⌈L/k⌉ b + outside`, for one more forward of the
#   blocks (a third more compute when backward costs two forwards; more for small layers).
#   The best segment length is $\sqrt{L b / a}$: $\sqrt L$ for a chain of small layers; for
#   transformer blocks ($a \approx 20 b$) it is 1 up to about $2a/b \approx 40$ layers, and 2
#   for a 96-layer stack.
# * **Gradient accumulation** gives the big-batch gradient (divide each micro-batch loss by k!)
#   with the activation memory of one micro-batch. Equal up to rounding: after an AdamW step
#   the parameters agree to $\text{lr}\cdot\min(2, |\Delta g|/\varepsilon)$, because Adam's step
#   magnifies rounding in gradients near zero (SGD's does not).
#
# None of these split the model state across devices. That is what ZeRO and the model-parallel
# strategies of the next notebooks do, and they combine with all three techniques here.
#
# ## Self-check
#
# 1. A bf16 weight equals 2.0. Can an update of 0.005 change it? And one of 0.01?
# 2. Your fp16 run skips a step every few hundred steps. Is that a bug?
# 3. Why does mixed precision with fp32 master weights use *more* model-state memory than the
#    16-bit weights alone would, and what does it still save?
# 4. A 32-layer transformer whose blocks save 20 times their input: checkpoint every block or
#    every second block? And at 80 layers?
# 5. You accumulate 8 micro-batches and forget the 1/8. With AdamW and clipping at 1.0, what
#    changes in the update?
# 6. A weight matrix's largest entry is 900 and most entries are near 0.01. With one e4m3 scale
#    for the whole matrix, what happens to the small entries? What would you change?
# 7. An MXFP4 block's largest magnitude is 7 and its other entries are near 1. What scale does
#    the MX rule give, and what becomes of the 7 and of a 1? If the same block is the largest of
#    its tensor in NVFP4, what are its scales, and what becomes of the 7 and the 1?
# 8. Why does the NVFP4 recipe round gradients stochastically but weights and activations to nearest?
#
# <details><summary>Answers</summary>
#
# 1. Near 2.0 bf16 numbers are 2 × 2^-7 = 2^-6 ≈ 0.0156 apart; rounding to nearest keeps
#    2.0 for any update below half of that, 2^-7 ≈ 0.0078 (2^-8 relative). So 0.005 is lost,
#    0.01 moves the weight to 2.0156 (too far: fp32 master weights would keep 2.01).
# 2. No: dynamic loss scaling grows the scale until it overflows, then halves it and skips that
#    step. A skip every `growth_interval` steps or so is the scaler working. Many skips in a row
#    are a problem (the gradients themselves are inf/nan).
# 3. The fp32 master copy (4 bytes) comes on top of the 16-bit weights (2): 16 bytes per
#    parameter with Adam, as much as fp32 training. It saves activation memory and, on GPUs,
#    time; the optimizer state is what ZeRO can shard.
# 4. The integer optimum is k = 1 while L ≲ 2a/b = 40: every block at 32 layers; at 80
#    layers k* = √(80/20) = 2, so every second block gives the lower peak.
# 5. Little, which is what makes the bug dangerous: AdamW divides by the gradient's own running
#    magnitude, so a constant factor of 8 barely changes its step. But the norm that clipping
#    and your logs see is 8 times too large, clipping triggers on steps where it should not
#    (a factor that now changes from step to step, which Adam does feel), and with SGD the
#    step would be 8 times too large.
# 6. The scale is 900/448 ≈ 2, so 0.01 becomes 0.005 in e4m3 units, below the smallest normal
#    (2^-6 ≈ 0.016): a subnormal with one or two significant bits, and anything below 2^-10 ≈ 0.001
#    units (0.002 here) rounds to 0. Finer scales (row-wise, 1×128 tiles, 128×128 blocks, MX
#    blocks) give the small entries scales of their own; the outlier only spoils its own group.
# 7. MX: ⌊log₂ 7⌋ = 2, so X = 2^(2-2) = 1: the 7 saturates to 6 (14 % low), a 1 stays 1. NVFP4:
#    g = 6·448/7 = 384, the block scale e4m3(7/6 · 384) = 448 exactly, decoding with 448/384 = 7/6:
#    the 7 becomes 6 · 7/6 = 7 exactly, and a 1 becomes 1/(7/6) ≈ 0.857 → rounds to 1 (the grid
#    is 0.5 apart there) → 7/6 ≈ 1.17. Neither is exact everywhere: MX loses the top, NVFP4's finer
#    scale moves the rest of the grid.
# 8. A gradient is summed over many steps and micro-batches: round-to-nearest makes the same
#    error with the same sign every time a value sits at the same place between two grid points,
#    and those errors add up (§1.10: 10,000 × 0.3 summed to 5,000). Stochastic rounding is right
#    on average, so the sums are right, at the price of a larger error per value, which forward's
#    weights and activations, used once per step, would pay without gaining from the averaging.
# </details>

# %% [markdown]
# ## References
#
# What this notebook relies on:
#
# * Micikevicius et al. (2018). *Mixed Precision Training*, ICLR 2018: fp32 master weights,
#   loss scaling, and the small-gradient regime that §1.3 emulates.
# * Kalamkar et al. (2019). *A Study of BFLOAT16 for Deep Learning Training*, arXiv:1905.12322:
#   bf16, with fp32's range and 8 significant bits, as a training format (§1.1, §1.5).
# * PyTorch documentation, [*Automatic Mixed Precision package: torch.amp*](https://pytorch.org/docs/stable/amp.html):
#   `torch.autocast` and `GradScaler`, the references of §1.2 and §1.4.
# * Rajbhandari et al. (2020). *ZeRO: Memory Optimizations Toward Training Trillion Parameter
#   Models*, SC20: counting the fp32 master copy as optimizer state, $K = 12$ (§1.6).
# * Chen et al. (2016). *Training Deep Nets with Sublinear Memory Cost*, arXiv:1604.06174:
#   activation checkpointing and the $\sqrt{L}$ segment length (§2.3).
# * PyTorch documentation, [*torch.utils.checkpoint*](https://pytorch.org/docs/stable/checkpoint.html):
#   the non-reentrant checkpoint used to build `checkpointed_forward`.
# * Korthikanti et al. (2022). *Reducing Activation Recomputation in Large Transformer Models*,
#   arXiv:2205.05198 (MLSys 2023): selective recomputation of the attention part (§2.3).
# * Micikevicius et al. (2022). *FP8 Formats for Deep Learning*, arXiv:2209.05433: e4m3 and e5m2,
#   their ranges, saturation and per-tensor scaling (§1.7); the basis of the OCP *8-bit Floating
#   Point Specification (OFP8)* rev. 1.0 (2023), whose Table 2 gives each format's encodings
#   (e4m3: no infinities, NaN S.1111.111).
# * Rouhani et al. (2023). *Microscaling Data Formats for Deep Learning*, arXiv:2310.10537, and the
#   OCP *Microscaling Formats (MX) Specification v1.0* (2023): 32-element blocks with a shared
#   power-of-two (e8m0) scale, MXFP8 (§1.7); the FP4 element e2m1 (bias 1, max 6, no inf or NaN)
#   and MXFP4's scale rule $2^{\lfloor \log_2 \text{amax} \rfloor - e_\text{max}}$, $e_\text{max} = 2$ (§1.10).
# * NVIDIA (2025). *Pretraining Large Language Models with NVFP4*, arXiv:2509.25149: NVFP4's
#   16-element blocks with e4m3 block scales and an fp32 tensor scale, and the recipe that trained
#   a 12B model on 10T tokens (layers kept in bf16, 16×16 weight blocks, stochastic rounding of
#   gradients, random Hadamard transforms of the weight-gradient inputs) (§1.10).
# * Gupta et al. (2015). *Deep Learning with Limited Numerical Precision*, ICML 2015: stochastic
#   rounding, unbiased, for training in low precision (§1.10).
# * DeepSeek-AI (2024). *DeepSeek-V3 Technical Report*, arXiv:2412.19437, §3.3: FP8 training with
#   1×128 activation tiles and 128×128 weight blocks, e4m3 for every tensor (§3.3.2), fp32 master
#   weights with AdamW's moments in bf16 (§3.3.3), the output head in higher precision; §3.5.2: the
#   saved activation tiles re-quantized as 128×1 tiles for the weight gradient; Appendix B.1: FP8
#   against bf16 on two smaller models (§1.7-1.9).
# * NVIDIA Transformer Engine documentation, *Common API* (`transformer_engine.common.recipe`):
#   `DelayedScaling` and `Float8CurrentScaling` default to the HYBRID format (e4m3 forward, e5m2
#   backward), `Float8BlockScaling` and `MXFP8BlockScaling` to E4M3 for every tensor (§1.8).
# * torchao documentation, `torchao.float8.precompute_float8_dynamic_scale_for_fsdp`: one
#   all-reduce computes the tensor-wise scales of every float8 weight before FSDP2's FP8
#   all-gather (§1.8).
# * Dettmers et al. (2022). *LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale*,
#   NeurIPS 2022: the outlier features of §1.7.
# * NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOP/s dense bf16, 1,979 dense FP8 (SXM); and the
#   torchao documentation, [*Quantized training*](https://docs.pytorch.org/ao/stable/workflows/training.html):
#   float8 training's end-to-end speed-ups (§1.9).
# * Kingma & Ba (2015). *Adam: A Method for Stochastic Optimization*, ICLR 2015, and Loshchilov &
#   Hutter (2019). *Decoupled Weight Decay Regularization*, ICLR 2019: the AdamW step whose
#   $\text{lr}\cdot g/(|g| + \varepsilon)$ first move §3 analyses.
#
# Further reading:
#
# * PyTorch documentation, [*Automatic Mixed Precision examples*](https://pytorch.org/docs/stable/notes/amp_examples.html):
#   `GradScaler` together with gradient accumulation and gradient clipping, the combinations of
#   §3 and §4 written with PyTorch's own tools.
# * Micikevicius et al. (2018): short, and still the clearest account of why each part of the
#   mixed-precision recipe is needed.
# * DeepSeek-AI (2024), §3.3: the most detailed public account of training a large model in FP8,
#   including why fine-grained scales and fp32 accumulation every 128 products were needed.
# * Korthikanti et al. (2022): how large trainers decide which activations to recompute and
#   which to keep, once checkpointing every block costs too much compute.
#
# **Next:** exercise 04 (`exercises/ex04_memory_techniques.ipynb`) has you write the
# mixed-precision optimizer step yourself: unscale, skip on overflow, step the fp32 masters,
# copy them back. Then notebook 05 splits the model itself across devices, starting with
# tensor parallelism.
