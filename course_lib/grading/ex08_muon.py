"""Checks of exercise 08, part 2: Muon's owner step (assign_owners, muon_owner_step).

    check_assign_owners              one owner per matrix, the same on every call, and the most
                                     loaded rank's Newton-Schulz work within Graham's (1969) bound
                                     for largest-first on the least loaded rank:
                                         max_r W_r <= sum(W) / N + (1 - 1/N) * max_i w_i
    check_muon_same_as_one_process   3 steps on 2 and 3 gloo ranks against the single-process Muon
                                     (course_lib.techniques.muon) given the same gradients
    check_muon_bytes                 a rank that owns no matrix receives at most its own rows

Beside ex08_zero2_step.py (part 1, whose helpers it uses) so that each module stays near 300 lines.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from course_lib.grading import CheckFailed, announce, check_equal, passed
from course_lib.grading.ex08_zero2_step import RANKS, TRAIN, _close
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import run_on_ranks
from course_lib.techniques.muon import Muon, adjusted_lr

# Matrices of part 2: tall (Muon scales its update by sqrt(d0/d1) = sqrt(3)), 17 rows (padding on
# 2 and 3 ranks), wide, square. Gradients are seeded and handed to the ranks already averaged: the
# step is compared with the single-process Muon given the same gradients.
MUON_SHAPES = ((48, 16), (17, 12), (16, 40), (24, 24))
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=5)
MUON_STEPS, MUON_WORLD_SIZES = 3, (2, 3)
# (label, shapes, N): a transformer's qkv, proj, fc, fc2 per layer; big and small alternating;
# fewer matrices than ranks; one rank.
OWNER_CASES = [("3 layers of (qkv, proj, fc, fc2), d = 16, on 2 ranks",
                ((48, 16), (16, 16), (64, 16), (16, 64)) * 3, 2),
               ("big and small matrices alternating, on 2 ranks", ((64, 64), (8, 64)) * 3, 2),
               ("one big matrix then two small, twice, on 3 ranks", ((64, 64), (8, 8), (8, 8)) * 2, 3),
               ("2 matrices on 3 ranks", ((16, 16), (32, 8)), 3), ("4 matrices on 1 rank", MUON_SHAPES, 1)]


def ns_work(shape) -> int:
    return min(shape) ** 2 * max(shape)  # as the stub states: Newton-Schulz's work up to a constant


def check_assign_owners(assign_owners) -> None:
    announce()  # names the graded student.py before any failure
    for label, shapes, n in OWNER_CASES:
        owners = assign_owners(list(shapes), n)
        valid = (isinstance(owners, (list, tuple)) and len(owners) == len(shapes)
                 and all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o < n for o in owners))
        if not valid:
            raise CheckFailed(f"{label}: got {owners!r}; expected one owner rank in 0..{n - 1} per matrix "
                              f"({len(shapes)} of them)")
        check_equal(f"{label}: the same owners when called again (every rank must agree)",
                    list(assign_owners(list(shapes), n)), list(owners))
        work = [ns_work(s) for s in shapes]
        load = [sum(w for w, o in zip(work, owners) if o == r) for r in range(n)]
        # Graham's (1969) bound for putting each matrix on the least loaded rank so far, in exact
        # integers: N max_r W_r <= sum W + (N - 1) max_i w_i
        if n * max(load) > sum(work) + (n - 1) * max(work):
            raise CheckFailed(f"{label}: the most loaded rank has Newton-Schulz work {max(load):,} (per rank: {load}), "
                              f"more than sum/N + (1 - 1/N) x largest = {(sum(work) + (n - 1) * max(work)) / n:,.0f}; "
                              "dealing the matrices out in turn, regardless of size, can pile the big ones on one rank")
        passed(f"{label}: one owner each, most loaded rank {max(load):,} <= sum/N + (1 - 1/N) x largest")


def muon_owner_sets(n: int) -> dict[str, list[int]]:
    """Owners of MUON_SHAPES: spread over the ranks, and all on the last rank (the others own none)."""
    return {"spread": [(i + 1) % n for i in range(len(MUON_SHAPES))], "last rank owns all": [n - 1] * len(MUON_SHAPES)}


@functools.lru_cache(maxsize=1)
def muon_inputs() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(TRAIN.seed)
    weights = [torch.randn(s, generator=gen) / s[1] ** 0.5 for s in MUON_SHAPES]
    return weights, [[torch.randn(s, generator=gen) for s in MUON_SHAPES] for _ in range(MUON_STEPS)]


def _rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    c = -(-t.shape[0] // n)
    padded = torch.zeros(n * c, t.shape[1])
    padded[:t.shape[0]] = t
    return padded[r * c:(r + 1) * c].clone()


def rank_muon(step) -> dict:
    """MUON_STEPS calls of the learner's step per owner set; this rank's rows and bytes received per call."""
    n, r = dist.get_world_size(), dist.get_rank()
    weights0, grads = muon_inputs()
    out = {}
    for name, owners in muon_owner_sets(n).items():
        weights, recv = [_rows(w, n, r) for w in weights0], []
        momenta = [torch.zeros_like(w) for w in weights]
        for step_grads in grads:
            with CommTracer() as tracer:
                step(weights, [_rows(g, n, r) for g in step_grads], momenta, MUON_SHAPES, owners, group=None, **MUON)
            recv.append(tracer.total_bytes()["bytes_recv"])
        out[name] = {"weights": weights, "momenta": momenta, "recv": recv}
    return out


def run_muon(step, n: int) -> list[dict]:
    return run_on_ranks(rank_muon, step, world_size=n, **RANKS)


@functools.lru_cache(maxsize=1)
def muon_single_process() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """course_lib.techniques.muon.Muon (torch.optim.Muon's maths) on the same gradients: (weights, momenta)."""
    weights0, grads = muon_inputs()
    params = [torch.nn.Parameter(w.clone()) for w in weights0]
    opt = Muon(params, **MUON)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]


