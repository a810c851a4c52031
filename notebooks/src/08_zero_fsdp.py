# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/08_zero_fsdp.ipynb)

# %% [markdown]
# # 08 · ZeRO stages 1, 2 and 3, FSDP and offload
#
# Notebook 01 counted what training holds per parameter: with bf16 weights and AdamW, **16
# bytes** (2 for the bf16 weight, 2 for its gradient, 12 for the optimizer's fp32 master copy
# and its two moments m and v). Notebook 03's data parallelism then put a **complete copy** of
# those 16 bytes per parameter on every rank. With N ranks, N - 1 of the N copies are
# redundant: every rank keeps the same Adam moments and runs the same update.
#
# ZeRO, the *Zero Redundancy Optimizer* (Rajbhandari et al. 2020), removes that redundancy in
# three stages. Each rank keeps only its 1/N **shard** of
#
# * stage 1: the optimizer state (12 of the 16 bytes),
# * stage 2: also the gradients,
# * stage 3: also the parameters (PyTorch calls this *Fully Sharded Data Parallel*, FSDP),
#
# and it still computes exactly what one process would: this notebook proves it on real ranks,
# measures the memory of each stage against notebook 01's formula, and counts what each stage
# sends. Exercise 08 then has you write stage 2 yourself.
#
# **After this notebook you can**
#
# * compute the model state per GPU under each stage (the ZeRO paper's 7.5B-parameter table)
#   and check it against memory measured on ranks;
# * explain the flat, padded buffer and its shard bounds, and why only element-wise optimizers
#   (SGD, the Adam family) can be sharded this way;
# * explain why stages 1 and 2 send no more bytes than DDP and stage 3 sends 1.5 times as much,
#   and verify it with the tracer;
# * read FSDP's gather/free timeline and say what prefetching overlaps and what memory peaks;
# * contrast the flat design with FSDP2's per-parameter sharding (names, shapes, state dicts),
#   predict the all-gathers of each `reshard_after_forward` mode, and read HSDP's traffic per
#   mesh dimension;
# * read PyTorch's `MemTracker` on a ZeRO-3 step and reconcile its categories with the formula
#   and the course's measurement, byte for byte;
# * decide when ZeRO-Offload's PCIe transfers, host-side step or NVMe tier become the bottleneck;
# * choose between ZeRO-3, tensor and pipeline parallelism for a memory budget, and map the
#   course's options to DeepSpeed's config keys and PyTorch's FSDP2;
# * explain why Muon, which orthogonalises whole matrices, cannot step a flat shard, and compare
#   its gather and owner-compute shardings by bytes and Newton-Schulz FLOPs per rank.

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
import dataclasses
import shutil
import tempfile

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import RankError, run_on_ranks
from course_lib.data import CharDataset
from course_lib.estimate import LLAMA3_8B, model_state_bytes, per_param_memory
from course_lib.measure.torch_memtracker import format_three_ways, memory_three_ways, memtracker_missing
from course_lib.model import GPT, GPTConfig
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.zero import (FlatUnit, apply_zero, disk_bandwidth, expected_state_bytes, full_state_dict,
                                      hsdp_payloads, measure_zero_step, offload_bytes_per_step, ring_bytes,
                                      train_zero_reference, train_zero)
from course_lib.parallel.zero import viz
from course_lib.parallel.zero.memory import measure_state_bytes, watch_gathered
from course_lib.parallel.zero.native import fsdp2_model, train_native
from course_lib.parallel.zero.training import default_optimizer_kwargs
from course_lib.train import StepHooks, TrainConfig, share_rows, train_loop
from course_lib.units import GB, GiB, fmt_bytes

torch.manual_seed(0)
V = CharDataset("train").vocab_size
# Three layers and an awkward MLP width (127): the parameter count is odd and not a multiple of
# 4, so the shards below need padding, as real ones usually do.
CONFIG = GPTConfig.tiny(V, n_layer=3, d_ff=127, block_size=32)
N_PARAMS = GPT(CONFIG).num_params()
N = 4  # data-parallel ranks
TRAIN = TrainConfig(steps=3, batch_size=12, grad_clip=1.0, progress=False)
# One pool of ranks per world size: every run skips the per-collective check (notebook 00),
# because torch's FSDP2 and DDP, run in section 7, issue their collectives from C++ where
# the check cannot see them.
RANKS = dict(backend="gloo", check_collectives=False, timeout_s=180)
print(f"course GPT: {N_PARAMS:,} parameters; {N_PARAMS} = {N} x {N_PARAMS // N} + {N_PARAMS % N}")

# %% [markdown]
# ## 1. Where the 16 bytes live, and the ZeRO paper's table
#
# Write $\Psi$ for the number of parameters, $K$ for the optimizer's bytes per parameter (12
# for fp32 master + m + v) and $N$ for the data-parallel degree. Per GPU (Rajbhandari et al.
# 2020, Figure 1):
#
# | | params | grads | optimizer | total (bytes) |
# |---|---|---|---|---|
# | DDP (stage 0) | $2\Psi$ | $2\Psi$ | $K\Psi$ | $(4 + K)\Psi$ |
# | stage 1 ($P_{os}$) | $2\Psi$ | $2\Psi$ | $K\Psi/N$ | $4\Psi + K\Psi/N$ |
# | stage 2 ($P_{os+g}$) | $2\Psi$ | $2\Psi/N$ | $K\Psi/N$ | $2\Psi + (2+K)\Psi/N$ |
# | stage 3 ($P_{os+g+p}$) | $2\Psi/N$ | $2\Psi/N$ | $K\Psi/N$ | $(4+K)\Psi/N$ |
#
# The paper's example is a 7.5-billion-parameter model on 64 GPUs: 120 GB, 31.4 GB, 16.6 GB
# and 1.9 GB. Notebook 01's estimator (`course_lib.estimate.model_state_bytes`, which rounds
# each shard up to $\lceil \Psi/N \rceil$) gives the same numbers:

# %%
paper = viz.paper_table(7_500_000_000, 64)
print(f"{'stage':>5} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10} {'(GiB)':>9}")
for stage, t in paper.items():
    print(f"{stage:>5} " + " ".join(f"{t[k] / GB:>8.2f}GB" for k in ("params", "grads", "optimizer", "total"))
          + f" {t['total'] / GiB:>8.2f}")
assert [round(t["total"] / GB, 1) for t in paper.values()] == [120.0, 31.4, 16.6, 1.9]

# %% [markdown]
# Stage 1 already cuts the footprint by 3.8x, because the optimizer state is 12 of the 16
# bytes; stage 3 divides everything by N. Activations are not model state and are not sharded
# by ZeRO (notebook 04's checkpointing and notebook 05's tensor parallelism handle them).
#
# ## 2. The flat buffer and its shards
#
# The ZeRO paper's design, which DeepSpeed's stages 1 and 2 and PyTorch's first FSDP (Zhao et al.
# 2023) also use, does not shard each tensor separately: it lays a group of parameters end to end in one
# **flat buffer**, pads it with zeros to a multiple of N and gives rank r the slice
# $[rS, (r+1)S)$ with $S = \lceil P/N \rceil$. Equal slices are what the collectives need:
# `reduce_scatter` and `all_gather` move one S-element piece per rank. A tensor may straddle a
# boundary (below, the 2x3 matrix is split between ranks 0 and 1). PyTorch's FSDP2 shards each
# tensor on its own instead; section 8 runs both designs side by side.

# %%
demo = [torch.nn.Parameter(torch.arange(1.0, 7.0).view(2, 3)), torch.nn.Parameter(torch.tensor([7.0, 8.0]))]
for r in range(3):
    unit = FlatUnit(demo, world_size=3, rank=r)
    flat = unit.flatten([p.detach() for p in demo])
    print(f"rank {r}: owns [{unit.start}, {unit.stop}) = {unit.shard(flat).tolist()}")
print(unit)

# %% [markdown]
# **Why this is exact only for element-wise optimizers.** Adam's m, v and update of element i
# depend only on element i's gradient history, so updating a slice that cuts a matrix
# anywhere gives the same numbers as updating the whole matrix. The padding has zero value and
# zero gradient, so it stays zero. An optimizer that preconditions whole rows or matrices
# (Shampoo, Adafactor's factored moments, Muon's orthogonalisation) would see a different
# matrix on every rank, so `apply_zero` rejects it:

# %%
def try_lbfgs():
    apply_zero(GPT(CONFIG), 1, torch.optim.LBFGS, lr=1.0)

try:
    run_on_ranks(try_lbfgs, world_size=2, **RANKS)
except RankError as err:
    print(str(err).strip().splitlines()[-1])

# %% [markdown]
# ## 3. Every stage trains exactly as one process
#
# `apply_zero(model, stage, torch.optim.AdamW, lr=...)` changes the model in place and returns
# it with its optimizer; each rank then runs the usual `loss.backward(); optimizer.step()` on
# its own quarter of every batch. One step of stage 1 on rank r, for the flat buffer of all
# parameters:
#
# $$g = \text{flatten}(\nabla L_r)/N,\quad g_r = \text{reduce\_scatter}(g)_r,\quad
# w_r \leftarrow \text{AdamW}(w_r, g_r),\quad w = \text{all\_gather}(w_r).$$
#
# Stage 2 reduce-scatters during backward, bucket by bucket (section 5); stage 3 also gathers
# the weights before each block runs (section 6). **Predict:** the single process trains on
# the whole batch of 12; each of the 4 ranks sees 3 sequences. Should the ZeRO runs' losses
# equal the single process's exactly, to about 1e-6, or only roughly?
#
# <details><summary>Answer</summary>
#
# To float rounding (about 1e-6 here): the mean of the four ranks' gradients is the gradient
# of the whole batch (notebook 03), and every stage applies the same AdamW update to the same
# numbers, only cut into shards. The sums are added in another order, hence not bit for bit.
# </details>

# %% tags=["nbval-ignore-output"]
def every_stage(config, cfg):
    return {stage: train_zero(config, cfg, stage, bucket_cap_mb=0.05) for stage in range(4)}

reference = train_zero_reference(CONFIG, TRAIN)
runs = run_on_ranks(every_stage, CONFIG, TRAIN, world_size=N, **RANKS)
print("step  single process   " + "   ".join(f"stage {s}" for s in range(4)))
for i, ref in enumerate(reference.train_losses):
    means = [sum(r[s].train_losses[i] for r in runs) / N for s in range(4)]
    print(f"{i + 1:>4} {ref:>15.6f} " + " ".join(f"{m:>9.6f}" for m in means))
