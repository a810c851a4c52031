# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/10_3d_parallelism.ipynb)

# %% [markdown]
# # 10 · 3D and 4D parallelism on one device mesh
#
# Notebooks 03-08 built each strategy alone: data parallelism (DP) splits the batch, tensor
# parallelism (TP) the weight matrices, pipeline parallelism (PP) the layers, expert
# parallelism (EP) the experts, ZeRO the optimizer state. A frontier run uses all of them at
# once: Llama 3 405B trained on 16,384 H100s with TP 8 × PP 16 × DP 128 (Dubey et al. 2024),
# Megatron-LM's 1T-parameter run with TP 8 × PP 64 × DP 6 (Narayanan et al. 2021). This
# notebook composes the course's own strategies on **one device mesh**, proves the composition
# trains exactly the single-process model, measures what each dimension sends, and shows why
# the *order* of the mesh dimensions decides whether a run is fast on a real cluster.
#
# **After this notebook you can**
#
# * say which dimension splits what (batch, weights, layers, experts, optimizer state) and in
#   which order the strategies are applied to one model;
# * read a rank's coordinates `(pp, dp, ep, tp)` and its four groups off the mesh;
# * check every layout rule before a rank starts, and name the rule a bad layout breaks;
# * compute a global gradient norm in which every shard counts exactly once;
# * predict each dimension's bytes per step, measure them, and say which link carries them;
# * explain why tp goes innermost (NVLink), and why Megatron-LM puts pp outermost where Llama 3
#   puts dp;
# * work through the Llama 3 405B layout with the course's estimator, and say where the
#   course's composition departs from the published run;
# * run FSDP (ZeRO-3) inside a pipeline, count its all-gathers per step under each reshard
#   policy (`2mU` or `U`), and cost the memory each policy holds.

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
from dataclasses import replace

import torch

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.estimate import per_gpu_memory
from course_lib.estimate.clusters import PUBLISHED
from course_lib.estimate.per_gpu import composed_zero_memory
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.estimate.traffic import zero_pp_ops
from course_lib.model import GPTConfig
from course_lib.parallel import make_mesh, mesh_groups, topology
from course_lib.parallel.hybrid import ParallelDims, merged_params, run_hybrid, train_single
from course_lib.parallel.hybrid import figures as mesh_figures
from course_lib.train import TrainConfig
from course_lib.units import fmt_bytes
from course_lib.widgets import show_interactive

SEQ = 16
VOCAB = CharDataset("train", SEQ).vocab_size
# A deliberately tiny model: 8 CPU ranks share 2 cores here, and every claim below is about
# equality and bytes, which do not need a big model.
DENSE = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, d_model=16)
MOE = replace(DENSE, n_experts=4, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.0)
TRAIN = TrainConfig(steps=2, batch_size=8, lr=1e-2, grad_clip=0.05, progress=False)
print(DENSE)

# %% [markdown]
# ## 1. What each dimension splits, and the order of composition
#
# | dimension | splits | what it sends per step | notebook |
# |---|---|---|---|
# | **tp** | every weight matrix (heads, `d_ff`, vocabulary) | 4 all-reduces of the activations per layer | 05 |
# | **pp** | the layers, into `pp × v` stages | activations forward, their gradients backward, point to point | 06 |
# | **ep** | the experts of every MoE layer (and the batch) | 4 all-to-alls of the routed tokens per MoE layer | 07 |
# | **dp** | the batch; with ZeRO-1 the optimizer state too | one gradient reduce-scatter + parameter all-gather | 03, 08 |
#
# The composition is an ordered list of the same `apply_*` calls the earlier notebooks used,
# on the groups of one mesh from `make_mesh(dp, tp, pp, ep)`:
#
# 1. `apply_tensor_parallel(model, mesh["tp"])`: inside every block (innermost: the most traffic);
# 2. `apply_expert_parallel(model, mesh["ep"])`: each MoE layer keeps `E/ep` experts;
# 3. `build_stage(model, mesh["pp"])`: this rank keeps its blocks, the embedding on stage 0,
#    the head on the last stage (a TP-sharded block is just a block to the pipeline);
# 4. ZeRO-1 (`ShardedOptimizer`) over `mesh["dp"]`: each replica's optimizer state sharded.
#
# The mesh numbers ranks with tp varying fastest:
# `rank = ((pp_i · dp + dp_i) · ep + ep_i) · tp + tp_i`.

