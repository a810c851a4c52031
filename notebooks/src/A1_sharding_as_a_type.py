# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/A1_sharding_as_a_type.ipynb)

# %% [markdown]
# # A1 · Sharding as a type: the course's layouts in DTensor and in JAX
#
# *Appendix, optional reading after the capstone.*
#
# Every strategy of this course was written by hand: notebook 05's `ColumnParallelLinear`
# knows that its backward must all-reduce, notebook 08's ZeRO-3 knows when to gather a weight
# and when to scatter its gradient. There is another way to write the same programs: say only
# **how each array is split over a mesh of devices** — its *sharding*, carried with the array
# like a dtype — and let the framework work out which collectives the arithmetic needs.
# PyTorch's DTensor does it operation by operation at run time; JAX hands the whole step to
# the XLA compiler, whose partitioner (GSPMD, Xu et al. 2021; since JAX 0.7 its successor
# Shardy, same idea) propagates the shardings through the program and inserts the collectives.
#
# By the end of this notebook you can:
#
# 1. write data parallelism, Megatron's column/row split, sequence parallelism, ZeRO-3/FSDP and
#    a 2D dp × tp mesh as DTensor placements (`Shard`, `Replicate`, `Partial`) and as JAX
#    `PartitionSpec`s, and translate between those and the Megatron / DeepSpeed / FSDP names;
# 2. read the collectives a framework inserted (DTensor's `CommDebugMode`, the compiled HLO of
#    a JAX function) and hold them against the course's formula and its hand-written strategy;
# 3. say what `pjit` became, when a sharding annotation on an intermediate changes the plan, and
#    why the same layout can compile to another plan at other sizes;
# 4. write the same step per device with `shard_map`, beside the course's own layers;
# 5. read a sharding as part of an array's type in JAX's explicit mode (`float32[4@dp,8,16]`),
#    and fix a program it refuses with one line that names the collective.
#
# One program runs everywhere: an MLP on the residual stream, weights stored as `nn.Linear`
# stores them (out × in), and one SGD step.
#
# $$h = \mathrm{gelu}(x\,W_{fc}^\top),\qquad y = h\,W_{proj}^\top,\qquad
#   L = \mathrm{mean}\,(y - t)^2,\qquad W \leftarrow W - \eta\,\partial L/\partial W$$
#
# with the gradient of $x$ too (it stands for the activation a previous layer would need).
# PyTorch runs on 4 gloo ranks as in every notebook; JAX runs in **its own process** on 8
# emulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set before JAX
# starts; the layouts use 4 of them, to match the 4 ranks). Keeping JAX out of this kernel
# also keeps XLA's thread pool and PyTorch's apart.

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
import numpy as np

from course_lib.sharding import LAYOUTS, Shapes, formula, mapping_table, totals
from course_lib.sharding import hlo
from course_lib.sharding.run import (ATOL, EXPLICIT_LAYOUT, RTOL, collective_table, format_table, make_data,
                                     max_rel_error, modes_table, numbers_table, run_jax, run_torch, source_of)
from course_lib.sharding.torch_side import reference_step

SHAPES = Shapes()  # b=4 sequences of s=8 tokens, d=16, hidden f=64, fp32, lr=0.1
DATA = make_data(SHAPES)
M = SHAPES.b * SHAPES.s * SHAPES.d * SHAPES.e  # one activation of the residual stream, bytes
P = SHAPES.f * SHAPES.d * SHAPES.e  # one weight matrix, bytes
print(f"x, t: {DATA['x'].shape}   W_fc: {DATA['fc'].shape}   W_proj: {DATA['proj'].shape}")
print(f"M = b s d e = {M:,} bytes (an activation)   P = f d e = {P:,} bytes (a weight)")

# %% [markdown]
# ## 1. A sharding is part of an array's type
#
# A **mesh** names the devices' axes: 4 devices in a row called `"tp"`, or a 2 × 2 grid
# `("dp", "tp")`. A JAX **PartitionSpec** has one entry per *array* dimension: the mesh axis
# that splits it, or `None`. DTensor's **placements** have one entry per *mesh* dimension:
# `Shard(d)` (this mesh axis splits array dim `d`), `Replicate()` (every device along it holds
# the whole), or `Partial()` (each holds a summand; the value is their sum, still to be
# reduced). The two notations describe the same layouts, read from opposite ends:
# `P(None, "tp")` on a 1D mesh `"tp"` is `[Shard(1)]`.
#
# The course's layouts, written once in `course_lib.sharding.layouts` (the torch side and the
# JAX side both read that table):

# %%
for name, layout in LAYOUTS.items():
    mesh = " x ".join(f"{a}={n}" for a, n in layout.axes)
    print(f"{name:6} {layout.what}   mesh {mesh}")
    for tensor in ("x", "fc", "proj"):
        spec = "P(" + ", ".join("None" if a is None else repr(a) for a in layout.specs[tensor]) + ")"
        placements = [f"Shard({p[1]})" if p[0] == "Shard" else "Replicate()" for p in layout.placements(tensor)]
        print(f"         {tensor:5} {spec:24} {placements}")

