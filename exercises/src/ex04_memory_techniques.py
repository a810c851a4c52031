# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex04_memory_techniques.ipynb)

# %% [markdown]
# # Exercise 04: a mixed-precision step with fp32 master weights and gradient clipping
#
# **Goal.** Write `master_weights_step(params, masters, optimizer, loss_scale, max_norm=None)`
# in `exercises/ex04_memory_techniques/student.py`: the optimizer step of mixed-precision
# training. The model computes in fp16 or bf16; the optimizer updates an fp32 copy of the
# weights; the loss was multiplied by a loss scale before backward. The docstring in
# `student.py` states what must hold after the step; how to get there is yours to work out.
#
# Re-read notebook 04 first: §1.1 (the number formats, fp16's largest value and bf16's 8
# significant bits), §1.3 (why gradients are scaled), §1.4 (the dynamic loss scale: who decides
# to skip) and §1.5 (master weights).
#
# **The step notebook 04 does not take: clipping.** Notebook 04 trains with its own step and
# `grad_clip=1.0` without showing where the clip goes. Your step takes `max_norm`: the largest
# global gradient norm allowed, in the units of the *true* gradient, so that the step equals
# what an fp32 model would do with `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`
# before its optimizer step. The gradients you are handed are 16-bit and multiplied by the
# loss scale.
#
# **Think first.**
# 1. Why not keep only the 16-bit weights and apply `w16 += (lr * g).to(w16.dtype)`? What is
#    lost, and where?
# 2. With a loss scale of 2^16 and a true gradient norm of about 3, what is the norm of the
#    gradients you are handed, and what is the square of one of their larger entries? Does it
#    fit in fp16?
# 3. Where in your step must the clip go relative to the unscale, and relative to the decision
#    to skip? What goes wrong in each wrong place?
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your step runs on the course GPT next to an
# fp32 copy of the model that takes the optimizer's step on the true gradient (clipped by
# `torch.nn.utils.clip_grad_norm_` when `max_norm` is given), on the same 16-bit gradients; the
# skip rule is also compared with `torch.amp.GradScaler`. Edit `student.py`, then *Kernel →
# Restart and run all*.

# %%
# Google Colab only (elsewhere this cell does nothing): fetch the course at its pinned revision, set it up
import os, subprocess, sys
if "google.colab" in sys.modules:
    home = os.environ.get("COURSE_COLAB_HOME", "/content/course")
    if not os.path.isdir(home):
        subprocess.run(["git", "clone", "-q", os.environ.get("COURSE_COLAB_REPO", "https://github.com/OWNER/distributed-training-from-first-principles"), home], check=True)
        subprocess.run(["git", "-C", home, "checkout", "-q", "v0.1.0"], check=True)
    sys.path.insert(0, home); from course_lib.colab import arrive; arrive(home, "exercises")

# %%
import torch

from course_lib.grading import load_student
from course_lib.grading import ex04_memory_techniques as grade

torch.set_num_threads(1)
student = load_student("ex04_memory_techniques", refuse=grade.REFUSE)

# %% [markdown]
# ## Check 1: one fp16 step with a loss scale of 2^12
# One parameter got no gradient (as if unused in this step): it must be left alone.

# %%
grade.check_one_step(student)

# %% [markdown]
# ## Check 2: inf or nan in a gradient skips the step
#
# After one good step, a gradient entry is overwritten with inf (then nan) after backward, as
# an overflow of the scaled loss would leave it. Nothing may change: not the weights, not the
# optimizer's moments or step count.

# %%
grade.check_skip(student)

# %% [markdown]
# ## Check 3: small updates accumulate in the masters (bf16, no loss scale)
#
# Twenty SGD steps with a learning rate so small that most single updates fall below bf16's
# rounding edge (2^-8 of the weight). They must still add up in the fp32 masters, while the
# bf16 parameters are always the masters rounded.

# %%
grade.check_small_updates(student)

# %% [markdown]
# ## Check 4: clipping, with a loss scale of 2^16
#
# One step with a `max_norm` below the true gradient's norm (it clips) and one far above it
# (it must not).

# %%
grade.check_clipping(student)

# %% [markdown]
# ## Check 5: thirty steps of fp16 training with a dynamic loss scale
#
# Your step inside the full loop: the scale starts at 2^16 and follows the dynamic rule of
# notebook 04 §1.4 (halve on a skipped step, double after 3 good steps), driven by what your
# step returns. Skips and masters are compared with the fp32 copy at every step.

# %%
grade.check_dynamic_scale(student)

# %% [markdown]
# ## Check 6: the same skip decisions as `torch.amp.GradScaler`
#
# PyTorch's `GradScaler` makes the same decision inside `scaler.step(optimizer)`. Both are fed
# one gradient per step, scaled by GradScaler's current scale, with infs and a nan injected.

# %%
grade.check_like_gradscaler(student)

# %% [markdown]
# ## Looking back
#
# All checks passed? The answers to the questions above, as you found them:
#
# 1. Keeping only 16-bit weights rounds every update into the weight's 16 bits: in bf16 any
#    update below 2^-8 of the weight is lost, every step, so small but consistent updates
#    never accumulate (check 3). The fp32 master adds them at full precision; only the copy
#    used for forward and backward is rounded (Micikevicius et al., 2018).
# 2. Scaled by 2^16, a gradient of norm ~3 has norm ~2·10^5, beyond fp16's largest value
#    (65504); its larger entries' squares overflow long before. A norm computed from the
#    16-bit scaled gradients is inf, and `max_norm / inf` clips every gradient to zero (check 4).
# 3. Clip after unscaling, in fp32: `max_norm` is in the true gradient's units (PyTorch's AMP
#    examples say the same for `GradScaler`: call `scaler.unscale_(optimizer)` before
#    clipping). And decide the skip first: a step that is skipped needs no clip, and a clip
#    of gradients holding an inf turns them into nans.
#
# Having written it, compare with `MixedPrecisionOptimizer.step` in
# `course_lib/techniques/amp.py`.
