# %% [markdown]
# # Exercise 08: a ZeRO-2 step with AdamW
#
# **Goal.** Write, in `exercises/ex08_zero2_step/student.py`, the optimizer of ZeRO stage 2
# for a plain model whose parameters are the same on every rank:
#
# 1. `shard_bounds(numel, world_size, rank)`: rank r's slice of a flat vector padded to a
#    multiple of N;
# 2. `Zero2AdamW(params, lr, betas, weight_decay, eps, group)`: keeps the fp32 master weights
#    and AdamW's state of its own shard only;
# 3. `Zero2AdamW.step()`: reduce-scatter the gradients into shards (each rank gets the mean
#    gradient of its shard), drop the full gradients, update the shard with AdamW, all-gather
#    the updated shards into the parameters. It returns the gradient shard.
#
# Re-read notebook 08 before you start: §2 (the flat buffer and its padding), §3 (one step of
# stage 1, which is the same step), §4 (what each rank should hold) and §7 (why a
# reduce-scatter and an all-gather cost what DDP's all-reduce costs). Gradients are produced
# by an ordinary `loss.backward()`; here the reduce-scatter runs after backward rather than
# from hooks during it (notebook 08 §5 shows the bucketed version).
#
# **Think first.** The model below has 108,413 parameters. On 4 ranks, how many elements does
# each rank's shard hold, and how many of rank 3's are padding? What value must the padding
# have so that AdamW never moves it?
#
# <details><summary>Answer</summary>
#
# $S = \lceil 108413/4 \rceil = 27{,}104$; the padded vector has $4S = 108{,}416$ elements, so
# the last 3 elements of rank 3's shard are padding. Zero value and zero gradient: AdamW's m
# and v stay 0, the update $m/(\sqrt v + \epsilon)$ is 0 and weight decay scales 0 to 0.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your optimizer is run on 2 and 4 real ranks
# and compared with `torch.optim.AdamW` in one process on the whole batch. Edit `student.py`,
# then *Kernel → Restart and run all*.

# %%
import torch
import torch.distributed as dist

from course_lib import CommTracer, run_on_ranks
from course_lib.data import CharDataset, collate, sample_indices
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.zero import train_single
from course_lib.train import TrainConfig, flat_grads, train_step

student = load_student("ex08_zero2_step")
DATA = CharDataset("train", block_size=32)
CONFIG = GPTConfig.tiny(DATA.vocab_size, n_layer=3, d_ff=127, block_size=32)  # an odd parameter count
N_PARAMS = GPT(CONFIG).num_params()
TRAIN = TrainConfig(steps=3, batch_size=12, lr=3e-3, grad_clip=0.0, progress=False)
ADAMW = dict(lr=TRAIN.lr, betas=TRAIN.betas, weight_decay=TRAIN.weight_decay)
RANKS = dict(backend="gloo", timeout_s=120)

# %% [markdown]
# ## Check 1: `shard_bounds`

# %%
check_equal("10 elements on 4 ranks", [student.shard_bounds(10, 4, r) for r in range(4)],
            [(0, 3), (3, 6), (6, 9), (9, 12)])
check_equal("12 elements on 4 ranks (no padding)", [student.shard_bounds(12, 4, r) for r in range(4)],
            [(0, 3), (3, 6), (6, 9), (9, 12)])
check_equal("1 element on 2 ranks", [student.shard_bounds(1, 2, r) for r in range(2)], [(0, 1), (1, 2)])
check_equal(f"{N_PARAMS:,} parameters on 4 ranks, rank 3", student.shard_bounds(N_PARAMS, 4, 3),
            (3 * 27104, 4 * 27104))

# %% [markdown]
# ## Check 2: the gradient shards are the mean gradient
# One step on a fixed batch: every rank back-propagates its quarter (or half), calls `step()`,
# and the shards the ranks return, laid end to end, must be the gradient of the whole batch
# computed in one process (and zero in the padding). A step that forgets to divide by N, or
# hands a rank another rank's shard, fails here.

# %%
def batch(steps):
    gen = torch.Generator().manual_seed(TRAIN.seed)
    return [collate(DATA, sample_indices(len(DATA), TRAIN.batch_size, gen)) for _ in range(steps)]


def one_step(config):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = GPT(config, seed=TRAIN.seed)
    opt = student.Zero2AdamW(model.parameters(), **ADAMW)
    x, y = batch(1)[0]
    share = TRAIN.batch_size // n
    model(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])[1].backward()
    return opt.step()