def same_training(a, b):
    """Parameters in RMS against a hundredth of one AdamW step (lr): AdamW magnifies the rounding of
    gradients near zero and can move a single parameter by up to ~lr (notebook 04). The last step's
    gradients are taken at those parameters: in norm, to 1e-4 of their size."""
    rms = (a.final_params - b.final_params).pow(2).mean().sqrt()
    return rms < TRAIN.lr / 100 and (a.final_grads - b.final_grads).norm() < 1e-4 * b.final_grads.norm()

for s in range(4):  # losses: fp32 sums in another order, ~1e-7 apart
    assert max(abs(sum(r[s].train_losses[i] for r in runs) / N - ref)
               for i, ref in enumerate(reference.train_losses)) < 1e-5
    assert same_training(runs[0][s], reference)
print("every stage: parameters and gradients equal the single process's after", TRAIN.steps, "steps")

# %% [markdown]
# The losses agree to rounding, the gradients too (in norm), and the parameters in RMS: AdamW
# magnifies the rounding of gradients near zero, so single parameters may differ by more
# (notebook 04). Comparing gradients matters: Adam divides by $\sqrt{v}$, so a gradient wrongly
# averaged twice (divided by $N^2$) gives almost the same parameters; the gradient check
# catches it.
#
# ## 4. Measured memory against the formula
#
# Now the point of it all. `measure_zero_step` trains two steps and reads every tensor the rank
# holds: the gradients right after backward (where they peak), the parameters and optimizer
# state after the step. Notebook 01's formula is applied to each flat unit the stage shards (one
# unit for stages 0-1, one per bucket in stage 2, one per block plus the rest in stage 3: each is
# padded on its own, so the shards add up to a few elements more than $\lceil\Psi/N\rceil$).
#
# **Predict:** with fp32 (4 + 4 + 8 bytes) on 4 ranks, what fraction of stage 0's model state
# does each stage keep?
#
# <details><summary>Answer</summary>
#
# Stage 1: $(4 + 4 + 8/4)/16 = 62.5\,\%$; stage 2: $(4 + 12/4)/16 = 43.75\,\%$; stage 3:
# $1/4 = 25\,\%$ (plus a few padding elements).
# </details>

# %%
def measure_all(config, cfg):
    out = {(s, "fp32"): measure_zero_step(config, cfg, s, bucket_cap_mb=0.05) for s in range(4)}
    out.update({(s, "bf16_mixed"): measure_zero_step(config, cfg, s, compute_dtype=torch.bfloat16)
                for s in range(4)})
    out[(2, "offload")] = measure_zero_step(config, cfg, 2, offload=True, compute_dtype=torch.bfloat16)
    return out

measured = run_on_ranks(measure_all, CONFIG, TRAIN, world_size=N, **RANKS)

def held(m):
    return {"params": m["after_step"]["params"], "grads": m["after_backward"]["grads"],
            "optimizer": m["after_step"]["optimizer"] + m["after_step"]["host"]}

mine = {s: held(measured[0][(s, "fp32")]) for s in range(4)}
formula = {s: expected_state_bytes(measured[0][(s, "fp32")]["unit_sizes"], "fp32", s, N) for s in range(4)}
print(f"fp32, N = {N}, rank 0 (bytes)      params      grads  optimizer      total   % of stage 0")
for s in range(4):
    total = sum(mine[s].values())
    print(f"stage {s}  measured  {mine[s]['params']:>12,} {mine[s]['grads']:>10,} {mine[s]['optimizer']:>10,} "
          f"{total:>10,}   {100 * total / sum(mine[0].values()):5.1f} %")
    print(f"         formula   {formula[s]['params']:>12,} {formula[s]['grads']:>10,} {formula[s]['optimizer']:>10,}"
          f" {formula[s]['total']:>10,}")
    assert all(mine[s][k] == formula[s][k] for k in ("params", "grads", "optimizer"))
    assert all(held(m[(s, "fp32")]) == mine[s] for m in measured)  # every rank the same
assert formula[1] == model_state_bytes(N_PARAMS, "fp32", 1, N)  # one unit: exactly notebook 01's call

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
viz.plot_memory_by_stage(axes[0], mine, formula)
axes[0].set_title(f"fp32 AdamW, {N} ranks: bars measured, ticks formula", fontsize=10)
bf16 = {s: held(measured[0][(s, "bf16_mixed")]) for s in range(4)}
bf16_formula = {s: expected_state_bytes(measured[0][(s, "bf16_mixed")]["unit_sizes"], "bf16_mixed", s, N)
                for s in range(4)}
viz.plot_memory_by_stage(axes[1], bf16, bf16_formula)
axes[1].set_title("bf16 weights, fp32 master + m + v", fontsize=10)
plt.tight_layout()
plt.show()
for s in range(3):
    assert bf16[s] == {k: bf16_formula[s][k] for k in ("params", "grads", "optimizer")}
assert sum(bf16[3].values()) == bf16_formula[3]["total"]

# %% [markdown]
# One bar differs in its split, not its height: in bf16 stage 3 the shards that
# `model.parameters()` returns *are* the fp32 master weights (as in FSDP2), so they count as
# parameters (4 bytes) rather than optimizer state, and their gradients arrive in fp32: 4 + 4
# + 8 bytes per shard element instead of the formula's 2 + 2 + 12, still 16 in all. The bf16
# copies exist only while a block is gathered (section 6).
#
# ## 5. Stage 2: reduce-scatter while backward runs
#
# Stage 1 keeps every gradient until backward ends, then reduce-scatters. Stage 2 cuts the
# parameters into buckets in backward order; a hook on each parameter counts the gradients
# produced, and when a bucket is complete it is flattened, its per-parameter gradients are
# dropped, and its reduce-scatter starts while backward goes on (as DDP's buckets did in
# notebook 03, with reduce-scatter instead of all-reduce). So the rank never holds the whole
# gradient:

# %%
s1, s2 = measured[0][(1, "fp32")], measured[0][(2, "fp32")]
print(f"stage 1: gradients after backward {fmt_bytes(s1['after_backward']['grads'])} (all of them)")
print(f"stage 2: {len(s2['unit_sizes'])} buckets; after backward {fmt_bytes(s2['after_backward']['grads'])} "
      f"(the shards); at most {fmt_bytes(s2['peak_grad_bytes'])} at any moment of backward")
assert s2["peak_grad_bytes"] < s1["after_backward"]["grads"]

# %% [markdown]
# ## 6. Stage 3 (FSDP): gather, compute, free
#
# In stage 3 a rank keeps only the shards of the parameters. The model is cut into **units**:
# each block, plus a root unit for the embeddings, final norm and head. Hooks around each block:
#
# 1. **before its forward**: all-gather the block's full weights (and start gathering the
#    *next* block: that **prefetch** overlaps with this block's compute);
# 2. **after its forward**: free them (the storage is resized to zero);
# 3. **before its backward**: all-gather them again (and prefetch the previous block);
# 4. **when its gradients are complete**: reduce-scatter them into the shard's gradient and free.
#
# The root is gathered once and kept until the end of backward, as FSDP2 does for its root.
# **Predict:** with 3 blocks and prefetching, how many units are gathered at once at most?
#
# <details><summary>Answer</summary>
#
# Three: the root, the block computing and the block being prefetched, never all four units.
# Without prefetching it would be two, at the price of waiting for every gather.
# </details>

# %% tags=["nbval-ignore-output"]
stage3 = [m[(3, "fp32")] for m in measured]
persistent = [m["after_step"]["params"] for m in stage3]
fig, ax = plt.subplots(figsize=(10, 3.4))
viz.plot_gathered_over_time(ax, [m["gathered_trace"] for m in stage3], persistent)
ax.set_title("stage 3, one step: shards (flat line) + gathered units, per rank", fontsize=10)
plt.show()

# %%
trace = stage3[0]["gathered_trace"]
print("events on rank 0:", ", ".join(e for _, e, _ in trace))
root, *blocks = stage3[0]["unit_padded"]
assert stage3[0]["peak_gathered"] == 4 * (root + 2 * max(blocks)) and trace[-1][2] == 0
print(f"peak gathered {fmt_bytes(stage3[0]['peak_gathered'])} = root + 2 blocks; "
      f"everything freed at the end of the step")

# %% [markdown]
# ## 7. What each stage sends, and the same runs with PyTorch's own
#
# An all-reduce is a reduce-scatter followed by an all-gather; on a ring each half moves
# $\frac{N-1}{N}\Psi$ elements per rank. ZeRO 1 and 2 keep the first half for the gradients and
# replace the second by an all-gather of the *parameters*, so they cost what DDP costs. Stage 3
# gathers every weight twice (forward and backward) and reduce-scatters once: three halves,
# $1.5\times$ DDP (Rajbhandari et al. 2020, section 7). Here the root is gathered once, so a
# little less.
#
# The tracer records each collective's logical payload; `ring_bytes` turns it into what a ring
# sends per rank. (gloo's reduce-scatter is really an all-reduce followed by a slice, twice the
# data; NCCL's is a true ring. We count the algorithm, not gloo's shortcut.)
#
# **Predict** the ratio of stage 3's bytes to DDP's for this model: the root is about a tenth
# of the parameters.

# %%
def traced(config):
    cfg = TrainConfig(steps=1, batch_size=12, grad_clip=0.0, progress=False)
    return {s: train_zero(config, cfg, s, trace=True, bucket_cap_mb=0.05).comm_summary for s in range(4)}

comm = run_on_ranks(traced, CONFIG, world_size=N, **RANKS)[0]
ddp = ring_bytes(comm[0], N)
for s in range(4):
    calls = ", ".join(f"{op} x{v['calls']}" for op, v in comm[s].items())
    print(f"stage {s}: {ring_bytes(comm[s], N):>10,.0f} bytes on the ring = {ring_bytes(comm[s], N) / ddp:.3f} x DDP"
          f"   ({calls})")
# byte counts: stages 1 and 2 differ from DDP only by a few padding elements; stage 3 is about 1.45 x (below)
assert abs(ring_bytes(comm[1], N) / ddp - 1) < 1e-3 and abs(ring_bytes(comm[2], N) / ddp - 1) < 1e-3
assert 1.4 < ring_bytes(comm[3], N) / ddp < 1.5

