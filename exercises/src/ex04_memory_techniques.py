# %% [markdown]
# # Exercise 04: a mixed-precision step with fp32 master weights
#
# **Goal.** Write `master_weights_step(params, masters, optimizer, loss_scale)` in
# `exercises/ex04_memory_techniques/student.py`: the optimizer step of mixed-precision
# training. The model computes in fp16 or bf16; the optimizer updates an fp32 copy of the
# weights; the loss was multiplied by a loss scale before backward. Your step must
#
# 1. give every master weight an fp32 gradient: the 16-bit gradient in fp32, **unscaled**
#    (divided by `loss_scale`);
# 2. **skip** the step when any gradient holds an inf or a nan (the scale was too large: these
#    gradients are garbage), leaving weights and optimizer state untouched;
# 3. otherwise step the optimizer on the **fp32 masters** and copy them, rounded, into the
#    16-bit parameters;
# 4. clear all gradients, and return whether the step was taken.
#
# Re-read notebook 04 first: §1.1 (the number formats and bf16's 8 significant bits), §1.3
# (why gradients are scaled), §1.4 (the dynamic loss scale: who decides to skip) and §1.5
# (master weights). The student file's docstring states the contract exactly.
#
# **Think first.** Why not keep only the 16-bit weights and an fp32 *gradient*, and apply
# `w16 += (lr * g).to(w16.dtype)`? What exactly is lost, and how does an fp32 master copy
# avoid it?
#
# <details><summary>Answer</summary>
#
# The update is rounded twice: into 16 bits, and then `w16 + update` is rounded to the
# weight's 16 bits. In bf16 (8 significant bits) any update below 2^-8 of the weight rounds
# away, every step, so small but consistent updates never accumulate. The fp32 master adds
# them at full precision; only the copy used for forward and backward is rounded.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your step is run on the course GPT next to
# the course's reference implementation of the same recipe (and, for the skip rule, next to
# `torch.amp.GradScaler`), on the same data. Edit `student.py`, then *Kernel → Restart and
# run all*.

# %%
import copy
import math

import torch
import torch.nn.functional as F

from course_lib.data import CharDataset, get_batch
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPT, GPTConfig
from course_lib.techniques.amp import DynamicLossScaler, MixedPrecisionOptimizer, update_scale
from course_lib.train import TrainConfig, make_optimizer

torch.set_num_threads(1)
student = load_student("ex04_memory_techniques")
DATA = CharDataset("train")
CFG = GPTConfig.tiny(DATA.vocab_size)
ADAMW = lambda model: make_optimizer(model, TrainConfig(lr=3e-3))  # noqa: E731


def loss_fp32(model, x, y):
    """Cross-entropy in fp32 from the model's (16-bit) logits."""
    logits, _ = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def yours(dtype, make_optimizer=ADAMW):
    """The course GPT in `dtype`, its fp32 master weights and an optimizer over the masters."""
    model = GPT(CFG)
    master_model = copy.deepcopy(model)  # fp32: the master weights
    optimizer = make_optimizer(master_model)
    model.to(dtype)
    return model, list(model.parameters()), list(master_model.parameters()), optimizer


def reference(dtype, scale=None, make_optimizer=ADAMW, growth_interval=2000):
    """The same model with the course's MixedPrecisionOptimizer (and loss scaler)."""
    model = GPT(CFG)
    scaler = None if scale is None else DynamicLossScaler(init_scale=scale, growth_interval=growth_interval)
    return model, MixedPrecisionOptimizer(model, make_optimizer, dtype, loss_scaler=scaler)


def flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


x, y = get_batch(DATA, 8, torch.Generator().manual_seed(0))

# %% [markdown]
# ## Check 1: one fp16 step with a loss scale of 2^12

# %%
S = 2.0**12
model, params, masters, optimizer = yours(torch.float16)
(loss_fp32(model, x, y) * S).backward()
took = student.master_weights_step(params, masters, optimizer, S)
ref_model, mp = reference(torch.float16, scale=S)
mp.backward(loss_fp32(ref_model, x, y))
ref_took = mp.step()

check_equal("the step was taken", took, ref_took)
# exact: the same fp16 backward, unscaled by a power of two (no rounding) and the same AdamW step as the reference
check_close("fp32 master weights after the step", flat(masters), flat(mp.masters), rtol=0, atol=0)
check_close("fp16 parameters = the masters, rounded", flat(params), flat(ref_model.parameters()), rtol=0, atol=0)
check_equal("dtypes kept (fp16 parameters, fp32 masters)",
            ({p.dtype for p in params}, {m.dtype for m in masters}), ({torch.float16}, {torch.float32}))
check_equal("gradients cleared", all(t.grad is None for t in params + masters), True)

# %% [markdown]
# ## Check 2: inf or nan in a gradient skips the step
#
# A gradient entry is overwritten with inf (then nan) after backward, as an overflow of the
# scaled loss would leave it. Nothing may change: not the weights, not the optimizer's state.