# %% [markdown]
# The layouts also carry **annotations on intermediates** (`layout.use`): where a value must
# have a given layout *at the point of use*. FSDP's weights are stored split by rows but used
# whole; sequence parallelism's `x` is stored split along the sequence but enters `fc` whole.
# A hand-written strategy encodes this in its code (notebook 08's gather before each block);
# DTensor writes it as `redistribute(...)`; JAX as `jax.lax.with_sharding_constraint(...)`.

# %%
for name, layout in LAYOUTS.items():
    print(f"{name:6}", {k: "P(" + ", ".join("None" if a is None else repr(a) for a in v) + ")"
                        for k, v in layout.use.items()} or "(none)")

# %% [markdown]
# ## 2. What `pjit` became
#
# Articles about training large models in JAX (2021-2023) write `pjit(f, in_shardings=...,
# out_shardings=...)` from `jax.experimental.pjit` (older code: `in_axis_resources`,
# `out_axis_resources`): "partitioned jit". It has since been merged into `jax.jit`, which takes
# the same `in_shardings` / `out_shardings`; the old name is deprecated. The shardings are `jax.sharding.NamedSharding(mesh, PartitionSpec(...))`.
# Here is the whole JAX side of this notebook's step (`course_lib/sharding/jax_program.py`,
# shown as text: this kernel never imports JAX):

# %%
print(source_of("loss_fn"))
print()
print(source_of("run_gspmd"))

# %% [markdown]
# Nothing in `loss_fn` mentions a device or a collective: the program is the single-device
# one. `in_shardings` says how the arguments arrive, `out_shardings` how the results must
# leave, and the compiler fills in the rest. `step.lower(*args).compile().as_text()` is the
# compiled program in XLA's HLO text, collectives included: `course_lib.sharding.hlo` reads
# them out (kind, full size in bytes, group size).
#
# **Predict.** For the Megatron layout (`tp`: `W_fc` split by rows of the stored matrix, i.e.
# by output features — column-parallel; `W_proj` by input features — row-parallel; `x`
# replicated), which collectives will the compiler insert for one step, and how large?
#
# <details><summary>Answer</summary>
#
# Exactly Megatron's: an all-reduce of the partial sums of `y` in forward (M bytes: `g`) and an
# all-reduce of $\partial L/\partial x$ in backward (M bytes: `f`), both over the 4 devices.
# The weight gradients stay where the weights are: each device's columns of $h$ only touch its
# own rows of $W_{fc}$ and columns of $W_{proj}$. Nothing else moves: `y` is replicated, so the
# loss is computed whole on every device.
# </details>

# %%
JAX = run_jax(DATA, SHAPES)  # every JAX program of this notebook, in one process
print(f"JAX process: {JAX['devices']} {JAX['platform']} devices")
print("\n".join(hlo.describe(JAX["programs"]["tp"]["hlo"])))

# %% [markdown]
# ## 3. Every layout, three ways, against the formula
#
# For each layout we now run the same step three ways and list, on the first rank/device, the
# bytes of every kind of collective over each group size (the full tensor of each call: an
# all-reduce's tensor, an all-gather's output, a reduce-scatter's input — the convention of
# `course_lib.estimate.traffic`):
#
# * **course**: the course's own pieces, written out (`course_lib/sharding/torch_side.py`):
#   `ColumnParallelLinear` / `RowParallelLinear` from notebook 05 (with sequence parallelism:
#   its all-gather and reduce-scatter), a ZeRO-3 unit gathered by the course's differentiable
#   all-gather (its backward is the gradient's reduce-scatter), data-parallel gradients
#   all-reduced; counted by `CommTracer`;
# * **DTensor**: `DTensor.from_local` with the layout's placements, the annotations as
#   `redistribute`, then the plain MLP; counted by `CommDebugMode` (its counts, plus the bytes);
# * **JAX**: the HLO of `jax.jit` with the layout's shardings and annotations.
#
# The formula is the course's traffic model (`course_lib.estimate.traffic`) for one MLP:
# `formula(name)` lists every call with what it is for.

# %%
for record in formula("sp"):
    print(f"{record.op:15} {record.nbytes:>6,} bytes over {record.group}   {record.what}"
          + ("   [only if the gathered x was freed]" if record.regather else ""))

# %% [markdown]
# **Predict.** Sequence parallelism sends, in forward, an all-gather of `x` and a
# reduce-scatter of `y`; in backward their gradients. The course's `gathered_linear` (notebook
# 05) keeps only its shard of `x` for backward and gathers it again there (Megatron's memory
# trick, Korthikanti et al. 2022). Will DTensor and the compiler gather `x` again too?
#
# <details><summary>Answer</summary>
#
# No. Both keep what autograd saved — the gathered `x`, 4 times the shard — and gather once.
# The re-gather is a memory-for-bandwidth choice the hand-written strategy makes; neither
# framework makes it unless asked (activation checkpointing of that region would). The same
# holds for FSDP: notebook 08's stage 3 frees the gathered weights after forward and gathers
# them again in backward; a DTensor or JAX program that does not say so keeps them.
# </details>

# %%
TORCH = run_torch(DATA)  # every layout, course and DTensor, on 4 gloo ranks
for name in LAYOUTS:
    rows = collective_table(name, TORCH, JAX)
    print(f"--- {name}: {LAYOUTS[name].what}")
    print(format_table(rows))
    print("    DTensor, CommDebugMode.get_comm_counts():", TORCH[name]["dtensor"][0]["comm_counts"])
    print("    DTensor placements of y before its annotation:", TORCH[name]["dtensor"][0]["y_placements"])
    print("    JAX, collective instructions in the HLO:", hlo.calls(JAX["programs"][name]["hlo"]))
    print()