# %% [markdown]
# ## 2. The mesh as a picture
#
# Predict before running: with `dp=2, tp=2, pp=2` on 8 ranks, which ranks form rank 5's tp
# group, its dp group and its pp group?
#
# <details><summary>Answer</summary>
#
# Rank 5 = (pp 1, dp 0, ep 0, tp 1). tp varies fastest: tp group {4, 5}. dp has stride
# `ep · tp = 2`: {5, 7}. pp has stride `dp · ep · tp = 4`: {1, 5}.
# </details>

# %%
SIZES = dict(pp=2, dp=2, ep=1, tp=2)


def my_groups(dp, tp, pp, ep):
    """Rank code: this rank's coordinates and the ranks of each of its groups, from make_mesh."""
    import torch.distributed as dist

    mesh = make_mesh(dp=dp, tp=tp, pp=pp, ep=ep)
    return {d: (dist.get_rank(mesh[d].get_group()), dist.get_process_group_ranks(mesh[d].get_group()))
            for d in ("pp", "dp", "ep", "tp")}


real = run_on_ranks(my_groups, world_size=8, timeout_s=120, **{k: v for k, v in SIZES.items()})
print("rank 5:", {d: f"index {i}, group {g}" for d, (i, g) in real[5].items()})
pure = mesh_groups(8, **SIZES)
assert all(sorted(real[r][d][1]) in pure[d] for r in range(8) for d in pure)
assert pure == topology.groups(SIZES)  # the pure-Python model of the same numbering
assert real[5]["tp"][1] == [4, 5] and real[5]["dp"][1] == [5, 7] and real[5]["pp"][1] == [1, 5]

# %% [markdown]
# Each row below is one dimension; ranks of the same colour form one group; the grey boxes are
# nodes of 4 GPUs. tp and dp groups stay inside a node, pp groups cross between the nodes.

# %%
view = mesh_figures.mesh_view()
print(view.caption)
from IPython.display import Image, display  # noqa: E402

display(Image(view.png))

# %% [markdown]
# ## 3. Three dimensions at once, exactly the single process
#
# `run_hybrid(ParallelDims(dp=2, tp=2, pp=2, zero=1, microbatches=2), ...)` starts 8 ranks; each
# builds the same GPT from the seed, applies the composition, and trains on its replica's
# share of the same global batches the single process draws. The gradient clip threshold is
# small so that **every step clips**: the global norm must be right, not just the gradients.
#
# Predict: equal losses to about 1e-6, or only close?
#
# <details><summary>Answer</summary>
#
# Equal up to fp32 rounding (sums taken in another order): TP's shards, the pipeline's
# micro-batches and ZeRO's reduce-scatter each compute the same mean gradient, and the clip
# uses the same global norm. A wrong weight in the norm (a replicated LayerNorm counted `tp`
# times, the tied embedding counted on both the first and last stage) would already change
# the first step's update.
# </details>

# %% tags=["nbval-ignore-output"]
DIMS_3D = ParallelDims(dp=2, tp=2, pp=2, zero=1, microbatches=2)
reference = train_single(DENSE, TRAIN)
results = run_hybrid(DIMS_3D, DENSE, TRAIN, trace=True, timeout_s=240)
for step, (a, b) in enumerate(zip(results[0].train_losses, reference.train_losses)):
    print(f"step {step}: 3D loss {a:.6f}   single process {b:.6f}   global grad norm "
          f"{results[0].grad_norms[step]:.6f} vs {reference.grad_norms[step]:.6f}")
params = merged_params(results)
diff = torch.cat([(params[n] - p).flatten() for n, p in reference.named_params.items()])
print(f"largest parameter difference after {TRAIN.steps} steps: {diff.abs().max():.1e}")

# %% tags=["nbval-ignore-output"]
assert all(r.train_losses == results[0].train_losses for r in results)  # the loss reported once
# losses and global norms: fp32 sums in another order (~1e-7 relative here)
torch.testing.assert_close(torch.tensor(results[0].train_losses), torch.tensor(reference.train_losses),
                           rtol=1e-5, atol=1e-6)
torch.testing.assert_close(torch.tensor(results[0].grad_norms), torch.tensor(reference.grad_norms), rtol=1e-5, atol=0)
# parameters: in RMS, against a hundredth of one AdamW step (lr): AdamW magnifies the rounding of gradients
# near zero and can move a single parameter by up to ~lr (notebook 04); a wrong gradient moves most of them
assert diff.pow(2).mean().sqrt() < TRAIN.lr / 100 and min(reference.grad_norms) > TRAIN.grad_clip