whole = GPT(CONFIG, seed=TRAIN.seed)
x, y = batch(1)[0]
whole(x, y)[1].backward()
mean_grad = flat_grads(whole)
for n in (2, 4):
    shards = torch.cat(run_on_ranks(one_step, CONFIG, world_size=n, **RANKS))
    pad = -(-N_PARAMS // n) * n - N_PARAMS
    check_equal(f"{n} ranks: the shards cover the padded vector", shards.numel(), N_PARAMS + pad)
    # one backward: fp32 sums over the batch in another order (per rank, then the reduce-scatter), ~1e-7
    check_close(f"{n} ranks: gradient shards = the whole batch's gradient", shards[:N_PARAMS], mean_grad,
                rtol=1e-4, atol=1e-6)
    check_equal(f"{n} ranks: zero gradient in the padding", bool((shards[N_PARAMS:] == 0).all()), True)

# %% [markdown]
# ## Check 3: three AdamW steps equal one process, and each rank holds 1/N of the state
# The model trains with `course_lib.train.train_step` (zero_grad, forward, backward, `step()`)
# for 3 steps; every rank must end with the single process's parameters, hold AdamW state for
# its shard only (two fp32 moments: 8 bytes per shard element) and no full gradient.

# %%
def train(config):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = GPT(config, seed=TRAIN.seed)
    opt = student.Zero2AdamW(model.parameters(), **ADAMW)
    share = TRAIN.batch_size // n
    for x, y in batch(TRAIN.steps):
        train_step(model, opt, x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, opt.state_bytes(), sum(p.grad is not None for p in model.parameters())


reference = train_single(CONFIG, TRAIN, torch.optim.AdamW, dict(ADAMW, foreach=False)).final_params
for n in (2, 4):
    out = run_on_ranks(train, CONFIG, world_size=n, **RANKS)
    for rank, (params, state, grads_left) in enumerate(out):
        # In RMS, against a hundredth of one AdamW step: AdamW magnifies the rounding of a gradient near zero
        # (notebook 04) and can move that one parameter by up to ~lr; a wrong step moves most of them by ~lr.
        check_close(f"{n} ranks, rank {rank}: parameters after {TRAIN.steps} steps (RMS of the difference)",
                    (params - reference).pow(2).mean().sqrt().item(), 0.0, rtol=0, atol=TRAIN.lr / 100)
    check_equal(f"{n} ranks: AdamW state bytes per rank = 8 x ceil(P / N)", [o[1] for o in out],
                [8 * -(-N_PARAMS // n)] * n)
    check_equal(f"{n} ranks: no full gradient left after step()", [o[2] for o in out], [0] * n)

# %% [markdown]
# ## Check 4: one reduce-scatter and one all-gather per step, DDP's bytes
# The tracer records one step. Stage 2 needs exactly one reduce-scatter of the padded gradient
# (N·S fp32 elements in, S out) and one all-gather of the shard (S in, N·S out): on a ring,
# $2\frac{N-1}{N}\cdot 4 N S$ bytes, what DDP's all-reduce sends.

# %%
def traced_step(config):
    model = GPT(config, seed=TRAIN.seed)
    opt = student.Zero2AdamW(model.parameters(), **ADAMW)
    x, y = batch(1)[0]
    model(x, y)[1].backward()
    with CommTracer() as tracer:
        opt.step()
    return tracer.summary()


summary = run_on_ranks(traced_step, CONFIG, world_size=4, **RANKS)[0]
padded_bytes = 4 * 4 * -(-N_PARAMS // 4)
check_equal("collectives of one step", sorted(summary), ["all_gather_single", "reduce_scatter_single"])
check_equal("reduce-scatter: one call, the padded gradient in",
            (summary["reduce_scatter_single"]["calls"], summary["reduce_scatter_single"]["bytes_sent"]),
            (1, padded_bytes))
check_equal("all-gather: one call, every shard out",
            (summary["all_gather_single"]["calls"], summary["all_gather_single"]["bytes_recv"]), (1, padded_bytes))

# %% [markdown]
# All checks passed? Then you have written ZeRO's core. Two questions to take back to
# notebook 08: what would you change so that the reduce-scatter starts *during* backward, and
# never holds the whole gradient (§5)? And what does stage 3 add to this step (§6)?