# %% [markdown]
# Reading the tables:
#
# * **dp, tp, dp × tp**: all three equal the formula to the byte. Only the call counts differ:
#   the compiler *combines* the gradient all-reduces and the loss's
#   into one instruction (one `all-reduce` over a tuple of arrays), DTensor makes one call per
#   gradient, the course one per parameter. In dp × tp both groups have 2 ranks, so one column
#   holds both: the activations' all-reduces over `tp` (2 × M/dp), the gradients' over `dp`
#   (2 × P/tp) and the loss's.
# * **sp and fsdp**: the course's `gathered_linear` gathers `x` again in backward (the "with
#   re-gather" row); the ZeRO-3 unit written here keeps its gathered weights for backward, as
#   DTensor and JAX do (the row without; notebook 08's stage 3 frees them and would match the
#   row with). JAX's CPU compiler writes each
#   **reduce-scatter as an all-reduce** of the same full tensor, after which each device keeps
#   its slice: XLA's GPU compiler has a pass that fuses the all-reduce and the slice into a
#   reduce-scatter; the CPU pipeline here does not. Same result, twice the bytes on a ring
#   ($2\frac{n-1}{n}$ instead of $\frac{n-1}{n}$ of the tensor, notebook 02). The check
#   below counts a reduce-scatter as an all-reduce for JAX only, and says so.
# * These are the compiler's plans **at these sizes**: section 5 compiles the sp layout at
#   another size and gets another plan.

# %%
for name in LAYOUTS:
    rows = collective_table(name, TORCH, JAX)
    course_regathers = name == "sp"  # gathered_linear's memory trick; the ZeRO-3 unit here keeps its weights
    assert rows["course"] == totals(formula(name), regather=course_regathers), name
    assert rows["DTensor"] == totals(formula(name)), name
    assert rows["JAX jit"] == totals(formula(name), rs_as_all_reduce=True), name
print("every layout: course, DTensor and JAX send what the formula says (JAX's reduce-scatters as all-reduces)")

# %% [markdown]
# ## 4. One step, the same numbers three ways
#
# Collectives that match are half the story; the step must also compute the same thing. Each
# result — the loss, the three gradients and the two updated weights — is assembled from the
# ranks' pieces by its layout and compared with one process on full tensors. fp32 results of
# the same arithmetic in another order (a parallel sum adds the terms in another order; XLA and
# ATen have their own GELU and matmul kernels) agree to a few units in the last place of each
# value, so the check is $|a - b| \le$ `ATOL` $+$ `RTOL` $\cdot |b|$ with
# `RTOL` = 1e-5 and `ATOL` = 1e-6 (room for values near zero): about 80 fp32 ulps of slack.

# %% tags=["nbval-ignore-output"]
NUMBERS = numbers_table(TORCH, JAX, DATA)
print("largest |a - b| / (ATOL/RTOL + |b|) against the single process (<= RTOL passes):")
for name, row in NUMBERS.items():
    print(f"  {name:6}", "  ".join(f"{who} {max_rel_error(r, row['reference']):.1e}"
                                   for who, r in row.items() if who != "reference"))
    for who, r in row.items():
        assert max_rel_error(r, row["reference"]) <= RTOL, (name, who)  # reason: fp32 reordering (above)
print(f"loss of the step: {NUMBERS['tp']['reference']['loss']:.6f}")

# %%
within = all(max_rel_error(r, row["reference"]) <= RTOL for row in NUMBERS.values() for r in row.values())
print(f"{len(NUMBERS)} layouts x (course, DTensor, JAX) equal to one process within rtol={RTOL}, atol={ATOL}: {within}")

# %% [markdown]
# ## 5. What the compiler decides
#
# A hand-written strategy fixes *where* every reduction happens and *when* an intermediate is
# re-sharded. Given only the shardings of inputs and outputs, the compiler chooses. Take the
# FSDP layout — weights split by rows, batch split — **without** the annotation that says "the
# weights are used whole".
#
# **Predict.** FSDP would all-gather the two weights (2 × P bytes) and reduce-scatter their
# gradients. Is that the only plan that computes this step? What else could move?
#
# <details><summary>Answer</summary>
#
# No. The matmul $x W_{fc}^\top$ with `x` split by batch and $W_{fc}$ split by rows can also be
# computed by moving *activations* to the weights: gather the batch, let each device compute
# its own output features, and send the results back where the batch lives (all-to-all). Which
# one the partitioner picks depends on its heuristics and on the sizes; in this small MLP an
# activation (M) is smaller than a weight (P, both printed at the top), so moving activations
# is not absurd. Run it and see.
# </details>

# %% tags=["nbval-ignore-output"]
# The plan without an annotation is the partitioner's heuristic choice: another JAX version may
# pick other all-to-alls (this output is not compared between runs; the asserts below hold).
for name in ("fsdp_unannotated", "fsdp_h", "fsdp"):
    program = JAX["programs"][name]
    print(f"--- {name}")
    print("\n".join(hlo.describe(program["hlo"])))
    print("    bytes by (op, group):", totals(program["collectives"]))
    assert max_rel_error(program["out"], NUMBERS["fsdp"]["reference"]) <= RTOL  # same step (fp32, see above)