# %% [markdown]
# **One global norm.** Every strategy clips with the same function, each with its own
# weights; composed, a rank holds pieces of several kinds. Every rank weights parameter `p`'s
# squared norm by one over the number of identical copies of it in the world,
#
# $$w(p) = \frac{1}{c_{tp}(p)\,c_{ep}(p)\,c_{pp}(p)\,c_{dp}(p)},\quad
# c_{tp} = 1 \text{ if tp-sharded, else } tp;\; c_{ep} = 1 \text{ for an expert, else } ep;\;
# c_{pp} = 2 \text{ for the tied matrix, else } 1;\; c_{dp} = 1 \text{ for a ZeRO-1 shard, else } dp$$
#
# and **one** all-reduce over the world of $\sum_p w(p)\,\|g_p\|^2$ gives $\|g\|^2$ with
# every element counted once (`clip_grad_norm_hybrid` in `course_lib/parallel/hybrid/compose.py`
# hands these weights to `course_lib/parallel/clip.py`).

# %% [markdown]
# ## 4. What each dimension sends: measured against the model
#
# The `CommTracer` records the group of every call, so each byte can be attributed to the
# dimension whose group carried it. `topology.traffic_per_step` gives the formulas (summed over
# ranks): tp `R·tp·m` times Megatron's f and g, pp `2(S-1)` activation messages plus the tied
# embedding's gradient exchange, dp ZeRO-1's reduce-scatter and all-gather of the flat shards.
# It adds up one traffic model per axis: each axis package exports a function
# (`tp_traffic`, `pp_traffic`, `dp_traffic`, `ep_traffic`) that lists that axis's collectives
# of one step as records, and notebook 11's step-time model prices the very same records.

# %%
def measured_by_dim(results):
    out = {}
    for r in results:
        for dim, row in r.traffic.items():
            out[dim] = out.get(dim, 0) + row["bytes_sent"]
    return out


def traffic_table(results, dims, config):
    meas = measured_by_dim(results)
    model = topology.traffic_per_step(config, dims, TRAIN.batch_size)
    print(f"{'dimension':<10}{'measured (2 steps)':>20}{'model x 2':>14}")
    for dim in sorted(meas):
        expect = TRAIN.steps * model[dim]["bytes_sent"] if dim in model else None
        print(f"{dim:<10}{fmt_bytes(meas[dim]):>20}{fmt_bytes(expect) if expect else '-':>14}")
    return meas, model


meas_3d, model_3d = traffic_table(results, DIMS_3D, DENSE)
for dim in ("tp", "pp", "dp"):
    assert meas_3d[dim] == TRAIN.steps * model_3d[dim]["bytes_sent"], dim

# %% [markdown]
# The records behind those rows: what each collective is, how many calls rank 0 makes in one
# step (it holds the first stage, so the loss's all-reduces, on the last stage, are not its),
# and the bytes all ranks send (the row sums above). dp's all-reduce of the loss is the
# trainer's log of the loss, after the step. The pipeline's loss broadcast is not: the schedule
# sends the last stage's mean loss to every rank before the step ends, so it is part of the
# step's time.

# %%
from course_lib.estimate.traffic import step_traffic

for axis, records in step_traffic(DENSE, DIMS_3D, TRAIN.batch_size).items():
    for r in records:
        print(f"{axis:<5}{r.what:<58}{r.op:<15}{r.calls:>3} calls {fmt_bytes(r.world_bytes):>10}")
    if axis in model_3d:
        assert sum(r.world_bytes for r in records) == model_3d[axis]["bytes_sent"]

# %% [markdown]
# ("world" is the single all-reduce of the squared norm: 8 bytes per rank per step.) tp sends
# the most: four activation-sized all-reduces per layer, every micro-batch. pp sends one
# activation per stage boundary and micro-batch. dp sends the size of the model once per step.

# %% [markdown]
# ## 5. The fourth dimension: experts
#
# An MoE version of the same model (4 experts, top-2) on `pp 2 × dp 2 × ep 2`. The ep ranks
# also read different data: the batch is split over `dp · ep = 4` replicas. (TP of an MoE layer
# is not composed here: give MoE models tp = 1 and split the experts with ep.)

# %% tags=["nbval-ignore-output"]
DIMS_4D = ParallelDims(pp=2, dp=2, ep=2, zero=1, microbatches=2)
reference_moe = train_single(MOE, TRAIN)
results_moe = run_hybrid(DIMS_4D, MOE, TRAIN, trace=True, timeout_s=240)
print("losses:", [f"{x:.6f}" for x in results_moe[0].train_losses], "single:",
      [f"{x:.6f}" for x in reference_moe.train_losses])
meas_4d, model_4d = traffic_table(results_moe, DIMS_4D, MOE)

