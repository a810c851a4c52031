# %% [markdown]
# # 12 · Capstone: plan, train, break and resume a model end to end
#
# Every earlier notebook built one piece. Here they run together, as they would on a real
# cluster: choose a model and a budget, ask the planner (notebook 10) for layouts, pick one and
# say why, train the course GPT on a dp x tp x pp mesh of 8 ranks (notebook 09) with ZeRO-1
# (notebook 08), save the full training state, **lose half the ranks**, resume on the 4 that
# remain (notebook 11's resharding), and check that the loss curve is the single process's.
# Then read what each mesh dimension moved, set the prediction against the measurement, and
# let the trained model write some text.
#
# **After this notebook you can**
#
# * describe a training run in a small config file, one key per degree, and have every key
#   checked before any rank starts;
# * read the planner's ranking for your model and budget and justify the layout you run;
# * train a 3D layout, checkpoint it, resume at another world size and prove nothing was lost;
# * attribute the bytes of a step to the mesh dimension that moved them;
# * compare predicted with measured step time and explain the gap on this machine.

# %%
%matplotlib inline
import pathlib
import tempfile

import matplotlib.pyplot as plt
import torch

from course_lib.capstone import layout_text, load_config, run_capstone
from course_lib.data import CharDataset
from course_lib.estimate.planner import plan
from course_lib.estimate.step_time import Layout, memory_per_rank, step_time
from course_lib.estimate.validation import load_validation
from course_lib.model import GPT
from course_lib.units import fmt_bytes

ROOT = pathlib.Path.cwd().parent if pathlib.Path.cwd().name == "notebooks" else pathlib.Path.cwd()

# %% [markdown]
# ## 1. The run, in one file
#
# `configs/capstone_tiny.toml` holds the whole run: the model, the training budget, the layout
# of the first 8 ranks (`[layout]`) and of the 4 left after the failure (`[resume]`), one key
# per degree. `load_config` checks every key against the model and the batch, so a wrong one
# fails here, naming the key, instead of as a hang on rank 5.

# %%
config = load_config(ROOT / "configs" / "capstone_tiny.toml")
print("first run:", layout_text(config.layout), f"micro-batches {config.layout.microbatches}")
print("resumed:  ", layout_text(config.resume), f"micro-batches {config.resume.microbatches}")
print(f"model: {config.model.n_layer} layers, d_model {config.model.d_model}, {config.model.n_head} heads; "
      f"{config.train.steps} steps of {config.train.batch_size} sequences, saved after step {config.checkpoint_step}")
try:
    from course_lib.capstone import config_from_dict
    import tomllib

    raw = tomllib.loads((ROOT / "configs" / "capstone_tiny.toml").read_text())
    raw["layout"]["tp"] = 3
    config_from_dict(raw)
except ValueError as err:
    print("a wrong key is named:", err)

# %% [markdown]
# ## 2. Ask the planner, then choose
#
# The planner ranks every layout of the 8 devices by predicted step time, using the cluster
# that notebook 10 measured on this kind of machine (8 gloo ranks sharing two cores).
#
# **Predict:** for a model this small, will the planner put tensor parallelism in its best
# layout?

# %%
cluster = load_validation()["cluster"]
SEQ = config.model.block_size
p = plan(config.model, cluster, config.train.batch_size, SEQ, "fp32")
print(p.table(5))
print(p.explain())
ours = Layout(dp=config.layout.dp, tp=config.layout.tp, pp=config.layout.pp, m=config.layout.microbatches,
              micro_batch=config.train.batch_size // (config.layout.dp * config.layout.microbatches),
              zero_stage=config.layout.zero)
predicted = step_time(config.model, ours, cluster, SEQ, "fp32")
memory = memory_per_rank(config.model, ours, SEQ, "fp32")
print(f"ours: {ours.label()}: predicted {predicted['total'] * 1e3:.3g} ms per step, "
      f"{fmt_bytes(memory['total'])} per rank, {predicted['total'] / p.best.time['total']:.2f} x the best")
assert p.best.layout.tp == 1 and memory["total"] < cluster.memory_bytes

# %% [markdown]
# <details><summary>Answer, and why we run dp2 x tp2 x pp2 anyway</summary>
#
# No: a 16-wide model gains nothing from splitting its matrices, and every TP all-reduce sits
# on the critical path. The planner prefers data and pipeline parallelism. We run
# dp2 x tp2 x pp2 on purpose, because it exercises all three dimensions, the point of this
# capstone; on a real model (notebook 10's 70B) the same planner puts tp = 8 inside a node.
# A layout is chosen for a reason you can state: here "cover every dimension", there "fit
# memory, then fastest".
# </details>
#
# ## 3. Train, save, lose ranks, resume
#
# `run_capstone` trains steps 1-2 on 8 ranks and saves the model, Adam's state, the data
# position and every rank's RNG; then the 8-rank job is gone, as after a failure. Four new
# ranks load that checkpoint, resharded by global offsets into dp1 x tp2 x pp2, and train
# steps 3-4. Last, one process trains all 4 steps on the same batches.
#
# **Predict:** will the resumed 4-rank curve equal the single process's exactly, or only
# to float rounding?

# %% tags=["nbval-ignore-output"]
checkpoints = pathlib.Path(tempfile.mkdtemp(prefix="capstone-"))
run = run_capstone(config, checkpoints, timeout_s=240, progress=True)
steps = range(1, config.train.steps + 1)
print("saved:", sorted(d.name for d in checkpoints.iterdir()))
assert run.max_difference < 1e-4