def check_muon_same_as_one_process(out: list[dict]) -> None:
    announce()
    n, (want_w, want_b) = len(out), muon_single_process()
    weights0, _ = muon_inputs()
    for name in out[0]:
        for i, shape in enumerate(MUON_SHAPES):
            got_b = torch.cat([o[name]["momenta"][i] for o in out])[:shape[0]]
            # fp32 element-wise (lerp, or mu B + (1 - mu) G written out: a rounding apart)
            _close(f"{n} ranks, owners {name}, matrix {shape}: momentum after {MUON_STEPS} steps", got_b, want_b[i],
                   rtol=1e-5, atol=1e-6, hint="each rank's momentum rows must follow B <- mu B + (1 - mu) G every step")
            got = torch.cat([o[name]["weights"][i] for o in out])[:shape[0]]
            lr_ = adjusted_lr(MUON["lr"], None, shape)
            decayed = weights0[i] * (1 - MUON["lr"] * MUON["weight_decay"]) ** MUON_STEPS  # W without the updates
            moved, want_moved = (got - decayed).reshape(-1), (want_w[i] - decayed).reshape(-1)
            scale = (moved @ want_moved / (want_moved @ want_moved)).item()
            unscaled = lr_ != MUON["lr"] and abs(scale * lr_ / MUON["lr"] - 1) < 0.02  # moved by lr, not lr'
            hint = (f"your update is {scale:.3g} times Muon's: Muon scales it by sqrt(max(1, d0/d1)) = "
                    f"{lr_ / MUON['lr']:.3g} for this shape" if unscaled else
                    "rank r's rows must be rows r*c .. r*c + c - 1 of Newton-Schulz of the WHOLE matrix, "
                    "not of its own block")
            # Newton-Schulz runs in bfloat16 (8-bit mantissa): another summation order (padding rows)
            # can move O by a few 2^-8 relative; a wrong step moves W by ~lr' per element per step.
            # RMS of the difference against a hundredth of one step's lr'.
            rms = (got - want_w[i]).pow(2).mean().sqrt().item()
            _close(f"{n} ranks, owners {name}, matrix {shape}: weights after {MUON_STEPS} steps "
                   "(RMS of the difference)", rms, 0.0, rtol=0, atol=lr_ / 100, hint=hint)


def check_muon_bytes(out: list[dict]) -> None:
    """With every matrix on the last rank, the other ranks receive their rows of each O, no more."""
    announce()
    n = len(out)
    bound = 4 * sum(-(-d0 // n) * d1 for d0, d1 in MUON_SHAPES)  # their rows, even sent in fp32
    for rank, o in enumerate(out[:-1]):
        recv = o["last rank owns all"]["recv"]
        if max(recv) > bound:
            raise CheckFailed(f"{n} ranks, rank {rank} owns no matrix but received {max(recv):,} bytes in a step, more "
                              f"than its own rows of the updates ({bound:,} bytes in fp32): only a matrix's owner may "
                              "gather it whole and run Newton-Schulz on it")
        passed(f"{n} ranks, rank {rank} (owns no matrix): received {max(recv):,} bytes a step <= its rows, {bound:,}")