# %% tags=["nbval-ignore-output"]
torch.testing.assert_close(torch.tensor(results_moe[0].train_losses), torch.tensor(reference_moe.train_losses),
                           rtol=1e-5, atol=1e-6)  # fp32 sums in another order
assert meas_4d["ep"] == TRAIN.steps * model_4d["ep"]["bytes_sent"]

# %% [markdown]
# ## 6. Why the order of the dimensions matters
#
# On a real cluster, GPUs of one node share NVLink (H100: 450 GB/s each way) and nodes talk over
# the network, 400 Gb/s = 50 GB/s per GPU on InfiniBand (NDR) or on RoCE, RDMA over Ethernet
# (Llama 3 405B's, section 7): **9× slower**. Ranks are numbered node by node, so the
# dimension that varies fastest stays inside a node. Predict: with 8 ranks on two nodes of 4,
# which dimensions cross nodes in make_mesh's order, and in the reversed order?
#
# <details><summary>Answer</summary>
#
# make_mesh's order `(pp, dp, ep, tp)`: tp (stride 1) and dp (stride 2, span 4) stay in a node;
# pp (stride 4) crosses. Reversed `(tp, ep, dp, pp)`: pp and dp stay in, and tp, the heaviest,
# crosses the network.
# </details>

# %%
for name, order in (("topology-aware", topology.TOPOLOGY_AWARE), ("naive", topology.NAIVE)):
    print(f"{name:<15}", {d: topology.link_of(d, SIZES, 4, order) for d in ("tp", "dp", "pp")})
assert topology.link_of("tp", SIZES, 4) == "intra" and topology.link_of("tp", SIZES, 4, topology.NAIVE) == "inter"

# %% [markdown]
# **Which dimension goes outermost: two conventions.** Every large run keeps tp innermost, on
# NVLink. Beyond it, both choices are in use. Megatron-LM orders its groups `tp-cp-ep-dp-pp`
# (fastest first), so pp is outermost, as in make_mesh: a pipeline sends point to point between
# neighbouring stages, one activation per micro-batch, with no collective that spans many
# nodes (Narayanan et al. 2021). Llama 3 orders them `[TP, CP, PP, DP]`, so dp is outermost
# (Dubey et al. 2024, §3.3.2): its data parallelism is FSDP, which prefetches the next sharded
# weights and reduces gradients asynchronously, so it tolerates the network's latency, while
# the pipeline's sends sit on its critical path. Notebook 06's layout (dp outermost) and
# make_mesh's (pp outermost) are these two conventions; what they share is that the outermost
# dimension is the one whose traffic suffers least from the slower network.

# %% [markdown]
# ## 7. Case study: Llama 3 405B on 16,384 H100s
#
# Dubey et al. (2024, Table 4) trained Llama 3 405B with TP 8 (one node), PP 16, DP 128 at
# 38-43% MFU (and, for the long-context phase, context parallelism 16 that all-gathers keys and
# values: notebook 09, section 9, with the same simplifications as here). The course's
# estimator (notebooks 01 and 11) gives memory per GPU, step time and MFU for that layout, and
# `topology.placement` says which link each dimension's traffic takes.
#
# **What this models, and what it does not.** The estimate below is the *course's* composition
# at the paper's degrees: plain 1F1B, ZeRO-1 over dp, pp outermost. The published run differed
# in four ways (Dubey et al. 2024, §3.3): an interleaved pipeline schedule (with the micro-batch
# count tuned, and one layer fewer on the first and last stages to balance memory); FSDP over
# dp, sharding optimizer state, gradients and parameters but keeping the gathered parameters
# after the forward pass (no resharding, so no second all-gather in backward, ZeRO-2-like for
# the parameters); the order `[TP, CP, PP, DP]`, dp outermost (section 6); and no activation
# checkpointing at 8K sequence length. Read the numbers below as an estimate of a simpler
# neighbour of the real run; section 10 runs FSDP inside a pipeline and costs the layout as the
# paper ran it.

# %%
case = PUBLISHED["Llama 3 405B on 16k H100"]
L, B = case["dims"], case["global_batch"]
H100_BYTES = 80e9  # the spec sheet's 80 GB
fits = {}
for recompute in ("none", "full"):
    mem = per_gpu_memory(case["config"], batch=L.micro_batch(B), seq=case["seq"], zero_stage=L.zero, dp=L.dp,
                         tp=L.tp, pp=L.pp, sequence_parallel=True, recompute=recompute)
    print(f"recompute {recompute:<5}: busiest GPU {fmt_bytes(mem['total'])} (model state "
          f"{fmt_bytes(mem['params'] + mem['grads'] + mem['optimizer'])}, activations {fmt_bytes(mem['activations'])})"
          f" vs an H100's 80 GB = 74.5 GiB")
    fits[recompute] = mem["total"] <= H100_BYTES
