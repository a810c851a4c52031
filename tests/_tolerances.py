"""Float tolerances the tests share, each with the reason it is sound on every x86 CPU (AVX2,
AVX-512, AMX, ATEN_CPU_CAPABILITY=default) and any thread count.

Two runs that compute the same thing in another order (ranks, shards, micro-batches, buckets)
differ by the rounding of their sums: fp32 keeps 24 bits (eps = 2^-23 ~ 1.2e-7), and a sum of n
terms reordered moves by at most ~n·eps·sum|terms| (pairwise sums: ~log2(n)·eps·sum|terms|).

AdamW magnifies that rounding. Its update is lr·m̂/(sqrt(v̂) + eps_adam); on a first step it is
lr·g/(|g| + 1e-8), whose slope near g = 0 is lr/1e-8: an element whose gradient is within rounding
of 0 can move by anything up to ±lr in one run and not in the other (the key bias of attention,
whose exact gradient is 0, is pure rounding in every step). So after AdamW steps parameters are
not compared element by element to a tight tolerance: they are bounded element by element by
what AdamW can move an element at all, and compared in RMS, which those rare elements cannot
move (measured on the tiny GPT, 110,400 parameters, 3 AdamW steps at lr = 3e-3, one batch vs two
half batches, 40 seeds, AVX-512 and the scalar path: largest element lr/23, RMS <= 1.3e-4·lr).
The gradients and losses that follow such steps see those elements too (H·Δp): they are compared
in norm (gradients) or to a tolerance that allows them (losses).
"""

import math

import torch

# |loss difference| after AdamW steps: the demos print checks against it too (its reason is there).
from course_lib.tolerances import adamw_loss_atol  # noqa: F401  (re-exported for the tests)

FP32_EPS = torch.finfo(torch.float32).eps  # 2^-23 ~ 1.19e-7: the spacing of fp32 numbers at 1
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7: bf16 keeps 8 significant bits (rounding <= 2^-8 relative)
FP16_EPS = torch.finfo(torch.float16).eps  # 2^-10: fp16 keeps 11 significant bits (rounding <= 2^-11 relative)

# Relative tolerance of a gradient computed with its fp32 sums in another order, before any
# optimizer step: ~n·eps for the n <= ~1000 tokens summed into each element (1e-4 ~ 840 ulps).
# Elements that cancel to ~0 keep the absolute error of their terms: hence also an absolute
# tolerance of the same 1e-4 times the tensor's largest element (a term is at most that large
# up to the ~sqrt(tokens) of a cancelling sum, and its error a few ulps of it).
FP32_SUM_RTOL = 1e-4

# After AdamW steps, in RMS: a hundredth of one step of lr (what a wrong shard, a lost update or
# a wrong gradient moves most elements by; a 32-element bias left unupdated in a 29k-parameter
# model gives 0.06·lr); the rounding-driven moves above stay ~1e-4·lr. A move of the full ±lr
# needs a gradient within rounding of 0 whose rounding is itself >= eps_adam (1e-8), which the
# 80 runs above never showed; even one such element leaves a 110k-parameter model below lr/100.
ADAMW_RMS_FRACTION_OF_LR = 1e-2

# After AdamW steps, gradients in norm: an element moved by rounding changes the next gradients
# by ~H·Δp; measured on the seeds above with the largest moves (up to lr/23): <= 2.5e-5 of the
# whole gradient's norm and <= 7.3e-5 of any one tensor's; 1e-3 leaves > 10x. A gradient
# averaged over the wrong number of ranks, or a wrong shard, is off by O(1).
ADAMW_GRAD_REL_NORM = 1e-3


def fp32_sum_atol(want: torch.Tensor) -> float:
    """Absolute tolerance of fp32 sums in another order: FP32_SUM_RTOL of the largest element."""
    return FP32_SUM_RTOL * want.detach().abs().max().item()


