# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/12_checkpoints_elastic.ipynb)

# %% [markdown]
# # 12 · Checkpoints that survive failures
#
# A training run on thousands of GPUs *will* be interrupted: a GPU falls off the bus, a host
# loses power, a link flaps. What decides whether that costs minutes or days is the
# **checkpoint**: a copy of the whole training state, saved often enough, quickly enough, and
# safely enough that the run can restart from it and continue **exactly** as if nothing had
# happened. This notebook builds one, breaks it on purpose, runs PyTorch's own distributed
# checkpoint beside it, and kills a rank of a real `torchrun` job to watch the group restart
# and the loss curve line up.
#
# **After this notebook you can**
#
# * estimate how often a job on $n$ GPUs fails from published numbers (Llama 3: 466
#   interruptions in 54 days) and choose a checkpoint interval with Young/Daly's
#   $\tau^* = \sqrt{2\,\delta\,M}$ from a measured save time $\delta$;
# * list everything a resumable training state holds (model, optimizer, step, data position,
#   every rank's RNG) and predict what goes wrong when one piece is missing;
# * describe a sharded checkpoint by global shapes and each rank's boxes (offsets, lengths),
#   and reshard it to another world size or layout by box intersection;
# * make a save atomic, and recognise a missing, truncated or corrupted shard before it loads;
# * say what an asynchronous save hides and what it costs;
# * save an FSDP2 model's state with PyTorch's `torch.distributed.checkpoint` (synchronously and
#   asynchronously) on 4 ranks and load it on 2, and read its metadata as boxes;
# * run elastic recovery under `torchrun` and say what torchft-style fault tolerance adds.

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
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import matplotlib.pyplot as plt
import torch

from course_lib import run_on_ranks
from course_lib.checkpoint import (CheckpointError, CheckpointReader, checkpoint_path, flat_range_boxes,
                                   index_runs, latest_checkpoint, load_training_state)
from course_lib.checkpoint.interval import (LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_INTERRUPTIONS, LLAMA3_UNEXPECTED,
                                            job_mtbf_hours,
                                            llama3_job_mtbf_hours, llama3_per_gpu_mtbf_hours, wasted_fraction,
                                            young_daly_interval)
from course_lib.checkpoint.reshard import Box
from course_lib.checkpoint.training import read_events, train_with_checkpoints
from course_lib.checkpoint import viz
from course_lib.demos import elastic as elastic_demo
from course_lib.parallel.tp import qkv_rows
from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig
from course_lib.units import fmt_bytes

torch.manual_seed(0)
VOCAB = CharDataset("train", 32).vocab_size
CONFIG = GPTConfig.tiny(VOCAB, block_size=32, n_layer=2, n_head=2, d_model=32)
WORK = pathlib.Path(tempfile.mkdtemp(prefix="nb11_"))  # every checkpoint of this notebook lives here
print(f"course GPT: {GPT(CONFIG).num_params():,} parameters")


def cfg(steps):
    return TrainConfig(steps=steps, batch_size=8, progress=False)


def train(world, steps, directory, every=0, layout="zero", **kw):
    """train_with_checkpoints on `world` ranks; returns rank 0's TrainResult."""
    return run_on_ranks(train_with_checkpoints, CONFIG, cfg(steps), str(WORK / directory), every, layout,
                        world_size=world, timeout_s=180, **kw)[0]


# %% [markdown]
# ## 1. Failures are routine at scale
#
# Meta's Llama 3 report (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4) counts
# **466 job interruptions in a 54-day snapshot** of pre-training the 405B model on up to
# 16,384 H100s: 47 planned (maintenance), 419 unexpected, mostly hardware (GPUs, their HBM,
# hosts, network). If each GPU fails independently with a mean time between failures $M_1$,
# a job that stops when *any* of its $n$ GPUs fails has $M = M_1 / n$.
#
# **Predict:** from those numbers, how many hours between interruptions did the job see? And
# what per-GPU MTBF (in years) does that imply?
#
# <details><summary>Answer</summary>
#
# 54 × 24 / 466 ≈ 2.8 hours between interruptions. Counting only the 419 unexpected ones,
# $M_1 = 16384 × 54 × 24 / 419$ ≈ 50,700 hours ≈ 5.8 years per GPU: a very reliable part,
# which fails every few hours when you own sixteen thousand of them.
# </details>

# %%
per_gpu_h = llama3_per_gpu_mtbf_hours()
print(f"Llama 3: {LLAMA3_INTERRUPTIONS} interruptions in {LLAMA3_DAYS} days on {LLAMA3_GPUS:,} GPUs "
      f"-> one every {llama3_job_mtbf_hours():.2f} h")
print(f"implied per-GPU MTBF (unexpected only): {per_gpu_h:,.0f} h = {per_gpu_h / 24 / 365:.1f} years")
gpus = [8, 64, 512, 4096, 16384, 131072]
for n in gpus:
    print(f"{n:>7,} GPUs: a failure every {job_mtbf_hours(per_gpu_h, n):>9.2f} h")