# %% [markdown]
# <details><summary>Answer</summary>
#
# Blocks cost 3 halves and the root 2: $(3 \cdot 0.9 + 2 \cdot 0.1)/2 \approx 1.45$. The
# stage 1 and 2 ratios differ from 1 only by the padding elements.
# </details>
#
# **PyTorch's versions.** `torch.distributed.optim.ZeroRedundancyOptimizer` is stage 1 under
# torch's DDP; `torch.distributed.fsdp.fully_shard` (FSDP2) is stage 3. Same model, same data,
# 2 ranks: the course's stage 1 and stage 3 end with the same parameters and gradients. FSDP2's
# collectives run below the Python API, so `CommDebugMode` counts them: the same calls as ours.

# %% tags=["nbval-ignore-output"]
def ours_and_torch(config, cfg):
    return {"course stage 1": train_zero(config, cfg, 1), "ZeroRedundancyOptimizer": train_native(config, cfg, "zero_redundancy"),
            "course stage 3": train_zero(config, cfg, 3, trace=True), "FSDP2": train_native(config, cfg, "fsdp2", trace=True)}

both = run_on_ranks(ours_and_torch, CONFIG, TRAIN, world_size=2, **RANKS)[0]
for ours, theirs in (("course stage 1", "ZeroRedundancyOptimizer"), ("course stage 3", "FSDP2")):
    diff = (both[ours].final_params - both[theirs].final_params).abs().max().item()
    print(f"{ours} vs {theirs}: largest parameter difference {diff:.1e}")
    assert same_training(both[ours], both[theirs])  # as in section 3