def assert_close_fp32_sums(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """got equals want up to the rounding of fp32 sums taken in another order (no AdamW step
    between them): element by element, FP32_SUM_RTOL relative plus FP32_SUM_RTOL of want's
    largest element absolute."""
    torch.testing.assert_close(got, want, rtol=FP32_SUM_RTOL, atol=fp32_sum_atol(want), msg=msg or None)


def adamw_step_bound(betas: tuple[float, float], step: int) -> float:
    """The most one bias-corrected Adam update at `step` can move an element, in units of lr,
    whatever the gradients: |m̂|/sqrt(v̂) <= sqrt(sum_i a_i^2 / b_i) (Cauchy-Schwarz), a_i and b_i
    the weights m̂ and v̂ give gradient i. 1 at step 1, ~1.002 at step 3 for betas (0.9, 0.95)."""
    b1, b2 = betas
    a = [(1 - b1) * b1 ** (step - i) / (1 - b1 ** step) for i in range(1, step + 1)]
    b = [(1 - b2) * b2 ** (step - i) / (1 - b2 ** step) for i in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def relative_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm()).item()


def assert_adamw_params_close(got: torch.Tensor, want: torch.Tensor, lr: float, steps: int,
                              betas: tuple[float, float] = (0.9, 0.95), first_step: int = 1, msg: str = "") -> None:
    """Parameters of two runs after AdamW steps `first_step`..`first_step + steps - 1` taken from
    the same state with gradients equal up to fp32 rounding: (1) no element differs by more than
    both runs' updates together could move it (2·lr·bound per step; weight decay multiplies both
    by the same 1 - lr·wd), (2) in RMS they agree to ADAMW_RMS_FRACTION_OF_LR·lr."""
    diff = (got.detach() - want.detach()).abs()
    hard = 2 * lr * sum(adamw_step_bound(betas, s) for s in range(first_step, first_step + steps))
    hard += 8 * FP32_EPS * want.detach().abs().max().item()  # the parameters' own fp32 rounding
    assert diff.max().item() <= hard, f"{msg}: largest |difference| {diff.max().item():.3g} > {hard:.3g}"
    assert rms(diff) <= ADAMW_RMS_FRACTION_OF_LR * lr, \
        f"{msg}: RMS difference {rms(diff):.3g} > {ADAMW_RMS_FRACTION_OF_LR} * lr = {ADAMW_RMS_FRACTION_OF_LR * lr:.3g}"


def assert_grads_close_after_adamw(got, want, msg: str = "") -> None:
    """Gradients taken after AdamW steps (whose rounding-driven moves they see): in norm, of the
    whole flat vector, or of every tensor when given {name: tensor} dicts (the same names)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), (msg, sorted(set(got) ^ set(want)))
        for name in want:
            assert_grads_close_after_adamw(got[name], want[name], f"{msg} {name}")
        return
    if want.detach().norm() == 0:  # no gradient at all (an unused parameter): nothing to round
        assert torch.equal(got, want), f"{msg}: expected an all-zero gradient"
        return
    rel = relative_norm(got, want)
    assert rel <= ADAMW_GRAD_REL_NORM, f"{msg}: |difference| / |gradient| = {rel:.3g} > {ADAMW_GRAD_REL_NORM}"


def by_name(flat: torch.Tensor, model: torch.nn.Module) -> dict:
    """{name: slice} of a flat vector laid out like model.parameters() (a tied weight once), to
    compare gradients tensor by tensor."""
    out, offset = {}, 0
    for name, p in model.named_parameters():
        out[name] = flat[offset:offset + p.numel()]
        offset += p.numel()
    assert offset == flat.numel(), (offset, flat.numel())
    return out


def bf16_loss_atol(losses) -> float:
    """|loss difference| allowed between two bf16 runs: the losses are bf16 numbers, 2^-7 * 2^e
    apart in [2^e, 2^(e+1)) (0.031 for losses in [4, 8)), so two runs may round one spacing apart
    (<= 2^-7 of the largest loss), plus ~1e-2 for the bf16 rounding (2^-8 relative) of the
    activations averaged over the tokens and the elements AdamW moves differently where a bf16
    gradient's sign is within its rounding. A wrong shard or reduction moves a loss by > 0.1."""
    return 2.0**-7 * max(abs(x) for x in losses) + 1e-2