# the same quotient computed two ways: equal up to float64 rounding (~1e-15 relative)
assert abs(job_mtbf_hours(per_gpu_h, LLAMA3_GPUS) - llama3_job_mtbf_hours(unexpected_only=True)) < 1e-9

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.loglog(gpus, [job_mtbf_hours(per_gpu_h, n) for n in gpus], "o-")
ax.axhline(llama3_job_mtbf_hours(), color="grey", ls="--", label="Llama 3 405B: 54 days / 466")
ax.set_xlabel("GPUs in the job")
ax.set_ylabel("job MTBF (hours)")
ax.legend()
plt.show()

# %% [markdown]
# ## 2. What a full training state is
#
# Resuming "as if never interrupted" needs every input of the next step:
#
# | part | what | if you forget it |
# |---|---|---|
# | model | the parameters | you start over |
# | optimizer | Adam's $m$, $v$ and step count | Adam restarts with $m=v=0$: a jump in the loss |
# | step | how many updates ran | learning-rate schedule and logging restart |
# | data position | the sampler's generator state | batches repeat, others are never seen |
# | RNG states | torch/Python/NumPy generators **of every rank** | different dropout masks |
#
# `course_lib.checkpoint.training.train_with_checkpoints` is the reference loop (data
# parallel over ZeRO-1 here: every rank owns half of the flat parameters and Adam's state,
# see notebook 08) with a save every `C` steps and a resume from the newest checkpoint. We
# train 12 steps without interruption, then 6 steps with a checkpoint at step 6, and resume
# from it three ways: correctly, forgetting the optimizer state, forgetting the data position.
#
# **Predict:** which resumed run matches the uninterrupted one, and how closely?

# %%
full = train(2, 12, "full")
train(2, 6, "cut", every=6)
for name in ("resume", "no_optimizer", "no_data"):  # three copies of the same checkpoint
    shutil.copytree(WORK / "cut", WORK / name)
runs = {"resumed": train(2, 12, "resume"),
        "resumed without optimizer state": train(2, 12, "no_optimizer", forget=("optimizer",)),
        "resumed without data position": train(2, 12, "no_data", forget=("data",))}
for name, r in runs.items():
    diff = max(abs(a - b) for a, b in zip(r.train_losses, full.train_losses))
    print(f"{name:<33} max |loss difference| = {diff:.1g}   "
          f"bit-exact: {r.train_losses == full.train_losses}")
assert runs["resumed"].train_losses == full.train_losses
assert torch.equal(runs["resumed"].final_params, full.final_params)
assert all(r.train_losses != full.train_losses for k, r in runs.items() if "without" in k)

fig, ax = plt.subplots(figsize=(6.5, 3.4))
steps = range(1, 13)
ax.plot(steps, full.train_losses, "k-", lw=3, alpha=0.3, label="uninterrupted")
for (name, r), style in zip(runs.items(), ("o", "--", ":")):
    ax.plot(steps, r.train_losses, style, label=name)
ax.axvline(6.5, color="grey", lw=0.8)
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# <details><summary>Answer</summary>
#
# Only the full resume, and **bit for bit**: same losses, same final parameters. Without
# Adam's moments the first update after the resume is a full-size step in the sign direction
# (Adam's bias correction with $m = v = 0$), and the run drifts away; without the data
# position the run re-reads batches 1-6, which it has already learned from. Bit-exact is the
# right bar when you check a resume: a tolerance would hide a forgotten RNG state.
# </details>

# %% [markdown]
# ## 3. A sharded checkpoint and its metadata
#
# With $N$ ranks each holding a part of the state, a single-file `torch.save` would first
# gather everything on one rank (its memory, and one disk link). Instead **every rank writes
# its own pieces** and one file describes how they fit together: the **global shape** of each
# tensor and, for each piece, the rank's **box** in it (offsets and lengths along every
# dimension). That is the course's own format below (one `.pt` file per rank plus
# `metadata.json`), and the same idea as PyTorch's `torch.distributed.checkpoint` (DCP), which
# section 7 runs on an FSDP2 model.

# %%
step6 = checkpoint_path(WORK / "cut", 6)
print(sorted(p.name for p in step6.iterdir()))
reader = CheckpointReader(step6)
print(f"saved at {reader.world_size} ranks; {len(reader.tensors)} tensors")
writers = {}
for key, m in reader.tensors.items():
    writers.setdefault(" + ".join(sorted({p["file"] for p in m["pieces"]})), []).append(key)
for files, keys in sorted(writers.items()):
    print(f"{len(keys):>3} tensors written by {files}")