print(f"the busiest GPU fits an H100 without recomputation: {fits['none']}; with full recomputation: {fits['full']}")
st = step_time(case["config"], L, case["cluster"], B, seq=case["seq"])
where = "below" if st["mfu"] < 0.38 else "within" if st["mfu"] <= 0.43 else "above"
print(f"step: {st['total']:.1f} s for {st['tokens'] / 1e6:.1f}M tokens; model MFU {st['mfu']:.0%}, "
      f"{where} the reported 38-43%")
dims_405 = ParallelDims(dp=L.dp, tp=L.tp, pp=L.pp, microbatches=L.microbatches)  # the bytes of plain dp and tp
placed = {}
nodes = topology.ClusterShape(8, case["cluster"].intra, case["cluster"].inter,  # NVLink 4 inside, RoCE between
                              "Llama 3 405B's H100 nodes")
for order_name, order in (("topology-aware", topology.TOPOLOGY_AWARE), ("naive", topology.NAIVE)):
    rows = topology.placement(case["config"], dims_405, case["global_batch"], nodes, order, seq=case["seq"])
    placed[order_name] = {r["dim"]: r for r in rows}
    print(order_name, "|", "; ".join(f"{r['dim']} {fmt_bytes(r['bytes_per_rank'])}/step on {r['link_name']}: "
                                     f"{r['seconds']:.2f} s" for r in rows))
times = topology.compare_orders(case["config"], dims_405, case["global_batch"], nodes, seq=case["seq"])
print(f"communication per step: topology-aware {times['topology_aware']:.1f} s, naive {times['naive']:.1f} s")
assert times["naive"] > 3 * times["topology_aware"]
aware, naive = placed["topology-aware"], placed["naive"]
heaviest = max(aware, key=lambda d: aware[d]["bytes_per_rank"])
crossing = sorted((d for d in aware if aware[d]["link"] == "inter"), key=lambda d: aware[d]["bytes_per_rank"])
print(f"heaviest: {heaviest}, {fmt_bytes(aware[heaviest]['bytes_per_rank'])} per rank and step: "
      f"{aware[heaviest]['seconds']:.2f} s on {aware[heaviest]['link_name']}, "
      f"{naive[heaviest]['seconds']:.2f} s on {naive[heaviest]['link_name']}")
print("crossing nodes in make_mesh's order, lightest first:",
      ", ".join(f"{d} {fmt_bytes(aware[d]['bytes_per_rank'])}" for d in crossing))

# %% [markdown]
# Read the three results:
#
# * **Memory.** The model state is small once it is split 8 × 16 ways and ZeRO-1 shards the
#   optimizer over 128 replicas; the activations dominate. The printout says whether the
#   busiest GPU (stage 0: 1F1B keeps `pp` micro-batches of 8192 tokens in flight there) fits
#   an H100 with and without recomputation in the course's model. Llama 3 itself trained at 8K
#   without activation checkpointing; the paper credits optimizations the course does not
#   model (one layer fewer on the first and last stages, each stage's input and output tensors
#   freed as soon as they are no longer needed; §3.3.2).
# * **Time.** The estimated MFU is compared with the reported 38-43% in the printout: the
#   right order of magnitude, from a model that charges the whole plain-1F1B bubble (the
#   interleaved schedule the paper used divides it by the number of virtual stages) and never
#   overlaps tp with compute.
# * **Order.** It matters more than either: the printout names the heaviest dimension, tp, and
#   the time its bytes take inside a node and across the network (RoCE for the 405B, Dubey et
#   al. 2024, §3.3.1; the same 400 Gb/s per GPU as NDR InfiniBand). That is why every large run
#   keeps tp inside the NVLink domain and lets the lighter dimensions cross nodes (printed,
#   lightest first; section 6 says which of them goes outermost).

# %% [markdown]
# ## 8. Try layouts
#
# Choose a layout of 8 ranks, the GPUs per node and the order; see the groups, the link each
# dimension takes, its traffic per step and the memory per rank for a 1.3B-class GPT with 8
# experts (bf16, ZeRO-1). Try `tp 8` on nodes of 4, and the naive order with `tp 2`.

# %%
show_interactive(lambda: mesh_figures.mesh_view(), mesh_figures.mesh_widget)

# %% [markdown]
# ## 9. Layouts that cannot work
#
# `ParallelDims.check` rejects them in the parent, before any rank starts or waits.