# %%
for bad in (math.inf, math.nan):
    model, params, masters, optimizer = yours(torch.float16)
    before = flat(masters), flat(params)
    (loss_fp32(model, x, y) * S).backward()
    params[5].grad.view(-1)[7] = bad
    took = student.master_weights_step(params, masters, optimizer, S)
    check_equal(f"{bad} in a gradient: step skipped (returns False)", took, False)
    check_equal(f"{bad}: masters and parameters unchanged",
                torch.equal(before[0], flat(masters)) and torch.equal(before[1], flat(params)), True)
    check_equal(f"{bad}: the optimizer took no step (AdamW creates its state on its first step)",
                len(optimizer.state), 0)
    check_equal(f"{bad}: gradients cleared", all(t.grad is None for t in params + masters), True)

# %% [markdown]
# ## Check 3: small updates accumulate in the masters (bf16, no loss scale)
#
# Twenty SGD steps with a learning rate so small that most single updates fall below bf16's
# rounding edge (2^-8 of the weight). They must still add up in the fp32 masters, exactly as
# in the reference, while the bf16 parameters are always the masters rounded.

# %%
SGD = lambda model: torch.optim.SGD(model.parameters(), lr=1e-4)  # noqa: E731
model, params, masters, optimizer = yours(torch.bfloat16, SGD)
ref_model, mp = reference(torch.bfloat16, make_optimizer=SGD)
start = flat(masters)
gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
for step in range(20):
    loss_fp32(model, *get_batch(DATA, 4, gen_a)).backward()
    student.master_weights_step(params, masters, optimizer, 1.0)
    mp.backward(loss_fp32(ref_model, *get_batch(DATA, 4, gen_b)))
    mp.step()
moved = (flat(masters) != start).float().mean().item()
check_close("fp32 masters after 20 small steps", flat(masters), flat(mp.masters), rtol=0, atol=0)  # same arithmetic
check_equal("bf16 parameters = masters rounded to bf16",
            all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, masters)), True)
check_equal("most master weights moved", moved > 0.5, True)

# %% [markdown]
# ## Check 4: thirty steps of fp16 training with a dynamic loss scale
#
# Your step inside the full loop: the scale starts at 2^16 and follows the dynamic rule of
# notebook 04 §1.4 (halve on a skipped step, double after 3 good steps), driven by what your
# step returns. The reference runs the same recipe; losses, skipped steps and weights must
# match.

# %%
def train_yours(steps=30, scale=2.0**16):
    model, params, masters, optimizer = yours(torch.float16)
    gen, good, losses, skipped = torch.Generator().manual_seed(2), 0, [], []
    for _ in range(steps):
        loss = loss_fp32(model, *get_batch(DATA, 8, gen))
        (loss * scale).backward()
        took = student.master_weights_step(params, masters, optimizer, scale)
        losses.append(loss.item())
        skipped.append(not took)
        scale, good = update_scale(scale, good, not took, growth_interval=3)
    return losses, skipped, flat(masters)


def train_reference(steps=30):
    model, mp = reference(torch.float16, scale=2.0**16, growth_interval=3)
    gen, losses = torch.Generator().manual_seed(2), []
    for _ in range(steps):
        loss = loss_fp32(model, *get_batch(DATA, 8, gen))
        mp.backward(loss)
        mp.step()
        losses.append(loss.item())
    return losses, [s for _, s in mp.loss_scaler.history], flat(mp.masters)


mine, ref = train_yours(), train_reference()
check_equal("the same steps skipped (the scale found the overflow edge)", mine[1], ref[1])
check_equal("at least one step skipped", any(ref[1]), True)
# exact: the same arithmetic as the reference, step by step (an unscale by a power of two adds no rounding)
check_close("the same losses, step by step", mine[0], ref[0], rtol=0, atol=0)
check_close("the same master weights at the end", mine[2], ref[2], rtol=0, atol=0)

# %% [markdown]
# ## Check 5: the same skip decisions as `torch.amp.GradScaler`
#
# PyTorch's `GradScaler` makes the same decision inside `scaler.step(optimizer)`. Both are fed
# one gradient per step, scaled by GradScaler's current scale, with infs and a nan injected.

# %%
flags = [False, False, "inf", False, "nan", False, False, "inf", "inf", False]
gs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
q = torch.nn.Parameter(torch.zeros(6))
opt_q = torch.optim.SGD([q], lr=1.0)
p16 = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
master = torch.zeros(6, requires_grad=True)
opt_m = torch.optim.SGD([master], lr=1.0)
theirs, mine = [], []
for flag in flags:
    gs.scale(torch.ones(()))  # GradScaler creates its scale tensor on first use
    scale = gs.get_scale()
    g = torch.full((6,), 0.5, dtype=torch.float16) * scale
    if flag:
        g[2] = math.inf if flag == "inf" else math.nan
    before = q.detach().clone()
    q.grad = g.float()
    gs.step(opt_q)
    gs.update()
    theirs.append(torch.equal(before, q.detach()))
    p16.grad = g.clone()
    mine.append(not student.master_weights_step([p16], [master], opt_m, scale))
check_equal("skipped steps, step by step", mine, theirs)
check_close("the same weights after the steps taken", master.detach(), q.detach(), rtol=0, atol=0)