split = next(k for k, m in reader.tensors.items() if k.startswith("model.") and len(m["pieces"]) > 1)
for key in (split, "optim." + split[len("model."):] + ".exp_avg", "optim." + split[len("model."):] + ".step"):
    m = reader.tensors[key]
    print(f"{key}: global shape {m['shape']}")
    for p in m["pieces"]:
        print(f"    {p['file']}  offsets {p['offsets']}  lengths {p['lengths']}")

# %% [markdown]
# Every element is written once. A tensor that lies wholly inside one rank's part of a flat
# ZeRO unit is written by that rank alone; a replicated value (Adam's step counter) by rank 0
# only. The tensor printed above straddles the boundary between the two ranks' flat shards:
# ZeRO cuts the flattened matrix anywhere, so each rank holds some whole rows and perhaps part
# of a row, and its Adam moments are cut the same way. A flat range of a row-major matrix is
# at most **three boxes**: a partial first row, whole rows, a partial last row
# (`reshard.flat_range_boxes`). The metadata also records every file's size and SHA-256
# (section 5).

# %%
print(flat_range_boxes((4, 5), 3, 17))

fig, axes = plt.subplots(1, 3, figsize=(10, 2.8))
boxes = [[b for b, _ in flat_range_boxes((4, 5), 0, 3)], [b for b, _ in flat_range_boxes((4, 5), 3, 17)],
         [b for b, _ in flat_range_boxes((4, 5), 17, 20)]]
viz.draw_boxes(axes[0], (4, 5), boxes, "flat shards [0,3) [3,17) [17,20)\nof a 4x5 matrix")
d = CONFIG.d_model
q_rows = [[Box((g, 0), (n, d)) for g, _, n in index_runs(rows, 3 * d)] for rows in qkv_rows(d, 2)]
viz.draw_boxes(axes[1], (3 * d, d), q_rows, "tensor parallel qkv.weight, tp=2:\nQ, K, V heads of each rank")
viz.draw_boxes(axes[2], (3 * d, d), [[Box((0, 0), (3 * d, d))]], "one process:\none box")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Resharding by global offsets
#
# Loading never asks "which rank wrote this?", only "which saved boxes overlap the box I need?".
# For a wanted box $B$ and a saved box $A$ of the same tensor, the overlap is, per dimension,
# $[\max(A_o, B_o),\ \min(A_o + A_\ell, B_o + B_\ell))$; copy it, and the wanted box is complete
# when the overlaps' volumes add up to its own. Old and new world sizes never appear: the
# same code loads ZeRO at 4 ranks into ZeRO at 2, ZeRO into plain data parallel, a
# tensor-parallel checkpoint into one process, or a dp × tp × pp layout of notebook 10 into
# another one: each layout only has to say which boxes its rank holds.
#
# **Predict:** a flat vector of 10 elements was saved by 4 ranks (shards of 3, the last one
# padded). Which saved files does rank 1 of 3 new ranks read?
#
# <details><summary>Answer</summary>
#
# New rank 1 owns [4, 8) (shards of ⌈10/3⌉ = 4). Old shards are [0,3) [3,6) [6,9) [9,12):
# it reads [4,6) from old rank 1 and [6,8) from old rank 2, and never opens files 0 and 3.
# </details>

# %%
fig, ax = plt.subplots(figsize=(8, 2.2))
viz.draw_flat_reshard(ax, 10, 4, 3)
plt.show()

# %% [markdown]
# Now for real: the checkpoint saved above at 2 ranks, resumed at **1** rank. The gradient is
# now averaged over one rank's whole batch instead of two halves, so the additions happen in
# another order: expect agreement to float rounding, not bit for bit.

# %%
shutil.copytree(WORK / "cut", WORK / "one_rank")
one = train(1, 12, "one_rank")
diff = max(abs(a - b) for a, b in zip(one.train_losses, full.train_losses))
print(f"resumed at 1 rank from a 2-rank checkpoint: steps 1-6 restored equal: "
      f"{one.train_losses[:6] == full.train_losses[:6]}, steps 7-12 within 1e-5: {diff < 1e-5}")
assert one.train_losses[:6] == full.train_losses[:6] and diff < 1e-5  # fp32 sums in another order: ~1e-7
# Parameters after 6 more AdamW steps: in RMS, against a hundredth of one step (lr). AdamW magnifies the
# rounding of gradients near zero (notebook 04), so single parameters can differ by a sizable part of lr.
assert (one.final_params - full.final_params).pow(2).mean().sqrt() < cfg(12).lr / 100

# %% [markdown]
# ## 5. Atomic saves, and corruption that is named, never loaded
#
# A save that dies half-way must never be mistaken for a checkpoint. So every rank writes into
# `.step_XXXXXXXX.partial/`, rank 0 writes `metadata.json` **last**, then renames the
# directory to `step_XXXXXXXX/`: a rename is atomic, so a reader sees all of it or nothing.
# After that, files can still be damaged (a full disk, a cleanup script, another run writing
# into the same directory), so the loader checks each file against the sizes and SHA-256 in
# the metadata, loads only with `torch.load(weights_only=True)` (data, never pickled code),
# and compares every piece with the metadata. We break copies of the checkpoint five ways.

