"""Checkers of exercise 04 (one mixed-precision optimizer step with fp32 master weights, a loss
scale, a skip on overflow and gradient clipping in the true gradient's units).

Every check runs the learner's step next to a *twin*: an fp32 copy of the model that takes the
optimizer's step on the true (unscaled) gradient, clipped by torch.nn.utils.clip_grad_norm_ when
a max_norm is given: what the step must equal by its contract. Both see the same 16-bit
gradients, copied before the learner's step runs.

    check_one_step(student)        fp16, loss scale 2^12, AdamW: masters equal the twin's
                                   exactly, parameters are the masters rounded, dtypes kept,
                                   gradients cleared, a parameter without gradient left alone
    check_skip(student)            inf, then nan, in one gradient after a good step: nothing
                                   moves (masters, parameters, every optimizer state tensor)
    check_small_updates(student)   bf16, 20 SGD steps too small for bf16: the masters follow
                                   the twin exactly and most of them move
    check_clipping(student)        fp16, loss scale 2^16 (the scaled gradients' squares do not
                                   fit in fp16), a max_norm that clips and one that does not:
                                   the update equals the twin's
    check_dynamic_scale(student)   30 fp16 steps from a scale of 2^16 (halved on a skip,
                                   doubled after 3 good steps): the same skips as the twin,
                                   masters equal at every step
    check_like_gradscaler(student) the skip decisions of torch.amp.GradScaler, step by step

REFUSE names what already holds the answer: the course's mixed-precision optimizer and loss
scaler, and torch's GradScaler.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from course_lib.data import CharDataset, get_batch
from course_lib.grading import CheckFailed, check_close, check_equal, passed
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, make_optimizer

REFUSE = ("course_lib.techniques.amp",  # MixedPrecisionOptimizer, DynamicLossScaler, found_inf, update_scale
          "torch.amp.grad_scaler", "torch.cuda.amp", "course_lib.grading.ex04_memory_techniques")

DATA = CharDataset("train")
CFG = GPTConfig.tiny(DATA.vocab_size)
ADAMW = lambda model: make_optimizer(model, TrainConfig(lr=3e-3))  # noqa: E731


def _sgd(lr):
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr)


def _loss(model, x, y):
    logits, _ = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


class _Run:
    """The learner's 16-bit model with its masters and optimizer, and the fp32 twin."""

    def __init__(self, dtype, make_opt):
        torch.manual_seed(0)
        model = GPT(CFG)
        master_model, twin_model = copy.deepcopy(model), copy.deepcopy(model)
        self.optimizer, self.twin_optimizer = make_opt(master_model), make_opt(twin_model)
        self.model = model.to(dtype)
        self.params, self.masters = list(model.parameters()), list(master_model.parameters())
        self.twin = list(twin_model.parameters())

    def backward(self, x, y, scale):
        (_loss(self.model, x, y) * scale).backward()

    def step(self, student, scale, max_norm=None):
        """The twin's step, then the learner's, on the same 16-bit gradients: (took, twin took)."""
        grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        unscaled = [None if g is None else g.float() * (1.0 / scale) for g in grads]
        twin_took = all(g is None or bool(torch.isfinite(g).all()) for g in unscaled)
        if twin_took:
            for t, g in zip(self.twin, unscaled):
                t.grad = g
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.twin, max_norm)
            self.twin_optimizer.step()
        for t in self.twin:
            t.grad = None
        if max_norm is None:
            took = student.master_weights_step(self.params, self.masters, self.optimizer, scale)
        else:
            took = student.master_weights_step(self.params, self.masters, self.optimizer, scale, max_norm)
        if not isinstance(took, bool):
            raise CheckFailed(f"master_weights_step returned {took!r}: True or False (in student.py)")
        return took, twin_took

    def cleared(self):
        return all(t.grad is None for t in self.params + self.masters)

    def rounded(self):
        return all(torch.equal(p, m.to(p.dtype)) for p, m in zip(self.params, self.masters))


def _batch(seed, n=8):
    return get_batch(DATA, n, torch.Generator().manual_seed(seed))


def check_one_step(student) -> None:
    run = _Run(torch.float16, ADAMW)
    S = 2.0**12
    run.backward(*_batch(0), S)
    run.params[3].grad = None  # as if this parameter had not been used: no gradient, no step
    took, twin_took = run.step(student, S)
    check_equal("fp16, loss scale 2^12: the step was taken", took, twin_took)
    # exact: the same fp16 gradients, unscaled by a power of two (no rounding), the same AdamW arithmetic
    if not torch.equal(_flat(run.masters), _flat(run.twin)):
        moved = (_flat(run.masters) != _flat(run.twin)).float().mean().item()
        raise CheckFailed(f"fp16, loss scale 2^12: {moved:.1%} of your masters differ from an fp32 model's AdamW step "
                          "on the true gradient (in student.py). Is every gradient unscaled in fp32 (in 16 bits "
                          "small gradients underflow), and is the step taken on the masters?")
    passed("fp32 masters = an fp32 model's AdamW step on the true gradient (exactly)")
    check_equal("fp16 parameters = the masters, rounded", run.rounded(), True)
    check_equal("dtypes kept (fp16 parameters, fp32 masters)",
                ({p.dtype for p in run.params}, {m.dtype for m in run.masters}), ({torch.float16}, {torch.float32}))
    check_equal("gradients cleared (params and masters)", run.cleared(), True)


def _state(optimizer):
    return {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for p, s in optimizer.state.items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(torch.as_tensor(a[k][n]), torch.as_tensor(b[k][n]))
                                           for n in a[k]) for k in a)