# %% [markdown]
# Without an annotation the partitioner chose another plan: it moves activations (it gathers
# `x` along the batch) and re-splits intermediates between the batch and the feature dimension
# with all-to-alls, sending more bytes than FSDP's plan (counted below). The details are the
# partitioner's heuristics and change between JAX versions; the asserts say what holds. The
# numbers are the same step (the assert above): only the communication differs. Two
# annotations bring back FSDP's plan:
#
# * `fsdp`: `with_sharding_constraint(W, P(None, None))` on each weight where it is used
#   (DTensor: `W.redistribute(mesh, [Replicate()])`): "gather the weights";
# * `fsdp_h`: `with_sharding_constraint(h, P("dp", None, None))` on the hidden activation
#   alone: "keep the batch split in the middle of the MLP" — and the weights must then come to
#   the batch: the same two all-gathers, the same gradient reduction.
#
# This is the division of labour the GSPMD paper argues for (Xu et al. 2021): the programmer
# annotates a few tensors, the compiler completes the rest; where its completion is not the
# plan you wanted, one more annotation on an intermediate fixes it. A hand-written strategy
# has no such freedom, and no such surprise.

# %% tags=["nbval-ignore-output"]
unannotated = totals(JAX["programs"]["fsdp_unannotated"]["collectives"])
annotated = totals(JAX["programs"]["fsdp"]["collectives"])
assert any(op == "all_to_all" for op, _ in unannotated) and not any(op == "all_to_all" for op, _ in annotated)
assert sum(unannotated.values()) > sum(annotated.values())
for name in ("fsdp", "fsdp_h"):  # either annotation: FSDP's collectives (reduce-scatters as all-reduces on CPU)
    assert totals(JAX["programs"][name]["collectives"]) == totals(formula("fsdp"), rs_as_all_reduce=True)
print(f"unannotated: {sum(unannotated.values()):,} bytes in {hlo.calls(JAX['programs']['fsdp_unannotated']['hlo'])}")
print(f"annotated:   {sum(annotated.values()):,} bytes in {hlo.calls(JAX['programs']['fsdp']['hlo'])}")

# %% [markdown]
# ### The plan depends on the shapes
#
# Every plan so far was compiled at one size. Take the sequence-parallel layout of section 3,
# whose compiled plan matched the formula, and give it other sizes, as a new user trying it
# would: b = 8, s = 12, d = 20, f = 40. The shardings and the annotations are the same (`x`
# gathered where it enters `fc`, `y` split along the sequence where the loss reads it). Between
# them the hidden activation $h$ is free: split by hidden features (Megatron's column-parallel
# `fc`, the formula's plan) or along the sequence, as `y` and `t` are.
#
# **Predict.** Will the compiler send the formula's collectives at the second size?
#
# <details><summary>Answer</summary>
#
# No. Where two shardings compete for the one mesh axis (here $h$ split by hidden features,
# which comes from the weights, $P$ bytes each, or $h$ split along the sequence, which comes
# from `y` and `t`, $M$ bytes each), Shardy's propagation keeps the one that comes from the
# **larger tensor**, since resharding the smaller one is usually cheaper (the design comment of
# its `AggressiveFactorPropagation`, openxla/shardy). At the notebook's size the weight is the
# larger ($P$ = 4,096 > $M$ = 2,048 bytes, printed at the top) and Megatron's plan follows; at
# the second size the activation is ($M$ = 7,680 > $P$ = 3,200): the sequence split wins, the
# compiler gathers the whole `fc` weight and re-splits intermediates between the sequence and
# the hidden dimension with all-to-alls. The cell below checks that rule at both sizes.
# </details>
#
# Both sizes run the same two programs: `sp`, the layout with its own annotations, and `sp_h`,
# the same plus one more annotation, `with_sharding_constraint(h, P(None, None, "tp"))`: "h is
# split by hidden features", as Megatron's column-parallel layer leaves it (DTensor:
# `h.redistribute(mesh, [Shard(2)])`).

# %% tags=["nbval-ignore-output"]
# The unpinned plan is the partitioner's choice: another JAX version may choose otherwise (this
# output is not compared between runs; the asserts below hold). The second size runs in its own
# JAX process, with the sp programs only.
SHAPES2 = Shapes(b=8, s=12, d=20, f=40)
DATA2 = make_data(SHAPES2)
JAX2 = run_jax(DATA2, SHAPES2, names=("sp",))
M2, P2 = SHAPES2.b * SHAPES2.s * SHAPES2.d * SHAPES2.e, SHAPES2.f * SHAPES2.d * SHAPES2.e
SIZES = {"notebook's size": (SHAPES, JAX, M, P), "second size": (SHAPES2, JAX2, M2, P2)}
for label, (shapes, answer, m, p) in SIZES.items():
    rows = {"formula (RS as all-reduce)": totals(formula("sp", shapes), rs_as_all_reduce=True),
            "JAX jit": totals(answer["programs"]["sp"]["collectives"]),
            "JAX jit, h pinned": totals(answer["programs"]["sp_h"]["collectives"])}
    print(f"--- sp, {label}: b={shapes.b} s={shapes.s} d={shapes.d} f={shapes.f}   M = {m:,} bytes, P = {p:,} bytes")
    print(format_table(rows))
    print("    instructions, jit:", hlo.calls(answer["programs"]["sp"]["hlo"]),
          "  h pinned:", hlo.calls(answer["programs"]["sp_h"]["hlo"]))
    assert (rows["JAX jit"] == rows["formula (RS as all-reduce)"]) == (p > m)  # the larger tensor's split wins
    assert rows["JAX jit, h pinned"] == rows["formula (RS as all-reduce)"]  # pinned: the formula's plan at any size