# %% tags=["nbval-ignore-output"]
print("3D then resumed:", " ".join(f"{x:.5f}" for x in run.losses))
print("single process: ", " ".join(f"{x:.5f}" for x in run.single_losses))
print(f"largest |difference| {run.max_difference:.2e}")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(steps, run.single_losses, "k-", label="single process", lw=3, alpha=0.3)
ax.plot(steps[:config.checkpoint_step], run.losses[:config.checkpoint_step], "o-", label=layout_text(config.layout))
ax.plot(steps[config.checkpoint_step:], run.losses[config.checkpoint_step:], "s-", label=layout_text(config.resume))
ax.axvline(config.checkpoint_step + 0.5, color="gray", ls=":")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.set_title("Saved at 8 ranks, resumed at 4"); ax.legend()
plt.show()

# %% [markdown]
# <details><summary>Answer</summary>
#
# To float rounding (about 1e-6): the sums of a gradient taken over other shards, in another
# order, round differently. Nothing else may differ. Forget the data position or Adam's
# state in the checkpoint and the difference jumps by orders of magnitude (notebook 11).
# </details>
#
# ## 4. What each dimension moved
#
# The tracer recorded every collective of the 8-rank segment and `traffic_by_dimension`
# attributed each to the mesh dimension of its group.

# %%
print(f"{'dimension':<10}{'calls':>7}{'sent by rank 0':>16}")
for dim, t in run.traffic[0].items():
    print(f"{dim:<10}{t['calls']:>7}{fmt_bytes(t['bytes_sent']):>16}")
assert all(run.traffic[0][d]["bytes_sent"] > 0 for d in ("dp", "tp", "pp"))

# %% [markdown]
# ## 5. Predicted against measured, and the report

# %% tags=["nbval-ignore-output"]
measured = sorted(run.first.step_seconds)[len(run.first.step_seconds) // 2]
tokens = config.train.batch_size * SEQ
print("capstone report")
print(f"  layout           {layout_text(config.layout)} -> {layout_text(config.resume)} after step "
      f"{config.checkpoint_step}")
print(f"  step time        predicted {predicted['total'] * 1e3:.3g} ms, measured {measured * 1e3:.3g} ms "
      f"({measured / predicted['total']:.1f} x)")
print(f"  tokens/s         {tokens / measured:,.0f} measured, {tokens / predicted['total']:,.0f} predicted")
print(f"  memory per rank  {fmt_bytes(memory['total'])} predicted (model state + activations)")
print("  bytes per dim    " + ", ".join(f"{d} {fmt_bytes(t['bytes_sent'])}" for d, t in run.traffic[0].items()))
print(f"  loss             {run.losses[-1]:.4f} after {len(run.losses)} steps (single process "
      f"{run.single_losses[-1]:.4f}); MFU is reported on a GPU only")
assert measured > 0

# %% [markdown]
# The measured step is slower than predicted, for the reasons notebook 10 found: eight ranks
# share two cores, so every collective waits for descheduled peers, and a step this small is
# all latency. On GPUs, where each rank owns its device, the same comparison lands within
# tens of percent (Narayanan et al. 2021).
#
# ## 6. The trained model writes
#
# The parameters of every rank, gathered by their single-process names, load into one GPT.

# %% tags=["nbval-ignore-output"]
model = GPT(config.model, seed=123)
with torch.no_grad():
    for name, param in model.named_parameters():
        param.copy_(run.params[name])
data = CharDataset("train", SEQ)
start = torch.tensor([data.tokenizer.encode("The ")])
out = model.generate(start, 40, temperature=0.0)
text = data.tokenizer.decode(out[0].tolist())
print(repr(text))
assert len(text) == 44 and text.startswith("The ")

# %% [markdown]
# Four steps of a 16-wide model write mostly noise; train longer (raise `steps` in the config
# and run the torchrun command below) and the text turns into words.
#
# ## 7. The same run under torchrun
#
# For a real failure, run it from a terminal: the first command trains steps 1-2 on 8
# processes and saves; then rank 3 kills itself (SIGKILL, no clean-up), torchrun sees the dead
# worker and stops the job. The second resumes on 4 processes and checks the whole curve
# against the single process. On GPUs the same commands use NCCL.
#
# ```bash
# torchrun --standalone --nproc-per-node 8 -m course_lib.demos.capstone \
#     --config configs/capstone_tiny.toml --checkpoint-dir /tmp/capstone --kill-rank 3
# torchrun --standalone --nproc-per-node 4 -m course_lib.demos.capstone \
#     --config configs/capstone_tiny.toml --checkpoint-dir /tmp/capstone --resume --check
# ```
#
# ## Self-check
#
# 1. Why must every key be checked before the process group starts?
# 2. What four things does the checkpoint hold besides the weights, and which one would make
#    the resumed curve differ if it were missing?
# 3. Which dimension moved the most bytes in section 4, and why is it on the critical path?
#
# <details><summary>Answers</summary>
#
# 1. A bad layout found by one rank leaves the others waiting in a collective: a hang, not an
#    error. Checked in every process first, it is one line naming the key.
# 2. Adam's state, the step, the data position, every rank's RNG. Each one: without Adam's
#    state the update restarts from m = v = 0, without the data position batches repeat.
# 3. Tensor parallelism: its all-reduces sit between the layers of every forward and backward,
#    so nothing can overlap them (Shoeybi et al. 2019).
# </details>

# %%
print("self-check: the resumed curve equals the single process's:", run.max_difference < 1e-4)
assert run.max_difference < 1e-4