print("course stage 3 per step:", {op: v["calls"] // TRAIN.steps for op, v in both["course stage 3"].comm_summary.items()})
print("FSDP2 per step:         ", {op: v["calls"] // TRAIN.steps for op, v in both["FSDP2"].comm_summary.items()})

# %% [markdown]
# (The all-reduce is gradient clipping's global norm, one scalar; FSDP2's DTensor computes it too.)
# `ZeroRedundancyOptimizer` gives each rank whole parameters (greedily, by size) instead of a
# flat slice, and broadcasts them after the step on top of DDP's all-reduce: $1.5\times$ DDP's
# bytes where ZeRO's reduce-scatter + all-gather costs $1\times$.

# %% [markdown]
# ## 8. Per-parameter sharding (FSDP2): the same stage 3, every name kept
#
# The flat unit of section 2 has a price that shows as soon as other code looks at the model:
# `named_parameters()` yields one `flat_shard` per unit, a 1-D slice that cuts tensors
# anywhere, whose gradient differs on every rank. Code that walks the parameters by name (weight
# decay only on matrices, a per-layer learning rate, freezing a layer, a checkpoint) sees no
# names and no shapes, and cannot tell a sharded weight from a replicated one. PyTorch's FSDP2
# (`fully_shard`), which torchtitan and most new training code use, therefore shards **each
# parameter on its dim 0**: a weight $W$ of $d_0$ rows is cut into blocks of
# $c = \lceil d_0/S \rceil$ rows, kept under $W$'s name with a placement record that says
# which rows ($\texttt{Shard(0)}$, a DTensor in FSDP2). Flat buffers survive only as the
# copy-in and copy-out around each unit's one all-gather.
#
# The two implementations put the padding in different places. **The course's** per-parameter
# shard is padded: every rank holds exactly $c$ rows of every tensor, the last rank's ending in
# zero rows, so the parameter it trains is the very tensor the all-gather sends. **FSDP2's**
# parameter is an unpadded slice with `torch.chunk(dim=0)` semantics ($c$ rows on the first
# ranks, whatever is left on the last, possibly none): `p.to_local()` shows only real rows. The
# all-gather still needs equal pieces, so FSDP2 allocates $c$ rows on every rank and hands out a
# view of the real ones: the zero rows sit in the same storage, past the end of the view
# (PyTorch's `fully_shard` documentation: FSDP2 splits every parameter along dim 0 with
# `torch.chunk`; the storage is measured at the end of this section). Below, the same model goes
# through both.
#
# `apply_zero(model, 3, torch.optim.AdamW, sharding="per_param", policy=...)` builds it. The
# policy chooses the units: `"block"` (each block, plus a root unit), `"whole"`, or module
# classes such as `(nn.Linear, nn.Embedding)`, where every other parameter (the LayerNorms) stays
# **replicated**, its gradient all-reduced. One pool of 4 ranks runs every experiment of this
# section and of section 9's NVMe tier; the cells below read its results.

# %%
def per_param_run(config, cfg, **kw):
    """Rank code: per-parameter stage 3 trained as train_zero does; returns what the cells below read."""
    rank, n = dist.get_rank(), dist.get_world_size()
    tl = Timeline()
    model, opt = apply_zero(GPT(config, seed=cfg.seed), 3, torch.optim.AdamW, sharding="per_param", timeline=tl,
                            **kw, **default_optimizer_kwargs(cfg))
    gathered, grads = watch_gathered(model.per_param), []  # bytes gathered at every hook; grads after backward
    hooks = StepHooks(timeline=tl, sync_gradients=lambda: grads.append(measure_state_bytes(model, opt)["grads"]))
    res = train_loop(model, opt, CharDataset("train", block_size=config.block_size), cfg, hooks,
                     rows=share_rows(rank, n, cfg.batch_size), tracer=CommTracer())
    pp, state = model.per_param, measure_state_bytes(model, opt)
    memory = {"params": state["params"], "grads": max(grads), "optimizer": state["optimizer"],
              "after forward": max(b for what, unit, b in gathered if (what, unit) == ("done", "root")),
              "peak gathered": max(b for _, _, b in gathered)}
    return {"params": torch.cat([t.reshape(-1) for t in full_state_dict(model, opt).values()]),
            "comm": res.comm_summary, "timeline": res.timeline_events, "events": pp.events,
            "calls": pp.gather_calls, "bytes": pp.gather_bytes, "units": [(u.name, u.numel) for u in pp.units],
            "store": opt.store.summary() if opt.store is not None else None, "memory": memory}

def per_param_tour(config, cfg, nvme_dir):
    flat, _ = apply_zero(GPT(config), 3, torch.optim.AdamW, lr=cfg.lr)
    mine, _ = apply_zero(GPT(config), 3, torch.optim.AdamW, sharding="per_param", policy=(nn.Linear, nn.Embedding),
                         lr=cfg.lr)
    out = {"flat": [(name, tuple(p.shape)) for name, p in flat.named_parameters()],
           "per_param": [(name, tuple(p.shape)) for name, p in mine.named_parameters()],
           "replicated": [e.name for u in mine.per_param.units if u.replicate for e in u.entries],
           "fsdp2": [(name, tuple(p.to_local().shape)) for name, p in fsdp2_model(GPT(config)).named_parameters()],
           "trained": train_zero(config, TRAIN, 3, sharding="per_param", policy=(nn.Linear, nn.Embedding))}
    runs = {True: {}, False: {"reshard_after_forward": False}, 2: {"reshard_after_forward": 2},
            "prefetch": {"prefetch": True}, "hsdp": {"hsdp": 2}, "nvme": {"offload": "nvme", "offload_dir": nvme_dir}}
    return out | {name: per_param_run(config, cfg, **kw) for name, kw in runs.items()}

TWO = dataclasses.replace(TRAIN, steps=2, grad_clip=0.0)  # two steps: the second reads the state the first wrote
nvme_dir = tempfile.mkdtemp(prefix="zero_nvme_")  # section 9's optimizer-state files
tour = run_on_ranks(per_param_tour, CONFIG, TWO, nvme_dir, world_size=N, **RANKS)
reference_two = train_zero_reference(CONFIG, TWO)

# %%
flat_names, mine, theirs = tour[0]["flat"], tour[N - 1]["per_param"], dict(tour[N - 1]["fsdp2"])
print(f"flat design, model.named_parameters() on any rank: {flat_names}")
print(f"per-parameter design (Linear and Embedding units), rank {N - 1} of {N}; last column: FSDP2's p.to_local()")
full = dict(GPT(CONFIG).named_parameters())
for name, shape in mine:
    if not name.startswith(("blocks.1", "blocks.2")):
        kind = "replicated" if name in tour[0]["replicated"] else f"rows {(N - 1) * shape[0]}..{N * shape[0] - 1}"
        print(f"  {name:<26} full {str(tuple(full[name].shape)):<10} local {str(shape):<10} {kind:<14} "
              f"FSDP2 {theirs[name]}")
assert [n for n, _ in mine] == list(full)  # every name kept, in the model's own order
assert all(shape[0] == -(-full[n].shape[0] // N) for n, shape in mine if n not in tour[0]["replicated"])
for r in range(N):  # FSDP2 shards every parameter, unpadded: rank r's rows of torch.chunk(dim=0)
    assert tour[r]["fsdp2"] == [(n, tuple(p.chunk(N)[r].shape) if r < len(p.chunk(N)) else (0, *p.shape[1:]))
                                for n, p in full.items()]

# %% [markdown]
# Every name survives with its own rows: `tok_emb.weight` has 97 rows, so each rank holds
# $\lceil 97/4 \rceil = 25$ and the last keeps 22 real rows plus 3 zero rows; the MLP's 127 rows
# leave one padding row. (`blocks.1` and `blocks.2` look the same and are not printed.) Padding
# is now per tensor, not per unit: a few more zeros, the price of keeping tensors whole. FSDP2
# cuts the same rows, but its last rank's parameters hold only real rows: (22, 64) for
# `tok_emb.weight`, 31 rows of the MLP's 127. The zeros that pad them to 25 and 32 rows for the
# all-gather sit in the same storage, outside the view the parameter shows. (FSDP2, wrapping whole
# blocks, also shards the LayerNorms, which the policy here keeps replicated.) Both designs are
# the same $\texttt{Shard(0)}$ layout; they differ only in whether the padding is part of the
# parameter the optimizer sees.
#
# **Why FSDP2 moved** (Zhao et al. 2023 describe FSDP1, built on the flat `FlatParameter`;
# FSDP2 replaced it): with names kept, (1) optimizers and hooks that treat parameters differently by
# name or shape work unchanged; (2) the state dict of each rank is a set of named DTensor shards,
# which torch's distributed checkpoint saves and loads by name, on any number of ranks; (3) a
# parameter already sharded by tensor parallelism (notebook 05) can be sharded again on dim 0
# over the data-parallel dimension of a 2-D mesh, which a flat buffer mixing tensors cannot
# express (notebook 10 composes them). The arithmetic is unchanged, so it trains exactly as one
# process, the replicated LayerNorms included (their gradient is one all-reduce, the same bits
# on every rank, and clipping counts each of their N copies 1/N):

# %%
assert same_training(tour[0]["trained"], reference)  # section 3's criterion, the same 3 clipped steps
print(f"per-parameter stage 3, Linear/Embedding units, LayerNorms replicated: parameters and gradients equal "
      f"the single process's after {TRAIN.steps} steps")

# %% [markdown]
# ### `reshard_after_forward`: what to free after forward
#
# FSDP2 names section 6's choice. With `reshard_after_forward=True` each block is freed after its
# forward and gathered again for its backward; `False` keeps it gathered until its backward
# (ZeRO-2-like traffic, and ZeRO-2-like memory during the step, but the parameters still
# sharded between steps); an int $k$ dividing the shard group keeps $1/k$ of each gathered tensor and
# gathers the rest in backward from only $k$ ranks (inside a node, say). The root unit is
# gathered once per step in every mode.
#
# **Predict:** with $L = 3$ blocks on $S = 4$ ranks, how many all-gathers per step does each mode
# issue, and how many bytes does a rank receive, in terms of each unit's gathered size $P_u$?
#
# <details><summary>Answer</summary>
#
# Forward gathers every unit once: $\sum_u \frac{S-1}{S} P_u$. Backward gathers each block again
# from $k$ ranks: $\sum_{b} \frac{k-1}{k} P_b$, with $k = S$ for `True`, $k = 1$ (nothing) for
# `False`. Calls: $1 + 2L = 7$ for `True` and $k = 2$, $1 + L = 4$ for `False`. So $k = 2$ costs
# as many calls as `True`, but its backward gathers receive $\frac12$ instead of $\frac34$ of
# each block, over the faster links.
# </details>

# %%
units = dict(tour[0][True]["units"])  # local elements S_u of each unit; gathered: P_u = 4 S S_u bytes
P = {u: 4 * N * s for u, s in units.items()}
L = CONFIG.n_layer
print(f"{'mode':<24}{'all-gathers / step':>20}{'bytes received / step':>24}{'formula':>12}")
for mode, k in ((True, N), (False, 1), (2, 2)):
    calls, got = tour[0][mode]["calls"] // TWO.steps, tour[0][mode]["bytes"] // TWO.steps
    want = sum(P[u] * (N - 1) // N for u in P) + sum(P[f"block{i}"] * (k - 1) // k for i in range(L))
    print(f"reshard_after_forward={str(mode):<6}{calls:>17}{got:>24,}{want:>12,}")
    assert calls == 1 + L + (L if k > 1 else 0) and got == want
    assert (tour[0][mode]["params"] - reference_two.final_params).pow(2).mean().sqrt() < TRAIN.lr / 100  # section 3
print("each mode trains as the single process (parameters after", TWO.steps, "steps, section 3's criterion)")

# %% [markdown]
# ### Prefetch in time
#
# Section 6 drew prefetching as memory; here it is time. Each rank gets two lanes: its compute
# (forward, backward, optimizer) and its communication (each unit's all-gather, from issue to
# the moment the data is used, and each unit's gradient reduction). With `prefetch=True` the
# pre-forward hook of block $i$ starts block $i+1$'s all-gather, and the pre-backward hook of
# block $i$ starts block $i-1$'s.
#
# **Predict:** without prefetch, where do the all-gathers sit relative to the compute?
#
# <details><summary>Answer</summary>
#
# In series: a block's gather is issued only when the block is about to run, so compute waits
# for each one. With prefetch the next gather is in flight while the current block computes, so
# the communication bars overlap the forward and backward bars. (On these CPU ranks the
# "network" is the same two cores, so the overlap saves little time here; on GPUs the copy
# engines and the network run beside the SMs.)
# </details>

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(2, 1, figsize=(10, 5.6), sharex=False)
for ax, (name, run) in zip(axes, (("prefetch off", True), ("prefetch on", "prefetch"))):
    viz.plot_prefetch_gantt(ax, [r[run]["timeline"] for r in tour[:2]], title=f"{name}: ranks 0 and 1, two steps")
plt.tight_layout()
plt.show()

# %%
def issued_before_done(events, i):
    """Was block i's all-gather issued before block i-1's forward finished?"""
    return events.index(("gather", f"block{i}")) < events.index(("done", f"block{i - 1}"))

for name, run in (("prefetch off", True), ("prefetch on", "prefetch")):
    early = [issued_before_done(tour[0][run]["events"], i) for i in range(1, L)]
    print(f"{name}: block i+1's gather issued while block i computes: {early}")
    assert all(early) == (run == "prefetch") and any(early) == (run == "prefetch")

# %% [markdown]
# ### HSDP: shard inside a group, replicate across groups
#
# Hybrid sharding (Zhao et al. 2023) arranges the N ranks as an $R \times S$ mesh:
# each of the $R$ replicas is a shard group of $S$ ranks (a node) that all-gathers and
# reduce-scatters inside itself; then the reduced shard, $1/S$ of the gradient, is all-reduced
# across the $R$ replicas, as DDP would. The gathers stay on the fast links and only gradients
# cross the slow ones, at the price of $R$ times the shard memory. Here `hsdp=2` on the 4 ranks:
# a 2 x 2 mesh.
#
# **Predict:** per step, what does a rank hand to the reduce-scatter and to the all-reduce, in
# terms of its local elements $S_u$ per unit (fp32)?
#
# <details><summary>Answer</summary>
#
# The reduce-scatter takes the whole padded gradient of the unit, $4 S S_u$ bytes with $S = 2$;
# the all-reduce one reduced shard, $4 S_u$ bytes. On a ring the shard dimension sends
# $\frac{S-1}{S}$ of the first and the replicate dimension $2\frac{R-1}{R}$ of the second.
# </details>

# %%
hsdp = tour[0]["hsdp"]
local = [s for _, s in hsdp["units"]]
want = hsdp_payloads(local, replicas=2, shards=2)
got = {"shard": hsdp["comm"]["reduce_scatter_single"]["bytes_sent"] // TWO.steps,
       "replicate": hsdp["comm"]["all_reduce"]["bytes_sent"] // TWO.steps}
print(f"per step, rank 0: reduce-scatter in the shard group {got['shard']:,} bytes (formula {want['shard']:,}); "
      f"all-reduce across replicas {got['replicate']:,} bytes (formula {want['replicate']:,})")
S, R = 2, 2  # ring: (S-1)/S of the reduce-scatter (the all-gathers are counted so already), 2(R-1)/R of the all-reduce
print(f"on a ring: shard dim {got['shard'] * (S - 1) // S + hsdp['bytes'] // TWO.steps:,} bytes "
      f"(reduce-scatter + all-gathers), replicate dim {got['replicate'] * 2 * (R - 1) // R:,} bytes")
assert got == want
assert (hsdp["params"] - reference_two.final_params).pow(2).mean().sqrt() < TRAIN.lr / 100  # section 3
print("HSDP 2 x 2 trains as the single process")

# %% [markdown]
# ### Memory per rank: the modes against the estimator
#
# The same runs recorded what rank 0 holds: its shards, their gradients at the end of backward,
# AdamW's m and v, and at every hook the bytes gathered (padded tensors, an all-gather's output
# until it is copied out, the $1/k$ pieces). `per_param_memory` computes each from the parameter
# shapes alone: $\lceil d_0/S \rceil$ rows of every tensor, padding included; after forward the
# root plus, per block, nothing (`True`), all of it (`False`) or $1/k$ of it ($k$); HSDP shards over
# $S = N/R$ ranks only.
#
# **Predict:** which mode holds the most gathered bytes between forward and backward, and what
# does HSDP 2 x 2 do to the shard bytes?
#
# <details><summary>Answer</summary>
#
# `False`: every block stays gathered until its backward ($k = 2$ keeps half of each, `True` none).
# HSDP shards over 2 ranks instead of 4, so each rank holds about twice the state (a little
# less: fewer padding rows), the price of keeping the gathers inside a group.
# </details>

# %%
one = GPT(CONFIG)  # policy "block": the root (everything outside the blocks), then each block
unit_shapes = [[tuple(p.shape) for n, p in one.named_parameters() if not n.startswith("blocks.")]]
unit_shapes += [[tuple(p.shape) for p in block.parameters()] for block in one.blocks]
KEYS = ("params", "grads", "optimizer", "after forward", "peak gathered")
print(f"{'bytes, rank 0 of ' + str(N):<21}" + "".join(f"{k:>15}" for k in KEYS))
for label, run, kw in (("True", True, {}), ("False", False, {"reshard_after_forward": False}),
                       ("k = 2", 2, {"reshard_after_forward": 2}), ("HSDP 2 x 2", "hsdp", {"hsdp": 2})):
    e = per_param_memory(unit_shapes, N, **kw)
    est = {"params": e["params"], "grads": e["grads"], "optimizer": e["optimizer"],
           "after forward": e["gathered_after_forward"], "peak gathered": e["gathered_peak"]}
    print(f"{label:<11} measured " + "".join(f"{tour[0][run]['memory'][k]:>15,}" for k in KEYS))
    print(f"{'':<11} estimate " + "".join(f"{est[k]:>15,}" for k in KEYS))
    assert all(r[run]["memory"] == est for r in tour), label  # exactly, on every rank

# %% [markdown]
# Each measured figure equals the estimate exactly, on every rank: the per-tensor padding and
# the rule of what stays gathered are all there is to a rank's bytes (the peak counts the unit
# being gathered twice, its padded tensors and the all-gather's output).

# %% [markdown]
# ### The same step under PyTorch's MemTracker
#
# At work you will not write a counter for every kind of tensor: PyTorch ships one.
# `torch.distributed._tools.mem_tracker.MemTracker` (a private module: its name and calls may
# change between torch versions) is a `TorchDispatchMode`, so it sees every tensor an operator
# returns, and it files each storage under a category by **when** it was made: during forward
# "Activation", during backward "Temp", inside an optimizer step "Optstate"; module parameters
# and buffers, and gradients (through gradient hooks), by registration. `track_external(model,
# optimizer, batch)` registers what exists before it starts (a plain tensor files as "Other");
# `get_tracker_snapshot()` returns `{device: {category: bytes}}` now, and
# `get_tracker_snapshot("peak")` the split at the moment the tracked total was largest;
# `display_snapshot("peak", units="MiB")` prints it (its KiB, MiB and GiB are powers of 2, as the
# course's). Its sibling `FSDPMemTracker` (`torch.distributed._tools.fsdp2_mem_tracker`) accepts
# only modules wrapped by torch's own `fully_shard`: it hooks FSDP2's gathers and reductions and
# files their tensors under FSDP's own names ("Sharded Param", "Unsharded Param", "Sharded
# Grad", "All Gather", ...).
#
# `memory_three_ways` runs one step of this section's per-parameter stage 3 (policy "block",
# AdamW, fp32, 3 sequences per rank) with MemTracker around it on every rank, and in the same
# step the course's own measurement (`measure_state_bytes`, and notebook 01's saved-tensor hooks
# with the model state left out), beside the formulas (`per_param_memory`, notebook 01's
# `activation_bytes`). Then the same step with torch's FSDP2 (section 7's `fsdp2_model`) under
# `FSDPMemTracker`, as a fourth column.
#
# **Predict:** (1) Will MemTracker's parameter and gradient bytes equal the course's exactly? For
# the optimizer state, and for "Activation" right after forward, will it report more or less
# than the course counts (AdamW's m and v; the tensors saved for backward), and why? (2) On the
# last rank, whose FSDP2 parameters have fewer rows (`p.to_local()`, above), will
# `FSDPMemTracker`'s parameter bytes be below the formula's?
#
# <details><summary>Answer</summary>
#
# (1) Parameters and gradients: exactly, they are the same tensors (the local shards and their
# gradients). Optimizer state: a little more. AdamW also keeps a step counter per parameter, a
# 0-dim fp32 tensor, which MemTracker counts and the course leaves out (it is not per-element
# state). Activations: more. MemTracker calls "Activation" everything forward made that is still
# alive, whatever holds it: besides the saved tensors, the root unit's gathered weights (kept
# until the end of backward, section 6) and the loss itself.
#
# (2) No: equal. A tracker counts storages, not tensors, and FSDP2's short parameter is a view
# into a storage of $c$ padded rows (torch's `FSDPParam` allocates the padded shard and narrows
# it). Only AdamW's m and v, made with the parameter's shape, are shorter there.
# </details>

# %%
why = memtracker_missing()  # None on this torch; one sentence on a torch without the private APIs
if why is not None:
    print(why)
else:
    three = memory_three_ways(CONFIG, N, TRAIN.batch_size, **RANKS)
    last = three[N - 1]
    print(format_three_ways(last))
    n_tensors = len(list(GPT(CONFIG).parameters()))
    f, c, m, t, parts = last["formula"], last["course"], last["memtracker"], last["fsdp2"], last["parts"]
    print(f"optimizer state: MemTracker - course = {m['optimizer'] - c['optimizer']:,} bytes, AdamW's step counters "
          f"(4 bytes for each of the {n_tensors} parameter tensors); FSDP2: m and v of its {t['local']:,} bytes of "
          f"unpadded rows, 2 x {t['local']:,} + {parts['step counters']} = {t['optimizer']:,}")
    print(f"activations: course - formula = {c['activations'] - f['activations']} bytes, the total weight the "
          f"cross-entropy saves to divide by (0-dim fp32)")
    print(f"activations: MemTracker - course = {m['activations'] - c['activations']:,} bytes, the root unit's "
          f"gathered weights {parts['gathered after forward']:,} + the loss {parts['loss']}; "
          f"FSDPMemTracker - course = {t['activations'] - c['activations']} bytes, the loss")
    phase = "in backward (Temp > 0)" if last["peak_split"].get("Temp", 0) else "outside backward"
    print(f"MemTracker's peak on rank {N - 1}: {last['peak']:,} bytes, {phase}: "
          + ", ".join(f"{k} {v:,}" for k, v in last["peak_split"].items()))
    for r in three:  # every rank, byte for byte
        f, c, m, t, parts = r["formula"], r["course"], r["memtracker"], r["fsdp2"], r["parts"]
        assert all(f[k] == c[k] for k in ("params", "grads", "optimizer"))
        assert m["params"] == c["params"] == t["params"] and m["grads"] == c["grads"] == t["grads"]
        assert m["optimizer"] - c["optimizer"] == parts["step counters"] == 4 * n_tensors
        assert t["optimizer"] == 2 * t["local"] + parts["step counters"]
        assert c["activations"] - f["activations"] == parts["loss total weight"] == 4
        assert parts["gathered after forward"] == parts["gathered after forward (formula)"] == t["gathered after forward"]
        assert m["activations"] - c["activations"] == parts["gathered after forward"] + parts["loss"]
        assert t["activations"] - c["activations"] == parts["loss"]
        assert r["peak"] >= m["params"] + m["activations"]  # a maximum over the step includes the end of forward
    assert three[0]["fsdp2"]["local"] == three[0]["formula"]["params"] > last["fsdp2"]["local"]

# %% [markdown]
# Parameters and gradients agree in all four columns to the byte, on every rank, and the other
# two rows differ by exactly the parts printed under the table, each measured in the same step.
# The activation row is the lesson: MemTracker files a storage by *when* it was made, not by
# *why* it is alive, so a weight ZeRO-3 gathers in forward is, for it, an activation. The
# formula and the course count what autograd needs for backward, which is what recomputation
# (notebook 04) can trade away; the gathered root is model state that stage 3 chose to keep.
# `FSDPMemTracker` knows FSDP2's hooks, so its "Activation" is the course's saved tensors plus
# the loss, and the gathered root appears as "Unsharded Param", the formula's
# `gathered_after_forward`. And it corrects a reading of section 8: FSDP2's last rank shows
# fewer rows, but its parameter storages hold the padded $c$ rows, as the course's do; the zeros
# the all-gather needs sit in the parameter's own storage, past the rows it shows.
#
# What the trackers give that the course's counters do not: they need no knowledge of the
# strategy, they keep a snapshot per module before and after each forward and backward
# (`display_modulewise_snapshots(depth=2, units="MiB")`), and a peak over the whole step. The
# peak is taken after each operator they see, so a temporary made and freed inside one C++
# kernel escapes it (on a GPU, `torch.cuda.max_memory_allocated` sees those). And on a GPU they
# round every storage up to 512 bytes, the caching allocator's smallest block, so their columns
# there exceed numel times element size.

# %% [markdown]
# ## 9. Offload: the optimizer on the host
#
# ZeRO-Offload (Ren et al. 2021) keeps the fp32 master weights and Adam's moments in CPU
# memory and runs the step there. Per step and rank, the gradient shard goes down the PCIe link
# and the updated bf16 weight shard comes back: $2S$ bytes each way. On these CPU ranks host
# and device are the same memory, so nothing really moves; the library counts what would cross
# the link (on a GPU the tensors really move):

# %%
off = measured[0][(2, "offload")]
print(f"per step: {off['offload']['to_host']:,} bytes to the host, {off['offload']['to_device']:,} back; "
      f"optimizer state on the device {off['after_step']['optimizer']:,} bytes, on the host "
      f"{off['after_step']['host']:,}")
assert off["offload"] == offload_bytes_per_step(N_PARAMS, N)

# %% [markdown]
# Whether that is affordable is arithmetic. ZeRO-Offload's headline (Ren et al. 2021, abstract)
# is a model of over 13 billion parameters trained on a single GPU, ten times what PyTorch alone
# fits, with 40 TFLOP/s on one V100 for a 10B model. Take 10B parameters on one H100:
# $2 \times 20$ GB cross a PCIe 4 x16 link (32 GB/s each way) per
# step, and the CPU's Adam reads and writes about 28 bytes per parameter at, say, 100 GB/s of
# host memory bandwidth. The GPU's forward and backward take $6\Psi$ FLOPs per token (989
# TFLOP/s bf16 at 40 % MFU on an H100):

# %%
tokens = [2**k for k in range(10, 19)]
fig, ax = plt.subplots(figsize=(7, 3.4))
times = viz.plot_offload_time(ax, 10_000_000_000, 1, tokens)
ax.set_title("10B parameters on one GPU with ZeRO-Offload", fontsize=10)
plt.show()
crossing = next(t for t, c in zip(tokens, times["compute"]) if c > times["host step"][0])
print(f"PCIe {times['pcie'][0]:.2f} s, host Adam {times['host step'][0]:.2f} s per step; compute passes the "
      f"host step from {crossing:,} tokens per GPU per step")

# %% [markdown]
# Below the crossing printed above the GPU waits for the host, and here the CPU's Adam, not
# the PCIe link, is the slower part. ZeRO-Offload answers with a vectorised CPU Adam and a *one-step
# delayed* update that overlaps the host step with the next forward/backward. With N GPUs each
# moves only its 1/N shard over its own PCIe link, so the transfer time falls by N. The host step
# does not: the GPUs of a node share its CPUs and memory bandwidth, so a node of G GPUs updates G
# shards, $\Psi/\text{nodes}$ parameters, on one host. Host-side Adam time falls with the number
# of **nodes**, not of GPUs: 8 GPUs in one node wait as long for their host as one GPU holding the
# whole model.
#
# ### The NVMe tier (ZeRO-Infinity)
#
# ZeRO-Infinity (Rajbhandari et al. 2021) takes offload one tier further, to the node's NVMe
# drives. The per-parameter design of section 8 offers it as `offload="nvme", offload_dir=DIR`:
# Adam's m and v (8 bytes per local element, fp32) live in one memory-mapped file per unit and
# rank under DIR; around the step, unit by unit, they are read into a host buffer, the unit's
# shards are stepped, and m and v are written back. The run of section 8's pool used it.
#
# **Predict:** per step and rank, in terms of each unit's local elements $S_u$: bytes read from
# the disk, bytes written, and the largest host buffer? Are the parameters equal to those of the
# same run without offload to rounding, or bit for bit?
#
# <details><summary>Answer</summary>
#
# Read and written: $8 \sum_u S_u$ each (m and v of every local element). Host buffer: one
# unit at a time, $8 \max_u S_u$, so host memory stays bounded whatever the model size. Bit for
# bit: AdamW is element-wise, so stepping unit by unit does the same arithmetic on the same
# numbers; the files only hold them between steps.
# </details>

# %%
store, local = tour[0]["nvme"]["store"], sum(units.values())
print(f"rank 0 per step: read {store['nvme_read'] // TWO.steps:,} bytes from its files, wrote "
      f"{store['nvme_written'] // TWO.steps:,}; files {store['nvme_files']:,} bytes; largest host buffer "
      f"{store['host_peak']:,} bytes (formula: 8 x {local:,} elements, 8 x {max(units.values()):,} for the largest unit)")
assert store["nvme_read"] == store["nvme_written"] == TWO.steps * 8 * local and store["nvme_files"] == 8 * local
assert store["host_peak"] == 8 * max(units.values())
assert all(torch.equal(r["nvme"]["params"], r[True]["params"]) for r in tour)  # the same arithmetic: bit for bit
print(f"NVMe offload: parameters bit for bit those of the run without offload on all {N} ranks")

# %% [markdown]
# Is the disk fast enough? Per step a node reads and writes the m and v of its share,
# $\Psi/\text{nodes}$ parameters: $8\Psi/\text{nodes}$ bytes each way. The GPUs of the node
# compute $6\Psi t$ FLOPs each for $t$ tokens per GPU. The disk time can hide behind compute (a
# real system reads the next unit's state while it steps this one; the course's store takes them
# in turn) only when
# $8\Psi/\text{nodes}\,(1/B_r + 1/B_w) \le 6\Psi t / (\text{peak} \cdot \text{MFU})$, so
# $\Psi$ cancels and the tokens per GPU per step needed are
# $t^* = 8 (1/B_r + 1/B_w)\,\text{peak}\cdot\text{MFU} / (6\,\text{nodes})$. Below $t^*$ the
# offload costs more step time than it saves. With this machine's disk, measured now (the
# read comes right after the write, so the page cache may serve it: an upper bound):

# %% tags=["nbval-ignore-output"]
bw = disk_bandwidth(nvme_dir, nbytes=32 * 2**20)
shutil.rmtree(nvme_dir)
peak_mfu = 989e12 * 0.4  # an H100's bf16 at 40 % MFU, as above
t_star = {nodes: 8 * (1 / bw["read"] + 1 / bw["write"]) * peak_mfu / (6 * nodes) for nodes in (1, 8, 64)}
print(f"disk here: write {bw['write'] / 1e9:.2f} GB/s (fsynced), read {bw['read'] / 1e9:.2f} GB/s")
print("tokens per GPU per step that hide the NVMe traffic: "
      + ", ".join(f"{t:,.0f} with {nodes} node(s)" for nodes, t in t_star.items()))
assert bw["write"] > 0 and bw["read"] > 0  # rates of real transfers: positive, whatever the disk
assert abs(t_star[1] / t_star[8] - 8) < 1e-9  # the formula: 1/nodes (float rounding only)

# %% [markdown]
# Like the host step, the disk is shared by a node's GPUs, so $t^*$ falls with the number of
# nodes, not of GPUs. ZeRO-Infinity adds what this sketch leaves out: parameters and master
# weights on NVMe too, reads spread over all drives of all nodes, and overlap of the transfers
# with compute.
#
# ## 10. ZeRO against tensor and pipeline parallelism
#
# The same 8 GPUs can hold Llama-3 8B three ways. Memory per GPU from notebook 01's estimator
# (8 sequences of 4,096 tokens per step, bf16 + AdamW, no recomputation), bytes each GPU sends
# per step from the formulas of this notebook and notebooks 05 and 06:

# %%
print(f"{'layout':<20}{'model state':>13}{'activations':>13}{'total':>11}{'sent/step':>12}")
for row in viz.layout_comparison(LLAMA3_8B, gpus=8, seq=4096, sequences=8):
    print(f"{row['layout']:<20}{fmt_bytes(row['model_state']):>13}{fmt_bytes(row['activations']):>13}"
          f"{fmt_bytes(row['total']):>11}{fmt_bytes(row['sent_per_step']):>12}")

# %% [markdown]
# ZeRO-3 and tensor parallelism shrink the model state alike; the difference is *what* they
# send and *when*. ZeRO-3 moves weights, a fixed $3\Psi$ per step whatever the batch, and the
# gathers can run ahead of compute (prefetch), so it tolerates slower links (it is the default
# across nodes). Tensor parallelism moves activations, growing with the batch, in blocking
# all-reduces inside every layer, so it needs NVLink-class bandwidth and stays within a node.
# Pipeline parallelism sends the least but idles in its bubbles (notebook 06). Real runs
# combine them (notebook 10): TP inside a node, pipeline stages across, ZeRO/FSDP over the
# data-parallel replicas.
#
# ## 11. The same knobs in DeepSpeed and PyTorch FSDP2
#
# | course (`apply_zero`) | DeepSpeed `zero_optimization` | PyTorch FSDP2 |
# |---|---|---|
# | `stage=1/2/3` | `"stage": 1/2/3` | stage 3 = `fully_shard(module)`; stage 2 ≈ `reshard_after_forward=False` |
# | flat unit per block | `stage3_param_persistence_threshold`, `stage3_max_live_parameters` | one `fully_shard` call per block = one unit |
# | `bucket_cap_mb` (stage 2) | `reduce_bucket_size`, `overlap_comm`, `contiguous_gradients` | one reduce-scatter per unit |
# | `prefetch=True` | `stage3_prefetch_bucket_size` | implicit (next unit in forward/backward order) |
# | `compute_dtype=torch.bfloat16` | `"bf16": {"enabled": true}` | `mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)` |
# | `offload=True` | `offload_optimizer: {"device": "cpu"}` (and `offload_param` for stage 3) | `offload_policy=CPUOffloadPolicy()` |
# | root kept gathered | `stage3_param_persistence_threshold` keeps small tensors whole | root: `reshard_after_forward=False` by default |
# | `sharding="per_param"` (section 8) | stage 3 already partitions tensor by tensor, but as flattened 1-D pieces | the only design: each parameter a DTensor, `Shard(0)` |
# | `policy="block"` / `(nn.Linear, nn.Embedding)` | (units follow the modules) | one `fully_shard` call per chosen module, then the root |
# | `param_dtype`, `reduce_dtype` | `"bf16"`, `communication_data_type` | `MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)` |
# | `reshard_after_forward=True/False/k` | `stage3_max_reuse_distance`; ZeRO++'s `zero_hpz_partition_size` for $k$ | `fully_shard(..., reshard_after_forward=True/False/k)` |
# | `hsdp=R` (section 8) | MiCS: `mics_shard_size` | `fully_shard(model, mesh=...)` on a 2-D (replicate, shard) mesh |
# | `offload="nvme", offload_dir=DIR` (section 9) | `offload_optimizer: {"device": "nvme", "nvme_path": DIR}` | none built in (host only) |
#
# **HSDP** as FSDP2 writes it: `fully_shard(model, mesh=init_device_mesh("cuda", (nodes, 8),
# mesh_dim_names=("replicate", "shard")))`. The gathers stay on NVLink, and across nodes only
# the reduced gradient shards are all-reduced (section 8 measured both dimensions), at the price
# of N/8 times the shard memory. DeepSpeed's ZeRO++ (Wang et al. 2023) keeps a secondary copy of
# the parameters sharded within a node (`zero_hpz_partition_size`, the int `reshard_after_forward`)
# and adds quantised gathers.
#
# ## 12. Try it: model, dp and stage
#
# The widget computes per-GPU model state for each stage (bf16 + fp32 AdamW) and what each GPU
# sends per step. Find the smallest dp at which Llama-3 70B fits an 80 GB H100 under stage 1,
# 2 and 3 (before activations).
#
# <details><summary>Answer</summary>
#
# Llama-3 70B has $\Psi \approx 70.6 \cdot 10^9$ parameters. Stages 1 and 2 never fit, at any
# dp: they keep the bf16 weights whole ($2\Psi \approx 141$ GB), stage 1 the gradients too
# ($4\Psi$ in all). Stage 3 needs $16\Psi/N \le 80$ GB, $N \ge 14.1$: among the widget's
# powers of two, dp = 16 (70.6 GB per GPU), which leaves under 10 GB for activations.
# </details>

# %% tags=["nbval-ignore-output"]
from course_lib.widgets import show_interactive

show_interactive(lambda: viz.zero_view(), lambda: viz.zero_widget())

# %%
def smallest_dp(stage, model="Llama-3 70B"):  # the answer above, from the widget's own table
    return next((dp for dp in viz.DP_CHOICES
                 if viz.paper_table(viz.MODELS[model], dp)[stage]["total"] <= viz.H100_BYTES), None)

assert [smallest_dp(s) for s in (1, 2, 3)] == [None, None, 16]

# %% [markdown]
# ## 13. Muon: an optimizer that needs whole matrices
#
# Everything above relied on section 2's argument: the optimizer is element-wise, so a rank can
# step any slice of the flat buffer. **Muon** (Jordan et al. 2024; Liu et al. 2025 trained a
# 16B-parameter mixture of experts with it) is not. For each hidden weight matrix $W$ it keeps a
# momentum $B$ and
# orthogonalises the update before applying it:
#
# $$B \leftarrow \mu B + (1-\mu) G, \qquad O = \mathrm{NS}_5\big((1-\mu) G + \mu B\big), \qquad
# W \leftarrow W(1 - \eta\lambda) - \eta' O$$
#
# where $\mathrm{NS}_5$ is five Newton-Schulz steps $X \leftarrow aX + (bA + cA^2)X$ with
# $A = XX^\top$, $(a, b, c) = (3.4445, -4.7750, 2.0315)$, started from $X = U/\lVert U\rVert_F$:
# an odd polynomial of $X$, so it keeps $U$'s singular vectors and pushes every singular value
# towards 1 (into roughly 0.5-1.5, which Jordan et al. found is enough). Embeddings, the head and
# 1-D parameters stay with AdamW. `course_lib.techniques.muon.Muon` equals PyTorch's
# `torch.optim.Muon` bit for bit; `muon_split(model)` makes the two groups.
#
# $A = XX^\top$ mixes every row of the matrix with every other: each output element depends on
# the whole matrix. Here is the course GPT's flat buffer (section 2) at $N = 4$, with its hidden
# matrices coloured:

# %%
from course_lib.demos.zero import MUON_LOSS_ATOL, check_muon, muon_demo
from course_lib.estimate.muon import METHODS, flops_per_rank, load_imbalance, muon_traffic, newton_schulz_flops
from course_lib.techniques.muon import MuonAdamW, muon_split

model = GPT(CONFIG)
unit = FlatUnit(list(model.parameters()), N, 0)
hidden = {id(p) for p in muon_split(model)[0]}
names = {id(p): n for n, p in model.named_parameters()}
fig, ax = plt.subplots(figsize=(10, 1.9))
spanning, colours = [], [c for j, c in enumerate(plt.cm.tab10.colors) if j != 7]  # tab10 without its grey
for i, (p, off, n) in enumerate(zip(unit.params, unit.offsets, unit.numels)):
    crosses = off // unit.shard_numel != (off + n - 1) // unit.shard_numel
    if id(p) in hidden:
        ax.barh(0, n, left=off, color=colours[i % 9], edgecolor="black",
                linewidth=0.3, hatch="///" if crosses else None)
        if crosses:
            spanning.append(names[id(p)])
    else:
        ax.barh(0, n, left=off, color="0.85", edgecolor="0.6", linewidth=0.3)
for r in range(1, N):
    ax.axvline(r * unit.shard_numel, color="red", linewidth=2)
for r in range(N):
    ax.text((r + 0.5) * unit.shard_numel, 0.55, f"shard {r}", ha="center", color="red")
ax.set_xlim(0, unit.padded_numel)
ax.set_ylim(-0.5, 0.8)
ax.set_yticks([])
ax.set_xlabel("flat index (colour: a hidden matrix, hatched where it spans a boundary; grey: the rest)")
ax.set_title(f"the flat buffer at N = {N}: red lines are shard boundaries")
plt.show()
print(f"{len(spanning)} of {len(hidden)} hidden matrices span a shard boundary: {', '.join(spanning)}")
assert spanning  # the prose below: some matrix lies on both sides of a boundary

# %% [markdown]
# A rank holding part of such a matrix cannot orthogonalise "its part": the Newton-Schulz of a
# piece is not the piece of the Newton-Schulz. Some rank has to hold the whole momentum update.
# `course_lib.parallel.zero.muon.ShardedMuon` keeps each matrix's momentum as $N$ row blocks of
# $c = \lceil d_0/N \rceil$ rows (section 8's per-parameter rule), reduce-scatters the gradient
# into them, updates the momentum element-wise, and then gets the orthogonalised update one of
# three ways:
#
# * **gather**: all-gather each matrix's update, every rank runs Newton-Schulz on every matrix
#   and keeps its own rows (Liu et al. 2025's "Distributed Muon" over ZeRO-1). Simple; the same
#   work $N$ times.
# * **owner**: each matrix has one owner rank (dealt out in order, rank $i \bmod N$), which
#   gathers it, runs Newton-Schulz once and scatters the rows back (in bf16, Newton-Schulz's
#   output dtype).
# * **balanced**: the same, but owners chosen largest matrix first onto the least-loaded rank
#   (greedy longest-processing-time scheduling, Graham 1969).
#
# Each rank then updates its rows of $W$ and all-gathers them (ZeRO-1's last step). Per matrix
# and rank, with $s = c \cdot d_1$ elements per block, $e = 4$ bytes, as the tracer counts
# payloads (`course_lib.estimate.muon`):
#
# | call | gather | owner / balanced |
# |---|---|---|
# | reduce-scatter of the gradient | sent $Nse$, received $se$ | same |
# | the update to the orthogonaliser | all-gather: sent $se$, received $Nse$ | gather: sent $se$; the owner receives $Nse$ |
# | the orthogonalised rows back | (none: every rank has them) | scatter: the owner sends $2Ns$; every rank receives $2s$ |
# | all-gather of the updated rows | sent $se$, received $Nse$ | same |
#
# **Predict before running.** The demo's GPT has 8 hidden matrices (per block: qkv $192\times64$,
# the attention projection $64\times64$, the MLP's $256\times64$ and $64\times256$). At $N = 4$:
# how many Newton-Schulz runs does one step make under gather, and under owner? Under owner,
# which ranks do the most of them (in FLOPs), and does balanced make the four ranks equal?

# %%
muon_runs = {m: run_on_ranks(muon_demo, m, 3, 8 * N, world_size=N, **RANKS) for m in METHODS}
print(f"{'method':<10}{'rank':>5}{'sent / step':>14}{'received / step':>17}{'NS MFLOP / step':>17}")
for m, out in muon_runs.items():
    shapes = out[0]["shapes"]
    flops = flops_per_rank(shapes, N, m)
    for r, o in enumerate(out):
        sent = sum(v["bytes_sent"] for v in o["bytes"].values())
        recv = sum(v["bytes_recv"] for v in o["bytes"].values())
        print(f"{m:<10}{r:>5}{fmt_bytes(sent):>14}{fmt_bytes(recv):>17}{o['ns_flops'] / 1e6:>17.1f}")
        assert o["bytes"] == muon_traffic(shapes, N, m)[r]  # every call's bytes: the formula, exactly
        assert o["ns_flops"] == flops[r]  # counted on the rank = the formula
    assert check_muon(out)[0]  # losses within MUON_LOSS_ATOL of one process, every step
    total = sum(sum(v["bytes_recv"] for v in o["bytes"].values()) for o in out)
    print(f"{'':<10}{'all':>5}{'':>14}{fmt_bytes(total):>17}{sum(flops) / 1e6:>17.1f}"
          f"   NS imbalance (max / mean) {load_imbalance(flops):.2f}")
shapes = muon_runs["owner"][0]["shapes"]
runs = {m: len(shapes) * (N if m == "gather" else 1) for m in METHODS}
owner, balanced = flops_per_rank(shapes, N, "owner"), flops_per_rank(shapes, N, "balanced")
received = {m: sum(sum(v["bytes_recv"] for v in o["bytes"].values()) for o in out) for m, out in muon_runs.items()}
print(f"Newton-Schulz runs per step: gather {runs['gather']}, owner {runs['owner']}; "
      f"every method's losses within {MUON_LOSS_ATOL:.0e} of one process")
big = newton_schulz_flops((14336, 4096))
print(f"one Llama-3 8B MLP matrix (14336 x 4096): {big / 1e12:.1f} TFLOP of Newton-Schulz, "
      f"{big / 989e12 * 1e3:.1f} ms at an H100's 989 TFLOP/s (dense bf16)")
# the answer below
assert (runs["gather"], runs["owner"]) == (32, 8)
assert max(owner) == owner[2] == owner[3] == 3 * min(owner) == 3 * owner[1]
assert (round(load_imbalance(owner), 2), round(load_imbalance(balanced), 2)) == (1.29, 1.14)
assert received["owner"] < received["gather"] and received["balanced"] < received["gather"]

# %% [markdown]
# <details><summary>Answer</summary>
#
# Gather runs Newton-Schulz on all 8 matrices on each of the 4 ranks: 32 runs, four times the
# FLOPs of one process. Owner runs each matrix once: 8 runs, the total of one process. Dealt in
# order, rank $i$ owns matrices $i$ and $i + 4$, the same layer position in both blocks: ranks 2
# and 3 get the two large MLP matrices ($256 \times 64$), rank 1 the two small projections, so
# the busiest rank does 3 times the work of the lightest (imbalance 1.29 above). Balanced gives
# the four MLP matrices to four different ranks first, then the qkv and projection matrices to
# the least loaded: closer (1.14), not equal, because 8 matrices of 3 sizes cannot be split into
# 4 equal sums. In bytes, owner and balanced also move less in all than gather: only the owner
# receives a matrix's whole update, once, and the rows go back in bf16.
# </details>
#
# On GPUs the choice is mostly about compute: one large MLP matrix's Newton-Schulz takes
# milliseconds of a GPU (the last line printed above), and gather repeats it on every rank for
# every matrix; owner runs it once, and only the owner holds the whole matrix. Balancing matters
# when matrices differ in size (the MLP's against attention's), as here.
#
# Does Muon help on the course's model? The same GPT, the same batches, 60 steps with AdamW on
# everything (the course's learning rate, 3e-3) and with Muon on the hidden matrices (Jordan et
# al.'s 0.02) plus AdamW on the rest:

# %% tags=["nbval-ignore-output"]
def one_optimizer(config, cfg):
    """Rank 0 trains with AdamW, rank 1 with Muon + AdamW: two single-process runs side by side."""
    rank = dist.get_rank()
    if rank > 1:
        return None
    m = GPT(config, seed=cfg.seed)
    opt = (torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=0.0) if rank == 0
           else MuonAdamW(m, lr=0.02, adamw_lr=cfg.lr))
    return train_loop(m, opt, CharDataset("train", block_size=config.block_size), cfg).train_losses


cmp_cfg = TrainConfig(steps=60, batch_size=16, grad_clip=0.0, progress=False)
pair = run_on_ranks(one_optimizer, CONFIG, cmp_cfg, world_size=N, **RANKS)
curves = {"AdamW": pair[0], "Muon + AdamW": pair[1]}
fig, ax = plt.subplots(figsize=(6, 3))
for name, losses in curves.items():
    ax.plot(range(1, len(losses) + 1), losses, label=name)
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.legend()
plt.show()
last = {name: sum(l[-10:]) / 10 for name, l in curves.items()}
print(f"mean loss over steps 51-60: AdamW {last['AdamW']:.3f}, Muon + AdamW {last['Muon + AdamW']:.3f}")
# the lesson's claim for this model, with a margin far above the run-to-run rounding (~1e-5):
assert last["Muon + AdamW"] < last["AdamW"] - 0.1

# %% [markdown]
# On this small model, over these 60 steps, Muon's run ends clearly lower (the printed means
# differ by more than 0.1). That is one small model (its parameter count is printed at the top)
# at two fixed learning rates, not a claim about large runs; there, Liu et al. (2025) measured
# about 2x the compute efficiency of AdamW in scaling-law experiments, with weight decay and the
# per-matrix update scale (`adjust_lr_fn="match_rms_adamw"`) added.

# %% [markdown]
# ## What to remember
#
# * ZeRO shards what data parallelism replicates: stage 1 the optimizer state, stage 2 the
#   gradients, stage 3 (FSDP) the parameters; per GPU $(4+K)\Psi$, $4\Psi + K\Psi/N$,
#   $2\Psi + (2+K)\Psi/N$, $(4+K)\Psi/N$ bytes in bf16 with $K = 12$.
# * Shards are slices of a flat, padded buffer; exact for element-wise optimizers only.
# * Stages 1-2 cost DDP's bytes (reduce-scatter + all-gather = all-reduce); stage 3 costs
#   1.5x, in exchange for dividing everything by N; prefetching hides the gathers.
# * The flat buffer is one design; FSDP2 shards each parameter on dim 0 and keeps its name, so
#   optimizers, state dicts and tensor parallelism see real tensors. The course pads each
#   parameter's shard to $\lceil d_0/N \rceil$ rows; FSDP2's shard shows only real rows
#   (`torch.chunk`), a view of a padded storage. `reshard_after_forward`
#   trades backward all-gathers for memory; HSDP keeps the gathers inside a node and all-reduces
#   only the reduced shards across nodes.
# * PyTorch's MemTracker files each storage by when it was made, so on ZeRO-3 its "Activation"
#   holds the gathered weights too; FSDPMemTracker names them for FSDP2. Both count storages,
#   byte for byte the formula's shards, padding included.
# * Offload trades GPU memory for $2S$ bytes each way over PCIe and a host-side Adam; it pays
#   when the batch per GPU is large enough to hide them. The host and the NVMe drives are shared
#   by a node's GPUs, so their cost falls with the number of nodes, not of GPUs.
# * Muon's update of a matrix depends on the whole matrix, so a shard must be gathered before
#   Newton-Schulz: to every rank (simple, $N$ times the compute) or to one owner per matrix, which
#   scatters the result back; assign owners by size to balance the work.
#
# ## Self-check
#
# 1. A 13B-parameter model, bf16 + fp32 AdamW, 16 GPUs. Model state per GPU under stages 0-3?
# 2. Why does stage 2 need hooks during backward, while stage 1 can wait until backward ends?
# 3. With ZeRO-3 on 8 ranks, how many bytes does each rank send per step for a 1B-parameter
#    bf16 model, on a ring? And with DDP?
# 4. A student shards Adafactor's factored second moment (a row vector and a column vector per
#    matrix) with the flat buffer. What goes wrong?
# 5. Your stage 3 run's memory grows by one block per layer during forward. Which hook is
#    missing?
# 6. Per-parameter sharding on 4 ranks: what does each rank hold of a weight of shape (10, 6),
#    under which name?
# 7. HSDP on 4 nodes of 8 GPUs: per step, how many bytes of a unit's $P$-byte gradient does a
#    rank send to other nodes (ring algorithms)?
# 8. You switch section 8's MemTracker run to `reshard_after_forward=False`. Which of
#    MemTracker's rows change right after forward, and by how much, in terms of the blocks'
#    gathered (padded) elements $P_b$?
# 9. Owner-compute Muon on 8 ranks, a model whose hidden matrices are 4 of size $a$ and 12 of
#    size $a/4$ (in FLOPs). Dealt in order (rank $i \bmod 8$) from a list that starts with the 4
#    large ones, what is the imbalance (max / mean)? And with the greedy largest-first rule?
#
# <details><summary>Answers</summary>
#
# 1. $13\cdot10^9\times(16,\ 4 + 12/16,\ 2 + 14/16,\ 16/16)$ bytes = 193.7, 57.5, 34.8, 12.1 GiB.
# 2. Stage 2's point is never to hold all gradients: each bucket must leave (and its gradients
#    be freed) as soon as backward has produced it, so the rank must act during backward.
#    Stage 1 keeps them all anyway, so one reduce-scatter after backward is enough.
# 3. $3 \cdot \frac{7}{8} \cdot 2 \cdot 10^9 = 5.25$ GB for ZeRO-3; $2 \cdot \frac78 \cdot 2\cdot 10^9 = 3.5$ GB for DDP.
# 4. The factored moments of a matrix are row and column means of its squared gradient: a flat
#    slice holds part of a matrix, so each rank would compute means over a different piece and
#    the update would differ from the single-process one (apply_zero rejects it).
# 5. The free after forward (the forward post-hook): each block stays gathered until its
#    backward, so the full model piles up, as in section 6's trace but without the drops.
# 6. $c = \lceil 10/4 \rceil = 3$ rows, under the weight's own name: ranks 0-2 hold rows 0-8,
#    rank 3 holds row 9. In the course's design every rank's shard is (3, 6), rank 3's with two
#    zero rows of padding; FSDP2's rank 3 shows (1, 6) (`torch.chunk` semantics), a view of a
#    storage of 3 rows whose last two are the padding.
# 7. Only the all-reduce of its reduced shard, $P/8$, across the 4 replicas:
#    $2 \cdot \frac34 \cdot \frac P8 = \frac{3}{16}P$. The all-gathers and the reduce-scatter
#    stay inside the node.
# 8. Only "Activation": it grows by $4 \sum_b P_b$ bytes in fp32, the blocks' gathered weights,
#    made during forward and now kept until their backward. Parameters, gradients and optimizer
#    state are the shards and do not change; neither do the saved activations the formula
#    counts.
# 9. Total $4a + 12 \cdot a/4 = 7a$, mean $7a/8$. Dealt in order, ranks 0-3 get a large matrix
#    and then one small one ($1.25a$), ranks 4-7 two small ones ($0.5a$): imbalance
#    $1.25a / (7a/8) = 1.43$. Greedy gives the large ones to ranks 0-3 ($a$ each), then the small
#    ones always to the least-loaded rank, which is one of ranks 4-7 until they reach $a$; the 12
#    small ones bring them to $0.75a$. Imbalance $a / (7a/8) = 1.14$, and no assignment can do
#    better: a rank with a large matrix already holds $a$.
# </details>
#
# ## References
#
# * Rajbhandari, S., Rasley, J., Ruwase, O., He, Y. (2020). *ZeRO: Memory Optimizations Toward
#   Training Trillion Parameter Models.* SC20, arXiv:1910.02054. The three stages, the
#   per-GPU formulas and the 7.5B-parameter table of section 1, and the communication volumes
#   of sections 7 and 8.
# * Ren, J., Rajbhandari, S., Aminabadi, R. Y., Ruwase, O., Yang, S., Zhang, M., Li, D., He, Y.
#   (2021). *ZeRO-Offload: Democratizing Billion-Scale Model Training.* USENIX ATC '21,
#   arXiv:2101.06840. The optimizer state and step on the host, section 9.
# * Rajbhandari, S., Ruwase, O., Rasley, J., Smith, S., He, Y. (2021). *ZeRO-Infinity: Breaking
#   the GPU Memory Wall for Extreme Scale Deep Learning.* SC21, arXiv:2104.07857. Stage 3
#   offloaded to host memory and NVMe, and what bandwidth each needs (section 9's NVMe tier).
# * Zhao, Y., Gu, A., Varma, R., Luo, L., Huang, C.-C., Xu, M., et al. (2023). *PyTorch FSDP:
#   Experiences on Scaling Fully Sharded Data Parallel.* PVLDB 16(12), arXiv:2304.11277. FSDP's
#   units, the flat parameter, prefetching, the rate limiter and hybrid sharding, in PyTorch
#   (sections 6 and 8).
# * Wang, G., Qin, H., Jacobs, S. A., Holmes, C., Rajbhandari, S., Ruwase, O., et al. (2023).
#   *ZeRO++: Extremely Efficient Collective Communication for Giant Model Training.*
#   arXiv:2306.10209. Hierarchical partitioning and quantised gathers, section 11.
# * Jordan, K., Jin, Y., Boza, V., You, J., Cesista, F., Newhouse, L., Bernstein, J. (2024).
#   *Muon: An optimizer for hidden layers in neural networks.* kellerjordan.github.io/posts/muon/.
#   The optimizer, the quintic Newton-Schulz iteration and its coefficients, AdamW for the
#   embeddings, head and 1-D parameters (section 13).
# * Liu, J., Su, J., Yao, X., Jiang, Z., Lai, G., Du, Y., et al. (2025). *Muon is Scalable for
#   LLM Training.* arXiv:2502.16982. Weight decay and the per-matrix update scale, Distributed
#   Muon over ZeRO-1 (section 13's gather method), ~2x compute efficiency over AdamW.
# * Ahn, K., Xu, B., Abreu, N., Fan, Y., Magakyan, G., Sharma, P., Zhan, Z., Langford, J. (2025).
#   *Dion: Distributed Orthonormalized Updates.* arXiv:2504.05295. Orthonormal updates without
#   gathering whole matrices; its repository also holds an owner-compute Muon for FSDP2.
# * Graham, R. L. (1969). *Bounds on Multiprocessing Timing Anomalies.* SIAM Journal on Applied
#   Mathematics 17(2). Largest-first greedy assignment (section 13's balanced owners).
#
# Further reading:
#
# * Xu, Y., Lee, H., Chen, D., Choi, H., Hechtman, B., Wang, S. (2020). *Automatic
#   Cross-Replica Sharding of Weight Update in Data-Parallel Training.* arXiv:2004.13336. The
#   same sharded weight update (reduce-scatter, update a shard, all-gather), applied
#   automatically by the XLA compiler on TPUs.
# * PyTorch tutorial, *Getting Started with Fully Sharded Data Parallel (FSDP2)*
#   (docs.pytorch.org/tutorials/intermediate/FSDP_tutorial.html): `fully_shard`, per-parameter
#   sharding with DTensor, mixed precision and prefetching.
# * DeepSpeed, *Zero Redundancy Optimizer* tutorial (deepspeed.ai/tutorials/zero): the
#   `zero_optimization` config of section 11 on a real model.
# * PyTorch source, `torch/distributed/_tools/mem_tracker.py` (`MemTracker`) and
#   `fsdp2_mem_tracker.py` (`FSDPMemTracker`), torch 2.13: the categories, snapshots and peak
#   read in section 8, in their docstrings (private modules, no documentation page).
#
# Next: write a ZeRO-2 step yourself in `exercises/ex08_zero2_step.ipynb`: every gradient
# reduce-scattered and dropped as backward produces it, so that no rank ever holds the whole
# gradient, checked against one process and against the bytes each rank holds. Once its
# checks pass, its last cell points to the course's own implementation to compare with.