print("--- the second size's unpinned plan, instruction by instruction:")
print("\n".join(hlo.describe(JAX2["programs"]["sp"]["hlo"])))
plain2, formula2 = totals(JAX2["programs"]["sp"]["collectives"]), totals(formula("sp", SHAPES2), rs_as_all_reduce=True)
assert ("all_to_all", 4) in plain2 and ("all_to_all", 4) not in formula2
assert plain2[("all_gather", 4)] == formula2[("all_gather", 4)] + P2  # one more all-gather: a whole weight
reference2 = reference_step(DATA2)
for name in ("sp", "sp_h"):  # another plan, the same step (fp32 reordering, section 4's tolerance)
    assert max_rel_error(JAX2["programs"][name]["out"], reference2) <= RTOL

# %% [markdown]
# At the notebook's size the two rows of JAX equal the formula; at the second size the
# unpinned program adds an all-gather of $P$ bytes (the whole `fc` weight) and a few
# all-to-alls, and the pinned one is back to the formula's bytes. Both compute the same step
# (the asserts hold it against one process). So a layout given only at the inputs and the
# outputs says *what* is split, not *how* the step communicates: the plan read from the HLO at
# one size is the compiler's plan for that size. Three things pin it:
#
# * a sharding constraint on the intermediates whose layout is the plan
#   (`jax.lax.with_sharding_constraint`, as `sp_h` does for $h$; in DTensor, `redistribute`);
# * `shard_map` (section 6): the per-device program with its collectives written in, which no
#   size can change;
# * the course's hand-written layers, which are that per-device program in PyTorch.
#
# Real runs sit on the second side of this comparison: $M > P$ means $b\,s > f$, more tokens on
# a device than hidden features, and a run with 8 sequences of 4,096 tokens has 32,768 tokens
# against $f$ = 16,384 at $d$ = 4,096. By this rule alone an unpinned sequence-parallel block
# would take the second plan; read the HLO at the sizes you will run, and pin the activations
# that matter.

# %% [markdown]
# ## 6. `shard_map`: the per-device program, beside the course's layers
#
# Sometimes you want to write the per-device program yourself: which piece each device holds
# and which collective it calls. JAX's `shard_map` takes a function of the *local* blocks and
# runs it on every device of the mesh, with explicit collectives inside (`psum`,
# `all_gather`, `psum_scatter`). It is the course's style — `ColumnParallelLinear` and
# `RowParallelLinear` are per-rank programs with `f` and `g` written in — inside a compiler.
# Megatron's MLP both ways (the same function runs the dp × tp layout in section 7, where each
# device also holds its rows of the batch):

# %%
print(source_of("run_shard_map"))

# %% [markdown]
# The course's version is notebook 05's two layers: `fc = ColumnParallelLinear.from_linear(...)`
# (forward: `f`, identity; backward: all-reduce of $\partial L/\partial x$) and
# `proj = RowParallelLinear.from_linear(...)` (forward: `g`, the all-reduce of the partial
# sums). In `shard_map` only `g` is written (`psum`); `f` is derived: the gradient of an input
# every device holds whole is the sum over devices of their contributions, and JAX's autodiff
# inserts that sum itself.
#
# **Predict.** Will the `shard_map` program send the same collectives as the course's layers
# and as the compiler's own plan for the `tp` layout?

# %% [markdown]
# <details><summary>Answer</summary>
#
# Yes: two all-reduces of M bytes over the 4 devices, one forward (`psum`), one backward (the
# transpose of the replicated input). The three rows below are equal, and so are the numbers.
# </details>

# %%
rows = collective_table("tp", TORCH, JAX)
print(format_table({k: rows[k] for k in ("formula (no re-gather)", "course", "JAX jit", "JAX shard_map")}))
print("\n".join(hlo.describe(JAX["programs"]["tp_shard_map"]["hlo"])))
assert rows["JAX shard_map"] == rows["course"] == totals(formula("tp"))
assert max_rel_error(NUMBERS["tp"]["JAX shard_map"], NUMBERS["tp"]["reference"]) <= RTOL  # fp32 reordering
print("shard_map: same collectives as the course's layers, same step within tolerance")

# %% [markdown]
# ## 7. Sharding as a type, literally: JAX's explicit mode
#
# So far JAX ran in two modes. In the **automatic** one (sections 2-5) a sharding is given at
# the inputs and the outputs, plus constraints on a few intermediates, and the compiler completes the
# rest, sometimes not as you meant (section 5). In the **manual** one (`shard_map`, section 6)
# you write the per-device program and its collectives. JAX has a third, between them:
# **explicit sharding** (JAX documentation, "Explicit sharding", 2025). The mesh's axes are
# declared `AxisType.Explicit`, and every array's sharding becomes part of its *type*, for every
# intermediate, at trace time, as its shape is. `jax.typeof(x)` prints it: `float32[4@dp,8,16]`
# reads "dim 0, of length 4, split over mesh axis `dp`; the others whole". Each operation
# computes its result's type from its operands' types; where they do not decide it, the program
# is refused when it is traced, before anything is compiled, instead of being left to the
# compiler. The same step in that mode (`course_lib/sharding/jax_program.py`):