# %%
def damaged(name, damage):
    path = WORK / "broken" / name
    shutil.copytree(step6, path)
    damage(path)
    model = GPT(CONFIG, seed=0)
    try:
        load_training_state(path, model, None, "replicated")
    except CheckpointError as err:
        return str(err).replace(str(WORK / "broken") + "/", "")
    raise AssertionError(f"{name}: loaded silently")


def flip_a_bit(p):
    data = bytearray((p / "rank00001.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (p / "rank00001.pt").write_bytes(bytes(data))


def wrong_shape(p):
    meta = json.loads((p / "metadata.json").read_text())
    meta["tensors"]["model.ln_f.weight"]["shape"] = [CONFIG.d_model + 1]
    (p / "metadata.json").write_text(json.dumps(meta))


cases = {
    "killed before the metadata": lambda p: (p / "metadata.json").unlink(),
    "a shard deleted": lambda p: (p / "rank00001.pt").unlink(),
    "a shard truncated": lambda p: (p / "rank00001.pt").write_bytes((p / "rank00001.pt").read_bytes()[:1000]),
    "one flipped bit": flip_a_bit,
    "metadata of another model": wrong_shape,
}
for name, damage in cases.items():
    print(f"{name}:\n    {damaged(name, damage)}")
(WORK / "cut" / ".step_00000009.partial").mkdir()  # what a save killed half-way leaves behind
assert latest_checkpoint(WORK / "cut") == step6
print("newest complete checkpoint despite a .partial directory:", latest_checkpoint(WORK / "cut").name)

# %% [markdown]
# ## 6. Asynchronous checkpointing
#
# A synchronous save stalls training for the whole copy, serialisation and write. Only the
# **copy** must block (the next optimizer step would change the tensors under a writer); the
# write can run in a background thread while training continues (`AsyncCheckpointer`). The
# checkpoint is committed (metadata, rename) at the next save or at the end, so until then the
# previous one is the newest complete checkpoint. The costs: host memory for one more copy of
# the state, and a writer competing with training for CPU and disk bandwidth.
#
# **Predict:** what fraction of the synchronous save does the async save block for?

# %%
def save_times(root, reps=3):
    """Rank code: seconds of a sync save and of an async save's blocking part (medians)."""
    import statistics
    import time

    from course_lib.checkpoint import AsyncCheckpointer, save_training_state
    from course_lib.checkpoint.training import _build

    model = GPT(GPTConfig.tiny(VOCAB, n_layer=4, d_model=128), seed=0)
    opt = _build(model, cfg(1), "zero", 1, None)[0]
    x = torch.randint(0, VOCAB, (2, 64))
    model(x, x)[1].backward()
    opt.step()
    saver, sync, blocked = AsyncCheckpointer(), [], []
    for r in range(reps):
        t0 = time.perf_counter()
        save_training_state(f"{root}/sync{r}", 1, model, opt, "zero")
        sync.append(time.perf_counter() - t0)
        blocked.append(save_training_state(f"{root}/async{r}", 1, model, opt, "zero", saver=saver))
        saver.wait()
    state = sum(p.numel() for p in model.parameters()) * 4 * 3
    return statistics.median(sync), statistics.median(blocked), state


# %% tags=["nbval-ignore-output"]
SYNC_S, ASYNC_S, STATE_BYTES = run_on_ranks(save_times, str(WORK / "timing"), world_size=2, timeout_s=180)[0]
print(f"state {fmt_bytes(STATE_BYTES)} on 2 ranks: sync save {SYNC_S * 1e3:.1f} ms, "
      f"async save blocks {ASYNC_S * 1e3:.1f} ms ({ASYNC_S / SYNC_S:.0%} of sync)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Usually a small fraction (the cell prints this run's; times on a shared machine vary): the
# copy of a few MiB in memory is fast next to serialising, hashing and `fsync`-ing the file.
# On GPUs the copy is device-to-host over PCIe (tens of GB/s), the write goes to a network
# file system (often a few GB/s per node), so the gap is larger still.
# </details>

# %% [markdown]
# ## 7. The same with PyTorch: `torch.distributed.checkpoint` on FSDP2
#
# Production code does not write its own format: PyTorch's **DCP** (`torch.distributed.checkpoint`)
# saves the state dict of an FSDP2 model directly. FSDP2 (`fully_shard`, notebook 08) holds
# every parameter as a **DTensor** sharded along dimension 0: with $N$ ranks, rank $r$ holds rows
# $[r c, (r+1) c)$ with $c = \lceil \text{rows} / N \rceil$ (the last ranks fewer), and AdamW's
# moments are DTensors cut the same way. `get_state_dict(model, optimizer)` returns both;
# `dcp.save` has every rank write its own rows to `__<rank>_0.distcp` while the coordinator
# writes `.metadata`: each tensor's global shape and every chunk's offsets and sizes, the
# course's `metadata.json` by another name. `dcp.load` fills a state dict of *another* layout:
# each rank asks for its own rows and DCP reads the saved chunks that overlap them (section 4's
# intersection). `dcp.async_save` copies the state to host memory, returns a future and writes
# in a background thread (section 6's idea).
#
# We train the course GPT under FSDP2 on **4 ranks** for 2 steps, save it with `dcp.save` and
# with `dcp.async_save`, then load each checkpoint into a fresh FSDP2 model on **2 ranks**
# (initialised from another seed, so nothing can match by accident) and compare every value.
#
# **Predict:** the token embedding is a 97 × 32 matrix (one row per character of the
# vocabulary). Which chunks does the `.metadata` list for it, and which saved files does
# rank 1 of the 2-rank job read?
#
# <details><summary>Answer</summary>
#
# Four chunks, one per saving rank: $c = \lceil 97/4 \rceil = 25$ rows, at row offsets 0, 25,
# 50 and 75, the last one 22 rows (FSDP2 pads the last shard to 25 rows in memory, as ZeRO pads
# its flat buffer, but DCP writes only real rows). On 2 ranks $c = \lceil 97/2 \rceil = 49$:
# rank 1 needs rows [49, 97), so it reads row 49 from `__1_0.distcp` and all of
# `__2_0.distcp` and `__3_0.distcp`, and never opens `__0_0.distcp`.
# </details>

# %%
from course_lib.checkpoint.dcp import dcp_chunks, fsdp2_dcp_load, fsdp2_dcp_save

DCP_DIR, DCP_ASYNC_DIR = WORK / "dcp", WORK / "dcp_async"
# check_collectives=False: the pool's per-collective check (one extra gather each) is left off for the
# many small collectives of FSDP2 and DCP's planner; this section checks its result by the values
saved = run_on_ranks(fsdp2_dcp_save, CONFIG, cfg(2), str(DCP_DIR), str(DCP_ASYNC_DIR), world_size=4,
                     timeout_s=180, check_collectives=False)
SAVED_VALUES = saved[0]["values"]  # the full state, gathered on rank 0 before the save
print(sorted(p.name for p in DCP_DIR.iterdir()))
print(f"model.tok_emb.weight: global shape {list(SAVED_VALUES['model.tok_emb.weight'].shape)}")
for file, offsets, lengths in dcp_chunks(DCP_DIR, "model.tok_emb.weight"):
    print(f"    {file}  offsets {offsets}  lengths {lengths}")
chunks = dcp_chunks(DCP_DIR, "model.tok_emb.weight")
assert [(o[0], n[0]) for _, o, n in chunks] == [(0, 25), (25, 25), (50, 25), (75, 22)]
# rank 1 of 2 holds rows [49, 97): the chunks that overlap it (section 4's rule) are the files it reads
assert [f for f, o, n in chunks if o[0] < 97 and o[0] + n[0] > 49] == ["__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
step_chunks = dcp_chunks(DCP_DIR, "optim.state.tok_emb.weight.step")  # a plain tensor on every rank
print(f"optim.state.tok_emb.weight.step, held whole by all 4 ranks: {len(step_chunks)} chunk, written by one rank")
assert len(step_chunks) == 1

loaded = run_on_ranks(fsdp2_dcp_load, CONFIG, cfg(2), [str(DCP_DIR), str(DCP_ASYNC_DIR)], world_size=2,
                      timeout_s=180, check_collectives=False)[0]
tensors = [k for k, v in SAVED_VALUES.items() if isinstance(v, torch.Tensor)]
for name, values in zip(("dcp.save", "dcp.async_save"), loaded):
    same_keys = values.keys() == SAVED_VALUES.keys()
    equal = same_keys and all(torch.equal(values[k], v) if k in tensors else values[k] == v
                              for k, v in SAVED_VALUES.items())
    print(f"{name:>14}, saved on 4 ranks, loaded on 2: {len(tensors)} tensors "
          f"({sum(k.startswith('model.') for k in tensors)} of the model, {sum(k.startswith('optim.') for k in tensors)} "
          f"of the optimizer) and every setting, all equal bit for bit: {equal}")
    assert equal

# %% tags=["nbval-ignore-output"]
t = saved[0]
print(f"dcp.save blocked {t['save_s'] * 1e3:.1f} ms; dcp.async_save returned after {t['async_blocked_s'] * 1e3:.1f} ms "
      f"and its write ended {t['async_total_s'] * 1e3:.1f} ms after the call")
assert all(v >= 0 for k, v in t.items() if k != "values")

# %% [markdown]
# Loading bit for bit at another world size is the property section 4 asked of the course's
# own format, and DCP's `.metadata` describes the same thing as `metadata.json`: global shapes
# and boxes (here each box is a band of whole rows, because FSDP2 cuts dimension 0). On one
# CPU the asynchronous save may return no sooner than the blocking one, because staging still
# copies every tensor and the background write competes for the same cores; on GPUs the
# copy to host is a fraction of the write, which is what the async save hides. What DCP adds in
# production: parallel writers per rank, storage back-ends other than a file system, and a
# planner that deduplicates replicated tensors (Adam's step counter is written once, not four
# times).

# %% [markdown]
# ## 8. Elastic recovery under torchrun: kill a rank, restart, resume
#
# `course_lib.demos.elastic` is the same loop as a `torchrun` program. We start 2 ranks that
# save every 3 steps; rank 1 kills itself with `SIGKILL` at the start of step 8, like a GPU
# falling off the bus. `torchrun --max-restarts 1` notices the dead worker, stops the other
# one (stuck in a collective with a dead peer) and starts the whole group again; the new group
# loads the newest **complete** checkpoint (step 6), recomputes step 7 and carries on.
# `--check` then trains the same 12 steps without interruption and compares the losses.
#
# **Predict:** which steps run twice, and does the final loss curve differ?

# %% tags=["nbval-ignore-output"]
ELASTIC = WORK / "elastic"
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
       "--max-restarts", "1", "-m", "course_lib.demos.elastic", "--steps", "12", "--checkpoint-every", "3",
       "--checkpoint-dir", str(ELASTIC), "--kill-rank", "1", "--kill-at-step", "8", "--check"]
proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # gloo CPU ranks, as every cell
keep = ("attempt", "killed", "resumed", "check:")
print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(keep) or "killed" in line))
assert proc.returncode == 0, proc.stderr[-2000:]

# %%
events = read_events(ELASTIC)
print([(e["event"], e["step"]) for e in events if e["event"] != "step"])
by_attempt, attempt = [[], []], 0
for e in events:
    if e["event"] == "resume":
        attempt = 1
    if e["event"] == "step":
        by_attempt[attempt].append((e["step"], e["loss"]))
print("steps of the first attempt: ", [s for s, _ in by_attempt[0]])
print("steps after the restart:    ", [s for s, _ in by_attempt[1]])
demo_args = elastic_demo.parse_args(["--steps", "12", "--checkpoint-every", "3", "--checkpoint-dir", "unused"])
clean = run_on_ranks(train_with_checkpoints, *elastic_demo.configs(demo_args), str(WORK / "clean"), 0, "zero",
                     world_size=2, timeout_s=180)[0].train_losses  # the demo's model and data, no failure
resumed = dict(by_attempt[0]) | dict(by_attempt[1])
assert [resumed[s] for s in range(1, 13)] == clean
print("losses with the failure == losses without it, bit for bit:", [resumed[s] for s in range(1, 13)] == clean)

fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(range(1, 13), clean, "k-", lw=4, alpha=0.25, label="uninterrupted")
for i, pts in enumerate(by_attempt):
    ax.plot(*zip(*pts), "o--" if i == 0 else "s-", ms=4, label=f"attempt {i}")
ax.axvline(8, color="red", lw=0.8, ls=":", label="rank 1 killed")
ax.set_xlabel("step")
ax.set_ylabel("loss (mean over ranks)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# <details><summary>Answer</summary>
#
# Step 7 runs twice (once before the kill, once after the restart from step 6): that is the
# lost work, half a checkpoint interval on average. The curve is identical, bit for bit: the
# restarted group restored parameters, Adam's state, the data generator and every rank's RNG.
# The same demo resumes at a different world size too: run it again with another
# `--nproc-per-node` and a larger `--steps` on the same directory (section 4's resharding).
# </details>
#
# **What torchrun does and does not do.** `torchrun` restarts *every* worker when one fails,
# and the job pays a rendezvous, process start-up, the checkpoint load and the recomputed
# steps. Fault-tolerant training in the style of **torchft** (PyTorch, 2025) keeps the
# healthy data-parallel replica groups running: a failed group drops out of the gradient
# all-reduce (the others continue with a smaller global batch), and when it comes back it
# copies the current weights and optimizer state **from a live peer** instead of from disk,
# after a quorum agrees on the new membership. Checkpoints remain the safety net for failures
# that take out more than one replica of the same shard.

# %% [markdown]
# ## 9. How often to checkpoint: Young/Daly
#
# Checkpointing every $\tau$ seconds with a save that stalls training for $\delta$ seconds
# wastes $\delta/\tau$ of the time on saving, and a failure (rate $1/M$) loses on average
# $\tau/2$ of work. The waste $\frac{\delta}{\tau} + \frac{\tau}{2M}$ is smallest at
#
# $$\tau^* = \sqrt{2\,\delta\,M}, \qquad \text{waste}(\tau^*) = \sqrt{2\delta/M}$$
#
# (Young 1974; Daly 2006 adds the restart time and higher-order terms, which matter when
# $\delta$ is not small next to $M$). In the widget, pick the number of GPUs and the save
# stall; below it, the same formula with the save times measured in section 6. The job MTBF is
# the Llama 3 per-GPU MTBF of section 1 divided by the number of GPUs, computed once here and
# used by every cell of this section: unexpected failures only (Dubey et al. 2024: 419 of the
# 466 interruptions in 54 days on 16,384 GPUs), so about 3.1 h at 16,384 GPUs rather than the
# 2.8 h of all 466 (a planned stop can be preceded by a save, so it loses no work).

# %%
M_JOB_H = job_mtbf_hours(per_gpu_h, LLAMA3_GPUS)  # = 54 days x 24 h / 419 unexpected interruptions
M_JOB_S = M_JOB_H * 3600
print(f"job MTBF at {LLAMA3_GPUS:,} GPUs: {LLAMA3_DAYS} d x 24 h / {LLAMA3_UNEXPECTED} = {M_JOB_H:.2f} h "
      f"= {M_JOB_S:,.0f} s (all {LLAMA3_INTERRUPTIONS} interruptions: {llama3_job_mtbf_hours():.2f} h)")
# the same quotient two ways, equal up to float64 rounding (~1e-15 relative)
assert abs(M_JOB_H - llama3_job_mtbf_hours(unexpected_only=True)) < 1e-9

# %% tags=["nbval-ignore-output"]
from course_lib.widgets import show_interactive

show_interactive(lambda: viz.interval_view(30.0, 16384), lambda: viz.interval_widget(30.0, 16384))

# %% [markdown]
# **Predict:** take the save times measured in section 6, for a few MiB of state. What interval
# would they call for at 16,384 GPUs, and how much of the run would be wasted?

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(6.5, 3.4))
counts = viz.GPU_COUNTS
for label, delta in (("sync save, measured here", SYNC_S), ("async save, measured here", ASYNC_S),
                     ("30 s stall", 30.0), ("5 min stall", 300.0)):
    mtbfs = [job_mtbf_hours(per_gpu_h, n) * 3600 for n in counts]
    ax.loglog(counts, [young_daly_interval(delta, m) / 60 for m in mtbfs], "o-", ms=3,
              label=f"{label}: δ = {delta:.3g} s")
ax.set_xlabel("GPUs in the job")
ax.set_ylabel("best interval τ* (minutes)")
ax.legend(fontsize=8)
plt.show()
for label, delta in (("sync", SYNC_S), ("async", ASYNC_S)):
    tau = young_daly_interval(delta, M_JOB_S)
    waste = wasted_fraction(tau, delta, M_JOB_S)
    print(f"{label:>5}: delta = {delta * 1e3:.1f} ms -> tau* = {tau:.0f} s at 16,384 GPUs, waste {waste:.2%}")
    assert abs(waste - (2 * delta / M_JOB_S) ** 0.5) < 1e-12  # at tau* the waste is sqrt(2 delta / M) (float64 rounding)
tau_1s = young_daly_interval(1.0, M_JOB_S)  # the reference point the answer below quotes
print(f"for scale, a 1 s save: tau* = {tau_1s:.0f} s, waste {wasted_fraction(tau_1s, 1.0, M_JOB_S):.2%}; this run's sync "
      f"save is {'faster' if SYNC_S < 1 else 'slower'} than that, so its interval is "
      f"{'shorter' if SYNC_S < 1 else 'longer'} and its waste {'smaller' if SYNC_S < 1 else 'larger'}")
assert round(tau_1s) == 149 and round(100 * wasted_fraction(tau_1s, 1.0, M_JOB_S), 1) == 1.3

# %% [markdown]
# <details><summary>Answer</summary>
#
# Both grow as $\sqrt{\delta}$: $\tau^* = \sqrt{2\delta M}$ and, at $\tau^*$, a waste of
# $\sqrt{2\delta/M}$. With $M$ ≈ 3.09 h = 11,135 s, a 1 s save calls for a checkpoint every
# 149 s (about 2.5 minutes) and wastes 1.3%; the cell prints where this run's measured saves
# fall beside that. Either way the numbers are small only because this state is a few MiB. The
# state of a 405B model with
# Adam is about 14 bytes per parameter (bf16 weights, fp32 master weights, two fp32 moments),
# ~5.2 TiB: at 100 GB/s of aggregate write bandwidth a synchronous save stalls for about a
# minute, which is where the 30 s and 5 min curves live.
# </details>

# %%
for delta in (30.0, 300.0):  # the same M as every cell of this section (M_JOB_S, above)
    tau = young_daly_interval(delta, M_JOB_S)
    print(f"delta = {delta:>5.0f} s, M = {M_JOB_H:.2f} h: tau* = {tau / 60:5.1f} min, "
          f"waste {100 * wasted_fraction(tau, delta, M_JOB_S):.1f}%")
assert young_daly_interval(30.0, M_JOB_S) < young_daly_interval(300.0, M_JOB_S)

# %% [markdown]
# A 10× faster save shortens the best interval by $\sqrt{10}$ and the waste by $\sqrt{10}$:
# that is why production systems save asynchronously, shard the write over every rank, and
# keep a recent copy in the memory of other hosts.
#
# ## What to remember
#
# * At 16,384 GPUs a failure every few hours is normal; plan for it with $\tau^* = \sqrt{2\delta M}$.
# * A checkpoint is the *whole* state: parameters, optimizer, step, data position, every
#   rank's RNG. Check a resumption bit for bit against an uninterrupted run.
# * Describe shards by global shapes and boxes; resharding is box intersection, for any layout.
# * Write to a temporary directory, metadata last, rename; check sizes and hashes on load;
#   `weights_only=True`.
# * Async saves block only for the copy to host memory; the checkpoint completes later.
#
# ## Self-check
#
# 1. Your 4,096-GPU job has a per-GPU MTBF of 5 years and a 60 s synchronous save. What
#    interval do you choose, and how much of the run do you lose?
# 2. A resume matches the uninterrupted run for 20 steps and then slowly drifts apart. Which
#    part of the state is the most likely to be missing, if the model has dropout?
# 3. ZeRO at 8 ranks saved a flat unit of 1,000 elements. Which old shards does new rank 3
#    of 5 read?
# 4. Why is the metadata file written last, and why is a rename better than writing the final
#    directory directly?
# 5. An async save is "one behind". When exactly does the newest checkpoint become loadable?
#
# <details><summary>Answers</summary>
#
# 1. $M$ = 5 × 8760 / 4096 ≈ 10.7 h; $\tau^* = \sqrt{2 · 60 · 38{,}500}$ s ≈ 36 min; waste
#    $\sqrt{2 · 60 / 38{,}500}$ ≈ 5.6%.
# 2. An RNG state (dropout masks of some rank): the loss is still close, the path differs.
#    The data position or optimizer state would show at the first step.
# 3. Old shards are 125 wide, new ones 200: new rank 3 owns [600, 800), i.e. old ranks 4
#    ([500, 625)), 5 ([625, 750)) and 6 ([750, 875)).
# 4. Its presence marks the save complete; without a rename a crash mid-save leaves a
#    directory under the final name that looks like a checkpoint.
# 5. At the next `wait()` (the next save or the end of training), after every rank's file is
#    written and rank 0 renamed the directory.
# </details>
#
# ## References
#
# * Dubey et al. (Llama Team, Meta), "The Llama 3 Herd of Models", 2024, section 3.3.4: the
#   466 interruptions (47 planned, 419 unexpected) in a 54-day snapshot of pre-training on up
#   to 16,384 H100s, and what caused them (arXiv:2407.21783).
# * Young, "A first order approximation to the optimum checkpoint interval", Communications of
#   the ACM, 1974; Daly, "A higher order estimate of the optimum checkpoint interval for restart
#   dumps", Future Generation Computer Systems, 2006: $\tau^* = \sqrt{2\delta M}$ and its corrections.
# * Mohan, Phanishayee and Chidambaram, "CheckFreq: Frequent, Fine-Grained DNN Checkpointing",
#   USENIX FAST 2021: a two-phase save (snapshot in memory, then persist) pipelined with
#   training, the data loader's position in the state, and a frequency tuned from profiling.
# * Eisenman et al., "Check-N-Run: a Checkpointing System for Training Deep Learning
#   Recommendation Models", USENIX NSDI 2022: saving only what changed (differential
#   checkpoints) and quantizing it, for models of terabytes.
# * Wang et al., "GEMINI: Fast Failure Recovery in Distributed Training with In-Memory
#   Checkpoints", SOSP 2023: checkpoints kept in the CPU memory of other hosts, with remote
#   storage as the last resort.
# * PyTorch documentation, "Distributed Checkpoint - torch.distributed.checkpoint"
#   (https://docs.pytorch.org/docs/stable/distributed.checkpoint.html): `save`, `load`,
#   `async_save` and `get_state_dict`/`set_state_dict`, as run in section 7.
#
# Further reading:
#
# * the PyTorch tutorials "Getting Started with Distributed Checkpoint (DCP)" and
#   "Asynchronous Saving with Distributed Checkpoint (DCP)", which take section 7 to GPUs;
# * Jiang et al., "MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs",
#   USENIX NSDI 2024, on detecting faults and restarting quickly in production;
# * torchft (https://github.com/pytorch/torchft), the per-replica fault tolerance of section 8.
#
# Next: reshard ZeRO shards yourself in `exercises/ex12_reshard.ipynb`.

# %%
shutil.rmtree(WORK, ignore_errors=True)
