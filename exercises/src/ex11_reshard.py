# %% [markdown]
# # Exercise 11: reshard ZeRO shards from N ranks to M ranks
#
# **Goal.** A ZeRO-3 run saved its flat shards on 4 ranks; the job must continue on 2. In
# `exercises/ex11_reshard/student.py`, write the resharding by global offsets:
#
# 1. `shard_range(numel, world_size, rank)`: the global range a rank owns in a padded flat unit.
# 2. `read_plan(numel, old_world, new_world, new_rank)`: which slice of which old shard lands
#    where in a new rank's shard. Only the overlapping old shards; never the padding.
# 3. `reshard_flat(old_shards, numel, new_world)`: all new shards, built from the plan.
#
# Draw it first: a unit of 10 elements on 4 ranks, then on 3; mark each rank's range and the
# padding; for each new rank, list the overlaps. **Re-read in notebook 11:** section 3 (what a
# sharded checkpoint holds), section 4 (resharding by global offsets, and its picture);
# in notebook 08, the flat padded buffer of ZeRO.
#
# **How grading works.** Checks 1-3 compare your functions with the rule on many sizes
# (including units smaller than the number of ranks, where whole shards are padding). Check 4
# uses real shards: a ZeRO-3 run on 4 ranks trains 3 steps and saves its flat shards
# (parameters and Adam's two moments); your `reshard_flat` turns them into 2 ranks' shards; a
# ZeRO-3 run on 2 ranks loads them and trains 3 more steps, and its losses and parameters must
# match a run that trained all 6 steps on 4 ranks without stopping (to float rounding: the
# gradient average is summed in another order on 2 ranks). A check prints `PASS  ...` or raises
# `CheckFailed`. Edit `student.py`, then *Kernel → Restart and run all*.

# %%
import tempfile

import torch

from course_lib import run_on_ranks
from course_lib.checkpoint.flat import STATE, read_flat_shards, train_zero3_flat
from course_lib.checkpoint.reshard import Box
from course_lib.data import CharDataset
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPTConfig
from course_lib.parallel.zero.flat import shard_bounds
from course_lib.train import TrainConfig

student = load_student("ex11_reshard")
CASES = [(10, 4, 3), (10, 3, 4), (7, 2, 5), (3, 4, 2), (1, 3, 2), (100, 8, 3), (101, 5, 7), (64, 4, 2), (9, 1, 4)]

# %% [markdown]
# ## Check 1: `shard_range`

# %%
got = [student.shard_range(numel, n, r) for numel, n, _ in CASES for r in range(n)]
expected = [shard_bounds(numel, n, r) for numel, n, _ in CASES for r in range(n)]
check_equal("shard_range on every rank of 9 layouts", [tuple(map(int, g)) for g in got], expected)
try:
    student.shard_range(10, 4, 4)
    raised = False
except ValueError:
    raised = True
check_equal("shard_range(10, 4, rank=4) raises ValueError", raised, True)

# %% [markdown]
# ## Check 2: `read_plan`
# The expected plan intersects the new rank's range (cut at numel) with every old range.

# %%
def expected_plan(numel, old_world, new_world, new_rank):
    a, b = shard_bounds(numel, new_world, new_rank)
    want = Box((a,), (max(0, min(b, numel) - a),))
    plan = []
    for old in range(old_world):
        oa, ob = shard_bounds(numel, old_world, old)
        common = want.intersect(Box((oa,), (ob - oa,)))
        if common is not None:
            lo, n = common.offsets[0], common.lengths[0]
            plan.append((old, lo - oa, lo - oa + n, lo - a))
    return plan


check_equal("read_plan(10, 4, 3, new_rank=1), the docstring's example",
            [tuple(map(int, p)) for p in student.read_plan(10, 4, 3, 1)], [(1, 1, 3, 0), (2, 0, 2, 2)])