# %%
print(source_of("explicit_loss"))
print()
print(source_of("run_explicit"))

# %% [markdown]
# `how` picks one of four ways to write the line that makes `y` (`EXPLICIT_Y` in the same
# file); the first says nothing. We run the dp × tp layout of section 3: a 2 × 2 mesh
# `("dp", "tp")`, `x` split by batch over `dp`, `fc` column-parallel and `proj` row-parallel
# over `tp`. Its inputs' types are the layout table itself:

# %%
EXPLICIT = JAX["explicit"]  # from the same JAX process as every program above
assert "unavailable" not in EXPLICIT, EXPLICIT.get("unavailable")  # this section needs the pinned jax
layout = LAYOUTS[EXPLICIT_LAYOUT]
sizes = dict(layout.axes)


def sharded_type(tensor_spec, shape):
    """The type jax.typeof prints for a float32 array of this shape and PartitionSpec."""
    return "float32[" + ",".join(str(n) if axis is None else f"{n}@{axis}" for n, axis in zip(shape, tensor_spec)) + "]"


for tensor in ("x", "fc", "proj"):
    print(f"{tensor:5} P{layout.specs[tensor]}  ->  {sharded_type(layout.specs[tensor], SHAPES.shape(tensor))}")

# %% [markdown]
# **Predict.** Follow the types through `h = gelu(x fc^T)` and `y = h proj^T` with nothing
# more said. Which line does explicit mode refuse, and why?
#
# <details><summary>Answer</summary>
#
# The second. `x fc^T` is typed: `x`'s batch split (over `dp`) and `fc`'s output features
# (over `tp`) land on different dims of `h`, `float32[4@dp,8,64@tp]`, and no device needs
# another's data. `h proj^T` contracts the hidden features, split over `tp` on both sides: each
# device can only form a partial sum of `y` (DTensor's `Partial()`), and what `y` is once summed
# — whole on every `tp` device (an all-reduce: Megatron's `g`) or split along the sequence (a
# reduce-scatter: sequence parallelism) — is a choice the operands' types do not make. The
# automatic mode makes it for you, by its heuristics; the explicit mode asks.
# </details>

# %%
refused = EXPLICIT["refused"]
print(f"how='refused': {refused['error']}:")
print(f"  {refused['message']}")
assert refused["error"] == "ShardingTypeError" and "out_sharding" in refused["message"]

# %% [markdown]
# The fix is one line, and it names the collective: `jnp.matmul(h, proj.T,
# out_sharding=P("dp", None, None))` says `y` is whole over `tp`, so the partial sums are
# all-reduced. It is the annotation the layout gives the automatic mode on `y`
# (`layout.use`, section 1), there a constraint the compiler plans around, here part of the
# program's types. Every
# value's type in that step, read with `jax.typeof` while it was traced, against the layout
# table:

# %%
typed = EXPLICIT["programs"]["all_reduce"]
shapes_of = {**{k: SHAPES.shape(k) for k in ("x", "fc", "proj")}, "h": (SHAPES.b, SHAPES.s, SHAPES.f),
             "y": SHAPES.shape("x"), "loss": ()}
spec_of = {**layout.specs, "h": ("dp", None, "tp"), "y": layout.use["y"], "loss": ()}
for name, got in typed["types"].items():
    tensor = name[2:] if name.startswith("g_") else name  # a gradient has its value's type
    want = sharded_type(spec_of[tensor], shapes_of[tensor])
    print(f"{name:6} {got:24} P{spec_of[tensor]}")
    assert got == want, (name, got, want)
print(f"every type = the layout's spec on the value's shape ({len(typed['types'])} values)")

# %% [markdown]
# The gradients come out with their values' types: autodiff transposes each operation with the
# types it was traced with, so the backward pass needs no annotation of its own (the
# transpose of `x fc^T` is a contraction over `tp` again, whose result type is `x`'s).
#
# ### Three modes, one layout
#
# The same dp × tp step, from the same JAX process: automatic (section 3's `jax.jit` with the
# layout's shardings and its constraint on `y`), manual (`shard_map`, section 6's function on the
# 2 × 2 mesh: `psum` over `tp` is `g`, `pmean` over `dp` averages the loss), explicit (the typed
# step above). The collectives of each compiled program, bytes by (op, group size), against the
# formula of section 3:

# %%
MODES = modes_table(JAX)
print(format_table(MODES))
programs_of = {"automatic (jit + shardings)": JAX["programs"][EXPLICIT_LAYOUT],
               "manual (shard_map)": JAX["programs"][f"{EXPLICIT_LAYOUT}_shard_map"],
               "explicit (sharding in types)": typed}
for mode, program in programs_of.items():
    print(f"  {mode:30} instructions: {hlo.calls(program['hlo'])}")
    assert hlo.calls(program["hlo"]) == {"all_reduce": 3}, mode  # g, f, and dp's combined one (below)