# %%
for kw, world in ((dict(dp=2, tp=2), 8), (dict(dp=2, tp=4), 8), (dict(dp=2, pp=4), 8), (dict(dp=4, ep=2), 8),
                  (dict(dp=8, microbatches=3), 8)):
    try:
        ParallelDims(**kw).check(world, DENSE, TRAIN.batch_size)
    except ValueError as err:
        print(f"{kw}: {err}")

# %% [markdown]
# ## 10. FSDP inside a pipeline
#
# Section 3 composed ZeRO-1 with tp and pp. ZeRO-2 and ZeRO-3 (FSDP) act *inside* backward, and
# a pipeline stage runs one backward per micro-batch: `m` of them per step, interleaved with
# other micro-batches' forwards. Two questions then have two answers each.
#
# * **When are gradients reduced?** After every micro-batch's backward (`m` reduce-scatters of
#   the stage's gradient per step), or once, when the last micro-batch's backward has made
#   each gradient final. The course's engine (`ParallelDims(zero=2 or 3)` with pp or tp)
#   reduces once per step, as PyTorch's pipelining does with FSDP2 and Megatron's distributed
#   optimizer does: `m` times fewer calls and bytes, for holding the stage's unsharded gradient
#   through the step.
# * **When are a ZeRO-3 stage's gathered parameters freed?** `reshard_after_forward=True`:
#   after every micro-batch's forward, gathered again for its backward, freed again.
#   `False`: gathered at the step's first forward and kept until the step's reduce-scatter
#   (Llama 3's choice, and torchtitan's default whenever pp > 1).
#
# Predict: a pipeline rank holds `U` flat units (the course's engine: its chunk's matrices and
# its chunk's vectors, two per chunk) and runs `m` micro-batches. How many all-gathers per step
# does it make under each policy, and what does the cheaper one cost in memory?
#
# <details><summary>Answer</summary>
#
# `True`: every unit is gathered before each micro-batch's forward and again before its
# backward, `2mU` all-gathers of the rank's whole parameters' worth, `2m` times its shards'
# bytes sent. `False`: `U` all-gathers, once. The ratio is `2m`, in calls and in bytes. The
# price: without resharding the rank holds its whole stage unsharded for the step; with it,
# one chunk at a time (FSDP wrapping each transformer block: one block at a time). Either way
# one reduce-scatter per unit per step.
# </details>
#
# The run: dp 2 × pp 2 with two chunks per rank (interleaved 1F1B, a 4-block model), ZeRO-3,
# under both policies, against the single process. The tracer counts the all-gathers on each
# rank's dp group; `zero_pp_ops` is the estimator's formula for them, and
# `composed_zero_memory` its count of the gathered bytes at the peak.

# %% tags=["nbval-ignore-output"]
DENSE4 = replace(DENSE, n_layer=4)
reference4 = train_single(DENSE4, TRAIN)
fsdp_runs = {}
for reshard in (True, False):
    dims = ParallelDims(dp=2, pp=2, virtual_stages=2, schedule="interleaved_1f1b", microbatches=2, zero=3,
                        reshard_after_forward=reshard)
    fsdp_runs[reshard] = (dims, run_hybrid(dims, DENSE4, TRAIN, trace=True, timeout_s=240))
    for step, (a, b) in enumerate(zip(fsdp_runs[reshard][1][0].train_losses, reference4.train_losses)):
        print(f"reshard_after_forward={reshard!s:<5} step {step}: loss {a:.6f}   single process {b:.6f}")
for dims, results_z in fsdp_runs.values():  # fp32 sums in another order, as in section 3
    torch.testing.assert_close(torch.tensor(results_z[0].train_losses), torch.tensor(reference4.train_losses),
                               rtol=1e-5, atol=1e-6)

