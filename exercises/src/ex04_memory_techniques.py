# %% [markdown]
# # Exercise 04: a loss scaler's rule and a checkpointed forward
#
# **Goal.** Write two functions in `exercises/ex04_memory_techniques/student.py` (notebook 04
# explains both ideas):
#
# 1. `update_scale(scale, good_steps, found_inf, growth_factor, backoff_factor, growth_interval)`:
#    one step of **dynamic loss scaling**. On an overflow (`found_inf`), multiply the scale by
#    `backoff_factor` and reset the count of good steps; otherwise count the step, and after
#    `growth_interval` good steps in a row multiply the scale by `growth_factor` and reset the count.
#    Return `(scale, good_steps)`.
# 2. `checkpointed_forward(model, idx, targets, every_k)`: `GPT.forward` with the blocks run in
#    segments of `every_k` consecutive blocks, each segment under
#    `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. Reject `every_k` outside
#    `1 ... n_layer` with a `ValueError`.
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. The outputs stored in this notebook are what
# correct code prints; `make test` (nbval) re-runs the notebook and compares. Edit `student.py`,
# then *Kernel → Restart and run all*.

# %%
import torch

from course_lib.techniques.amp import DynamicLossScaler
from course_lib.techniques.activation_checkpointing import checkpointed_forward as reference_forward
from course_lib.grading import CheckFailed, check_equal, load_student
from course_lib.observe.memory import SavedActivations
from course_lib.model import GPT, GPTConfig

student = load_student("ex04_memory_techniques")

# %% [markdown]
# ## Check 1: the update rule, one step at a time

# %%
check_equal("good step: count it", student.update_scale(1024.0, 0, False, 2.0, 0.5, 3), (1024.0, 1))
check_equal("growth_interval-th good step: grow and reset", student.update_scale(1024.0, 2, False, 2.0, 0.5, 3), (2048.0, 0))
check_equal("overflow: back off and reset", student.update_scale(1024.0, 2, True, 2.0, 0.5, 3), (512.0, 0))
check_equal("other factors", student.update_scale(64.0, 0, True, 4.0, 0.25, 1), (16.0, 0))

# %% [markdown]
# ## Check 2: the scale trajectory over a fixed sequence of overflows
#
# Each sequence of `found_inf` flags is replayed through your rule and through
# `course_lib.techniques.amp.DynamicLossScaler` (which matches `torch.amp.GradScaler` step for step).

# %%
def trajectory(rule, flags, init_scale, growth_factor, backoff_factor, growth_interval):
    scale, good, out = init_scale, 0, []
    for flag in flags:
        scale, good = rule(scale, good, flag, growth_factor, backoff_factor, growth_interval)
        out.append((scale, good))
    return out


def reference_trajectory(flags, init_scale, growth_factor, backoff_factor, growth_interval):
    ref = DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    out = []
    for flag in flags:
        ref.update(flag)
        out.append((ref.scale, ref.good_steps))
    return out


gen = torch.Generator().manual_seed(4)
random_flags = (torch.rand(60, generator=gen) < 0.2).tolist()
cases = {
    "2^16, x2 / x0.5, every 3 steps": ([False] * 7 + [True] + [False] * 4 + [True, True] + [False] * 8, (2.0**16, 2.0, 0.5, 3)),
    "1024, x4 / x0.25, every step": ([False, False, True, False, True, True, False], (1024.0, 4.0, 0.25, 1)),
    "default interval 2000: no growth in 50 steps": ([False] * 50, (2.0**16, 2.0, 0.5, 2000)),
    "random overflows, every 2 steps": (random_flags, (2.0**10, 2.0, 0.5, 2)),
}
for label, (flags, args) in cases.items():
    check_equal(label, trajectory(student.update_scale, flags, *args), reference_trajectory(flags, *args))

# %% [markdown]
# ## Check 3: checkpointing changes nothing in the numbers
#
# Logits, loss and every gradient must be identical (not just close) to the plain model's, for
# segment lengths that divide the depth and one that does not.

# %%
cfg = GPTConfig.tiny(vocab_size=40, n_layer=3, d_model=32)
model = GPT(cfg)
g = torch.Generator().manual_seed(0)
x, y = torch.randint(0, 40, (2, 16), generator=g), torch.randint(0, 40, (2, 16), generator=g)


def run(fwd):
    model.zero_grad(set_to_none=True)
    logits, loss = fwd()
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]


plain = run(lambda: model(x, y))
for k in (1, 2, 3):
    logits, loss, grads = run(lambda: student.checkpointed_forward(model, x, y, every_k=k))
    check_equal(f"every_k={k}: same logits and loss", torch.equal(logits, plain[0]) and torch.equal(loss, plain[1]), True)
    check_equal(f"every_k={k}: all gradients identical", all(torch.equal(a, b) for a, b in zip(grads, plain[2])), True)

# %% [markdown]
# ## Check 4: fewer saved bytes
#
# `SavedActivations` counts what autograd keeps for backward. Checkpointed, only the segment
# inputs (plus what lies outside the blocks) remain: far less than the plain model, and exactly
# what the reference implementation keeps.

# %%
def saved_bytes(fwd):
    with SavedActivations(model) as saved:
        fwd()
    return saved.bytes


plain_bytes = saved_bytes(lambda: model(x, y))
for k in (1, 2, 3):
    got = saved_bytes(lambda: student.checkpointed_forward(model, x, y, every_k=k))
    check_equal(f"every_k={k}: less than half of the plain model's saved bytes", got < plain_bytes / 2, True)
    check_equal(f"every_k={k}: same saved bytes as the reference", got, saved_bytes(lambda: reference_forward(model, x, y, every_k=k)))

# %% [markdown]
# ## Check 5: a clear error for a bad `every_k`

# %%
for bad in (0, cfg.n_layer + 1):
    try:
        student.checkpointed_forward(model, x, y, every_k=bad)
    except ValueError:
        print(f"PASS  every_k={bad} raises ValueError")
    else:
        raise CheckFailed(f"every_k={bad} should raise ValueError (1 <= every_k <= n_layer={cfg.n_layer})")