for mode, row in MODES.items():
    assert row == MODES["formula"], mode  # every mode sends exactly the formula's bytes
print("automatic, manual and explicit: the formula's collectives, byte for byte")

# %% tags=["nbval-ignore-output"]
# fp32, the same arithmetic in another order (section 4's tolerance and its reason)
reference = NUMBERS[EXPLICIT_LAYOUT]["reference"]
for mode, program in programs_of.items():
    error = max_rel_error(program["out"], reference)
    print(f"  {mode:30} largest error against one process {error:.1e} (<= {RTOL} passes)")
    assert error <= RTOL, mode
print(f"loss: {float(typed['out']['loss']):.6f} (one process: {float(reference['loss']):.6f})")

# %% [markdown]
# All three compile to the same two all-reduces of $M/dp$ over `tp` (`g` forward, `f`
# backward) and one combined all-reduce over `dp` of the two weight-gradient shards and the
# loss, and compute the same step. What differs is who decided: in the automatic mode the
# compiler, guided by one constraint; in the manual mode you, per device, with `psum`; in the
# explicit mode you, at the one line where the types left a choice, and the compiler
# everywhere else.
#
# ### The other answer to the same question
#
# The refusal was not pedantry: the partial sums of `y` have a second legitimate type.
# `out_sharding=P("dp", "tp", None)` asks for `y` split along the sequence over `tp`, which is
# sequence parallelism's reduce-scatter (notebook 05). Then the loss's sum runs over `tp` too,
# and in backward the reduce-scatter's transpose gathers $\partial L/\partial y$ (section 3's
# sp layout). Two more tools of the mode: `jax.sharding.reshard(v, P(...))` changes a value's
# type in the middle of a program, and the collective that takes it there follows (DTensor's
# `redistribute`); `jax.sharding.auto_axes` hands one operation back to the compiler, its
# result's type still said (`out_sharding`), and `explicit_axes` is its converse, an explicit
# region inside an automatic program.

# %%
scattered, handed_back = EXPLICIT["programs"]["reduce_scatter"], EXPLICIT["programs"]["auto_axes"]
print(f"y: {scattered['types']['y']} with out_sharding=P('dp', 'tp', None)")
rows = {"out_sharding: y whole over tp": totals(typed["collectives"]),
        "out_sharding: y split over tp": totals(scattered["collectives"]),
        "auto_axes, y whole over tp": totals(handed_back["collectives"])}
print(format_table(rows))
split, whole = rows["out_sharding: y split over tp"], rows["out_sharding: y whole over tp"]
M_local = M // sizes["dp"]  # one activation on a dp replica's rows
assert scattered["types"]["y"] == sharded_type(("dp", "tp", None), SHAPES.shape("x"))
assert split[("all_gather", sizes["tp"])] == M_local  # dL/dy gathered in backward
# the forward reduce-scatter (an all-reduce on XLA's CPU pipeline, section 3) has g's bytes; the loss is reduced over tp too
assert split[("all_reduce", sizes["tp"])] == whole[("all_reduce", sizes["tp"])] + SHAPES.e
assert rows["auto_axes, y whole over tp"] == whole and handed_back["types"] == typed["types"]
for program in (scattered, handed_back):  # another plan, the same step (fp32 reordering, section 4)
    assert max_rel_error(program["out"], reference) <= RTOL
print(f"y split over tp: + {M_local:,} bytes gathered (dL/dy) + {SHAPES.e} bytes (the loss over tp); the same step")

# %% [markdown]
# The type you write for `y` is the collective you get: whole over `tp` is an all-reduce,
# split over `tp` a reduce-scatter (with its all-gather in backward), and no type at all is a
# `ShardingTypeError` at trace time. This is the appendix's title made literal: the sharding
# is checked like a shape, and a program whose communication is ambiguous does not compile.
# The price is the annotation on every such line; the gain is that a plan cannot change behind
# your back, as section 5's did when the sizes changed.

# %% [markdown]
# ## 8. The dictionary
#
# The same layouts under their names in Megatron-LM, DeepSpeed (ZeRO) and PyTorch FSDP, as
# DTensor placements and as JAX PartitionSpecs (`fc` stored as `nn.Linear` stores it: out ×
# in, so "column-parallel" splits its dim 0):

# %%
print(f"{'name in Megatron / DeepSpeed / FSDP':55}{'tensor':14}{'DTensor placements':26}JAX PartitionSpec")
for who, tensor, placements, spec in mapping_table():
    print(f"{who:55}{tensor:14}{placements:26}{spec}")