# %%
for reshard, (dims, results_z) in fsdp_runs.items():
    r = next(r for r in results_z if r.coords["dp"] == 0 and r.coords["pp"] == 0)  # rank 0
    traced = {op: {k: v // TRAIN.steps for k, v in r.zero_ops[op].items()} for op in ("all_gather", "reduce_scatter")}
    formula = zero_pp_ops(DENSE4, dims, rank=0)
    peak = composed_zero_memory(DENSE4, dims, "fp32", rank=0)["gathered"]
    print(f"reshard_after_forward={reshard!s:<5} units {list(r.zero_units.values())}, m = {dims.microbatches}")
    for op in ("all_gather", "reduce_scatter"):
        print(f"   {op:<14} per step: traced {traced[op]['calls']:>2} calls, {traced[op]['bytes_sent']:>6} B sent"
              f" | formula {formula[op]['calls']:>2} calls, {formula[op]['bytes_sent']:>6} B")
    print(f"   gathered parameters at the peak: measured {fmt_bytes(r.memory['gathered_peak'])}, "
          f"estimator {fmt_bytes(peak)}")
    for rk in results_z:  # every rank, exactly (integers)
        assert {op: {k: v // TRAIN.steps for k, v in rk.zero_ops[op].items()} for op in formula} == \
            zero_pp_ops(DENSE4, dims, rank=rk.coords["pp"])
        assert rk.memory["gathered_peak"] == composed_zero_memory(DENSE4, dims, "fp32", rk.coords["pp"])["gathered"]
calls = {k: zero_pp_ops(DENSE4, d, 0)["all_gather"]["calls"] for k, (d, _) in fsdp_runs.items()}
assert calls[True] == 2 * fsdp_runs[True][0].microbatches * calls[False]

# %% [markdown]
# The reduce-scatters are the same under both policies: one per unit per step, whatever `m`.
# The all-gathers differ by exactly `2m`, and the peak of gathered parameters by the chunk
# the rank does not run at that moment.
#
# **Llama 3 405B as the paper ran it.** Dubey et al. (2024, §3.3.2 and Table 4) give, for the
# 8K-sequence phase on 16,384 H100s: TP 8, CP 1, PP 16, DP 128, 16 sequences of 8,192 tokens
# per data-parallel group (16M tokens per batch), the order `[TP, CP, PP, DP]`, an interleaved
# schedule with several stages per pipeline rank, FSDP over dp that "shards optimizer states and
# gradients, but for model shards we do not reshard after forward computation", and no
# activation checkpointing at 8K. The paper does not print the number of stages per rank or
# the micro-batch size: below, two chunks per rank and one sequence per micro-batch (16
# micro-batches) are the course's assumptions, as are 128 equal layers standing in for the 126
# (the paper gives the first and last stages one layer fewer; `PUBLISHED`'s two extra layers
# stand for the embedding's and the head's work).
# The estimator gives the busiest GPU's bytes under each policy, with the course's unit (a
# chunk) and with FSDP's usual one (a transformer block).

# %%
case = PUBLISHED["Llama 3 405B on 16k H100"]
LLAMA_FSDP = ParallelDims(dp=128, tp=8, pp=16, virtual_stages=2, schedule="interleaved_1f1b", microbatches=16,
                          zero=3, sequence_parallel=True)
print(LLAMA_FSDP.describe(case["global_batch"]), f"on {LLAMA_FSDP.world_size} GPUs, sequences of {case['seq']}")
rows, ops = {}, {}
for reshard in (True, False):
    dims = replace(LLAMA_FSDP, reshard_after_forward=reshard)
    ops[reshard] = zero_pp_ops(case["config"], dims, rank=0, param_bytes=2, grad_bytes=2)
    for unit in ("chunk", "block"):
        rows[reshard, unit] = memory_per_rank(case["config"], dims, case["global_batch"], case["seq"],
                                              fsdp_unit=unit)
print(f"{'reshard_after_forward':<22}{'unit':<7}" + "".join(f"{k:>13}" for k in
      ("params", "grads", "optimizer", "gathered", "activations", "total")))
for (reshard, unit), mem in rows.items():
    print(f"{reshard!s:<22}{unit:<7}" + "".join(f"{fmt_bytes(mem[k]):>13}" for k in
          ("params", "grads", "optimizer", "gathered", "activations", "total")))
for reshard, o in ops.items():
    print(f"reshard_after_forward={reshard!s:<5}: {o['all_gather']['calls']:>3} all-gathers per step on a rank, "
          f"{fmt_bytes(o['all_gather']['bytes_sent'])} sent; {o['reduce_scatter']['calls']} reduce-scatters, "
          f"{fmt_bytes(o['reduce_scatter']['bytes_sent'])} sent")
extra = rows[False, "block"]["gathered"] - rows[True, "block"]["gathered"]
print(f"keeping the stage gathered costs {fmt_bytes(extra)} more per GPU than per-block resharding and saves "
      f"{ops[True]['all_gather']['calls'] - ops[False]['all_gather']['calls']} all-gathers "
      f"({fmt_bytes(ops[True]['all_gather']['bytes_sent'] - ops[False]['all_gather']['bytes_sent'])}) per step")
print(f"activations alone: {fmt_bytes(rows[False, 'chunk']['activations'])} of an H100's 80 GB = 74.5 GiB")
assert ops[True]["all_gather"]["calls"] == 2 * LLAMA_FSDP.microbatches * ops[False]["all_gather"]["calls"]
assert rows[True, "block"]["gathered"] < rows[True, "chunk"]["gathered"] < rows[False, "chunk"]["gathered"]

# %% [markdown]
# Read the table:
#
# * **The policy.** Keeping the stage gathered costs the difference printed above, in bf16
#   parameters per GPU, and removes `2m - 1` of every `2m` all-gathers, which on the slowest
#   dimension (dp is outermost in `[TP, CP, PP, DP]`, across the network) is the trade Llama 3
#   made. The reduce-scatters do not depend on the policy.
# * **The gradient.** The course's engine accumulates each micro-batch's gradient unsharded
#   and reduce-scatters once per step, so the whole stage's gradient is held during the step
#   ("grads"); only the reduced gradient is sharded. The paper says its FSDP shards gradients
#   and accumulates them in FP32 over micro-batches; it does not say when they are reduced.
# * **The total.** The estimator puts the activations of 16 micro-batches in flight at 8K
#   tokens without recomputation above what an H100 holds. The paper reports training at 8K
#   without activation checkpointing after freeing each stage's input and output tensors as soon
#   as they were no longer needed, found by memory profiling (§3.3.2): the estimator counts
#   every tensor the course's model keeps, and the gap is what that engineering removed. The
#   paper's authors built their own memory estimator for this search (§3.3.2).

# %% [markdown]
# ## Self-check
#
# 1. A run has tp 8, pp 4, dp 16 on nodes of 8 GPUs. Which groups stay inside a node?
# 2. Why does the ZeRO-1 shard count on every dp rank in the global norm, but a LayerNorm
#    gain only on tp rank 0?
# 3. With `pp 2`, rank 0 and rank 4 both hold the tied embedding. What do they exchange after
#    the backward, and why does the norm count it once?
# 4. A pipeline stage under ZeRO-3 runs `m = 8` micro-batches a step. How many times is each
#    of its units all-gathered, and how many times reduce-scattered, with
#    `reshard_after_forward=True`? And with `False`?
#
# <details><summary>Answers</summary>
#
# 1. Only tp (stride 1, span 8). dp has stride 8 and pp stride 128: both cross nodes.
# 2. After the reduce-scatter each dp rank holds a *different* slice of the mean gradient; a
#    LayerNorm gain is replicated on every tp rank, identical, so only one copy may count.
# 3. Each holds part of its gradient (embedding use, head use); they send each other their
#    part and add. Both then hold the full gradient: the norm counts stage 0's copy only.
# 4. `True`: gathered 2m = 16 times (before each micro-batch's forward and again before its
#    backward), reduce-scattered once (the gradient accumulated over the 8 backwards). `False`:
#    gathered once and kept for the whole step, still reduce-scattered once.
# </details>

# %%
def coords(rank, sizes):
    return topology.coordinates(rank, sizes)


big = dict(pp=4, dp=16, ep=1, tp=8)
assert [topology.link_of(d, big, 8) for d in ("tp", "dp", "pp")] == ["intra", "inter", "inter"]
assert coords(5, SIZES) == {"pp": 1, "dp": 0, "ep": 0, "tp": 1}
print("self-checks passed")


# %% [markdown]
# ## References
#
# * Shoeybi et al. 2019, *Megatron-LM: Training Multi-Billion Parameter Language Models Using
#   Model Parallelism*: tensor parallelism inside a node.
# * Rajbhandari et al. 2020, *ZeRO: Memory Optimizations Toward Training Trillion Parameter
#   Models*: sharding the optimizer state (and gradients, parameters) over data parallelism.
# * Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters Using
#   Megatron-LM*: the tp × pp × dp composition, the interleaved schedule, and why tp stays in a
#   node.
# * Dubey et al. 2024, *The Llama 3 Herd of Models*, §3.3: 4D parallelism on 16,384 H100s, the
#   `[TP, CP, PP, DP]` order and FSDP over dp without resharding after forward.
# * Zhao et al. 2023, *PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel*: the
#   units FSDP gathers and frees, and the reshard-after-forward trade.
# * Further reading: Korthikanti et al. 2022, *Reducing Activation Recomputation in Large
#   Transformer Models* (sequence parallelism and selective recomputation, what lets such runs
#   skip most recomputation); Liang et al. 2024, *TorchTitan* (FSDP2, TP, PP and CP composed on
#   one PyTorch DeviceMesh); Jiang et al. 2024, *MegaScale* (the same composition at 10,000+
#   GPUs, with what it takes to keep it running).
#
# Next: write the mesh's bookkeeping yourself (coordinates, groups, and which link each
# dimension crosses) in `exercises/ex10_mesh_coordinates.ipynb`.