got = [[tuple(map(int, p)) for p in student.read_plan(numel, n, m, r)] for numel, n, m in CASES for r in range(m)]
expected = [expected_plan(numel, n, m, r) for numel, n, m in CASES for r in range(m)]
check_equal("read_plan for every new rank of 9 layouts (no padding, only overlapping shards)", got, expected)

# %% [markdown]
# ## Check 3: `reshard_flat` on made-up shards

# %%
torch.manual_seed(0)
for numel, n, m in CASES:
    full = torch.randn(numel, dtype=torch.float64)
    old_size, new_size = -(-numel // n), -(-numel // m)
    padded_old = torch.cat([full, full.new_zeros(n * old_size - numel)])
    old = [padded_old[r * old_size:(r + 1) * old_size].clone() for r in range(n)]
    before = [t.clone() for t in old]
    new = student.reshard_flat(old, numel, m)
    padded_new = torch.cat([full, full.new_zeros(m * new_size - numel)])
    check_equal(f"P={numel}, {n} -> {m} ranks: {m} shards of {new_size}", [tuple(t.shape) for t in new], [(new_size,)] * m)
    check_close(f"P={numel}, {n} -> {m} ranks: values by global offset, zero padding",
                torch.cat(new), padded_new, rtol=0, atol=0)
    check_equal(f"P={numel}, {n} -> {m} ranks: old shards untouched", all(torch.equal(a, b) for a, b in zip(old, before)), True)

# %% [markdown]
# ## Check 4: real ZeRO-3 shards, 4 ranks -> 2 ranks, training continues
# Three runs of the same model and data: 6 steps on 4 ranks without stopping; 3 steps on 4
# ranks that save their flat shards; then your resharding and 3 more steps on 2 ranks.

# %%
CONFIG = GPTConfig.tiny(CharDataset("train", 16).vocab_size, block_size=16, n_layer=1, n_head=2, d_model=32)
SAVED = tempfile.mkdtemp(prefix="ex11_")
full = run_on_ranks(train_zero3_flat, CONFIG, TrainConfig(steps=6, batch_size=8, progress=False),
                    world_size=4, timeout_s=120)[0]
run_on_ranks(train_zero3_flat, CONFIG, TrainConfig(steps=3, batch_size=8, progress=False), SAVED,
             world_size=4, timeout_s=120)
old = read_flat_shards(SAVED)  # one dict per old rank: {"units": [...], "step", "generator", "losses"}
print(f"{len(old)} rank files; units of {[u['numel'] for u in old[0]['units']]} elements, "
      f"shards of {[u['param'].numel() for u in old[0]['units']]}")

new = [{**old[0], "units": []} for _ in range(2)]  # step, data position and loss history are replicated
for u, unit in enumerate(old[0]["units"]):
    pieces = {k: student.reshard_flat([o["units"][u][k] for o in old], unit["numel"], 2) for k in ("param",) + STATE}
    for r in range(2):
        new[r]["units"].append({"numel": unit["numel"], "step": unit["step"], **{k: v[r] for k, v in pieces.items()}})
resumed = run_on_ranks(train_zero3_flat, CONFIG, TrainConfig(steps=6, batch_size=8, progress=False),
                       resume=new, world_size=2, timeout_s=120)[0]
check_equal("steps 1-3 restored from the shards", resumed.train_losses[:3], full.train_losses[:3])
# 2 ranks add the gradient in another order than 4: losses ~1e-7 apart; the parameters in RMS, against a
# hundredth of one AdamW step, since AdamW magnifies the rounding of gradients near zero (notebook 04)
check_close("steps 4-6 on 2 ranks equal the uninterrupted 4-rank run", resumed.train_losses[3:],
            full.train_losses[3:], rtol=0, atol=1e-5)
check_close("final parameters equal the uninterrupted run (RMS of the difference)",
            (resumed.final_params - full.final_params).pow(2).mean().sqrt().item(), 0.0,
            rtol=0, atol=TrainConfig().lr / 100)