# %% [markdown]
# A few more entries without a row in the table: DeepSpeed's ZeRO-1 and ZeRO-2 shard only the
# optimizer state (and the gradients): the weights stay `Replicate()` / `P()` while each
# device updates its `Shard(0)` slice of a flat buffer (notebook 08); HSDP (FSDP's hybrid
# mode) is a 2D mesh with `[Replicate(), Shard(0)]` on (replica, shard); expert parallelism
# (notebook 07) is a `Shard(0)` over the experts dimension, with all-to-alls where tokens meet
# their experts.
#
# ## Self-check
#
# 1. Write FSDP's weight layout as a PartitionSpec on a mesh `("dp",)` and as DTensor placements.
#    Why do the two notations have different lengths?
# 2. In Megatron's MLP, which tensor is `Partial` and where does it become `Replicate`?
# 3. The compiler combined three all-reduces into one instruction in the dp layout. Does that
#    change the bytes? What does it change?
# 4. Why did the course's sequence-parallel layer send one more all-gather than DTensor, and
#    what does it buy?
# 5. On this CPU, JAX wrote every reduce-scatter as an all-reduce plus a slice. How many more
#    bytes does a ring put on each link, as a fraction of the tensor?
# 6. Without annotations, JAX's FSDP layout moved activations instead of weights. Name two
#    annotations that bring back FSDP's plan.
# 7. `jax.experimental.pjit.pjit(f, in_shardings=a, out_shardings=b)`: how is it spelled now?
# 8. The sp layout compiled to the formula's plan at b=4, s=8, d=16, f=64 and to another at
#    b=8, s=12, d=20, f=40. What decided, and what brings the formula's plan back?
# 9. In explicit mode on the dp × tp mesh, what is `jax.typeof` of `h = gelu(x fc^T)`? Why is
#    `h proj^T` refused, and what are the two one-line answers, with their collectives?
#
# <details><summary>Answers</summary>
#
# 1. `P("dp", None)` (one entry per array dim) and `[Shard(0)]` (one entry per mesh dim); a
#    spec is read from the array, placements from the mesh.
# 2. The output of the row-parallel `proj` (each device's partial sum of `y`); the all-reduce
#    (`g`) makes it `Replicate`.
# 3. No, the same bytes; fewer calls, so fewer latency terms (α in notebook 02's model).
# 4. It freed the gathered `x` after forward and gathered it again in backward: activation
#    memory of one shard instead of the whole sequence.
# 5. $2\frac{n-1}{n}$ against $\frac{n-1}{n}$: twice as many, $\frac{n-1}{n}$ of the tensor more.
# 6. `with_sharding_constraint` of the weights to `P(None, None)` where they are used, or of
#    the hidden activation `h` to `P("dp", None, None)`.
# 7. `jax.jit(f, in_shardings=a, out_shardings=b)`.
# 8. The sizes: where the weights' feature split and the activations' sequence split compete
#    for the one axis, Shardy keeps the split of the larger tensor, the weight ($P > M$) at
#    the first size, the activation ($M > P$) at the second. Pinning $h$ with
#    `with_sharding_constraint(h, P(None, None, "tp"))` restores it (or write the block with
#    `shard_map`).
# 9. `float32[4@dp,8,64@tp]`. Its contracting dim is split over `tp` in both operands, so each
#    device holds a partial sum and the result's sharding is not decided by the types;
#    `out_sharding=P("dp", None, None)` (an all-reduce, Megatron's `g`) or
#    `out_sharding=P("dp", "tp", None)` (a reduce-scatter, with an all-gather of the gradient
#    in backward).
# </details>
#
# **Next:** this appendix has no graded exercise; the layouts it revisits are graded in ex05
# (tensor parallel layers) and ex08 (a ZeRO step).
#
# ## References
#
# * Xu, Y., Lee, H., Chen, D., Hechtman, B., Huang, Y., Joshi, R., et al. (2021). *GSPMD:
#   General and Scalable Parallelization for ML Computation Graphs.* arXiv:2105.04663. Sharding
#   annotations, their propagation, and the partitioner that inserts the collectives.
# * OpenXLA Shardy (github.com/openxla/shardy), the propagation JAX uses since 0.7:
#   `transforms/propagation/aggressive_factor_propagation.h` states the conflict rule of
#   section 5 (prefer the sharding that comes from the larger tensor).
# * Shoeybi, M., Patwary, M., Puri, R., LeGresley, P., Casper, J., Catanzaro, B. (2019).
#   *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism.*
#   arXiv:1909.08053. Column and row splits, f and g.
# * Korthikanti, V., Casper, J., Lym, S., McAfee, L., Andersch, M., Shoeybi, M., Catanzaro, B.
#   (2022). *Reducing Activation Recomputation in Large Transformer Models.* arXiv:2205.05198.
#   Sequence parallelism.
# * Rajbhandari, S., Rasley, J., Ruwase, O., He, Y. (2020). *ZeRO: Memory Optimizations Toward
#   Training Trillion Parameter Models.* SC '20, arXiv:1910.02054.
# * Zhao, Y., Gu, A., Varma, R., Luo, L., Huang, C.-C., Xu, M., et al. (2023). *PyTorch FSDP:
#   Experiences on Scaling Fully Sharded Data Parallel.* VLDB 2023, arXiv:2304.11277.
# * JAX documentation (2025). *Explicit sharding (a.k.a. "sharding in types").*
#   docs.jax.dev (the "Explicit sharding" notebook, linked from "Distributed arrays and automatic
#   parallelization"). `AxisType.Explicit` meshes,
#   `jax.typeof`, `out_sharding`, `reshard`, `auto_axes` / `explicit_axes` (section 7).
# * Further reading: the JAX documentation's "Distributed arrays and automatic
#   parallelization" and "Manual parallelism with shard_map" tutorials; PyTorch's
#   `torch.distributed.tensor` (DTensor) documentation, with `CommDebugMode`.