def check_skip(student) -> None:
    S = 2.0**12
    for bad in (math.inf, math.nan):
        run = _Run(torch.float16, ADAMW)
        run.backward(*_batch(0), S)
        run.step(student, S)  # a good step first: AdamW now holds state that a bad step must not touch
        before, state = (_flat(run.masters), _flat(run.params)), _state(run.optimizer)
        run.backward(*_batch(1), S)
        run.params[5].grad.view(-1)[7] = bad  # as an overflow of the scaled loss would leave it
        took, _ = run.step(student, S)
        check_equal(f"{bad} in one gradient: step skipped (returns False)", took, False)
        check_equal(f"{bad}: masters and parameters unchanged",
                    torch.equal(before[0], _flat(run.masters)) and torch.equal(before[1], _flat(run.params)), True)
        check_equal(f"{bad}: the optimizer's state unchanged (moments and step count)",
                    _same_state(state, _state(run.optimizer)), True)
        check_equal(f"{bad}: gradients cleared", run.cleared(), True)


def check_small_updates(student) -> None:
    run = _Run(torch.bfloat16, _sgd(1e-4))
    start = _flat(run.masters)
    for step in range(20):
        run.backward(*_batch(10 + step, 4), 1.0)
        run.step(student, 1.0)
        if not torch.equal(_flat(run.masters), _flat(run.twin)):
            raise CheckFailed(f"bf16, SGD lr 1e-4, step {step + 1}: the masters differ from an fp32 model's steps "
                              "(in student.py): updates below bf16's rounding edge must still add up somewhere")
    passed("bf16, 20 small SGD steps: the masters equal an fp32 model's, step by step (exactly)")
    check_equal("bf16 parameters = masters rounded to bf16", run.rounded(), True)
    check_equal("most master weights moved", (_flat(run.masters) != start).float().mean().item() > 0.5, True)


def check_clipping(student) -> None:
    S, lr = 2.0**16, 0.1
    for max_norm in (0.25, 1000.0):
        run = _Run(torch.float16, _sgd(lr))
        before = _flat(run.masters)
        run.backward(*_batch(3), S)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in run.params])).item() / S
        took, _ = run.step(student, S, max_norm)
        if not took:
            raise CheckFailed(f"loss scale 2^16, max_norm={max_norm}: your step was skipped although every gradient "
                              "is finite (in student.py): the squares of the *scaled* 16-bit gradients overflow "
                              "fp16; is the norm computed there?")
        mine, theirs = _flat(run.masters) - before, _flat(run.twin) - before
        # The learner may sum the squares in another order than clip_grad_norm_ (and may or may not add its
        # 1e-6 to the norm): relative differences of ~1e-6 in the update. Clipping the scaled gradient, per
        # tensor, or not at all is off by O(1).
        error = ((mine - theirs).norm() / theirs.norm()).item()
        active = "clips" if norm > max_norm else "does not clip"
        if mine.norm() == 0:
            raise CheckFailed(f"loss scale 2^16, max_norm={max_norm}: your step did not move the masters (in student.py): "
                              "a clip coefficient of zero? The squares of the scaled 16-bit gradients overflow fp16, "
                              "and a norm of inf clips every gradient to zero")
        if not error < 1e-5:
            raise CheckFailed(f"loss scale 2^16, true gradient norm {norm:.3g}, max_norm={max_norm} ({active}): your "
                              f"update is off by {error:.2g} of its size (in student.py). max_norm bounds the *true* "
                              "gradient's global norm, over all the parameters together, as clip_grad_norm_ would on "
                              "an fp32 model")
        passed(f"loss scale 2^16, max_norm={max_norm} ({active}): the update = an fp32 model's clipped step")
    check_equal("parameters = the masters, rounded; gradients cleared", run.rounded() and run.cleared(), True)


def check_dynamic_scale(student, steps: int = 30) -> None:
    run = _Run(torch.float16, ADAMW)
    scale, good, skipped = 2.0**16, 0, []
    gen = torch.Generator().manual_seed(2)
    for step in range(steps):
        run.backward(*get_batch(DATA, 8, gen), scale)
        took, twin_took = run.step(student, scale)
        if took != twin_took:
            raise CheckFailed(f"step {step + 1}, loss scale {scale:g}: your step was {'taken' if took else 'skipped'}, "
                              f"an fp32 model would have {'taken' if twin_took else 'skipped'} it (in student.py)")
        if not torch.equal(_flat(run.masters), _flat(run.twin)):
            raise CheckFailed(f"step {step + 1}, loss scale {scale:g}: the masters differ from an fp32 model's "
                              "(in student.py). Is every gradient unscaled in fp32 (in 16 bits small gradients "
                              "underflow)?")
        skipped.append(not took)
        good = 0 if not took else good + 1  # the dynamic rule of notebook 04 §1.4: halve on a skip,
        scale = scale / 2 if not took else scale  # double after 3 good steps in a row
        if good == 3:
            scale, good = scale * 2, 0
    passed(f"{steps} fp16 steps from a loss scale of 2^16: the same skips and masters as an fp32 model, step by step")
    check_equal("at least one step skipped (the scale found the overflow edge)", any(skipped), True)


def check_like_gradscaler(student) -> None:
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
    check_equal("the skip decisions of torch.amp.GradScaler, step by step", mine, theirs)
    check_close("the same weights after the steps taken", master.detach(), q.detach(), rtol=0, atol=0)


CHECKS = (check_one_step, check_skip, check_small_updates, check_clipping, check_dynamic_scale, check_like_gradscaler)
