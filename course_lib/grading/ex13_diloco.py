"""Checkers of exercise 13 (DiLoCo's outer step on the replicas' group, with a quorum).

    check_made_up_rounds(student)   4 rounds on 2 and 3 ranks whose parameters are made up
                                    (float64), some rounds with a replica outside the quorum:
                                    every replica leaves each round at theta_0, the same theta_0
                                    and b on all replicas, and the trajectory of theta_0 is
                                    DiLoCo's (torch.optim.SGD(nesterov=True) on the quorum's
                                    mean delta, evaluated here); a wrong trajectory that matches
                                    a known mistake is named
    check_training(student)         a tiny GPT trained by R = 2 and 3 replicas on gloo ranks (H = 2
                                    AdamW steps per round, 3 rounds) calling the learner's step:
                                    equal to the library's one-process simulate_diloco, and with
                                    a replica outside round 2's quorum equal to the same rounds
                                    replayed in one process here

Nothing here holds an expected value: the references are computed when the check runs, in one
process, by torch's own Nesterov SGD (never by the course's outer step, which REFUSE names).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.data import CharDataset, collate, sample_indices
from course_lib.grading import CheckFailed, announce, passed
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.diloco.simulate import param_rms_tolerance, simulate_diloco
from course_lib.runtime.device import rank_device
from course_lib.runtime.pool import RankTimeout, run_on_ranks
from course_lib.train import TrainConfig, flat_params, make_optimizer, share_rows, train_step

# Where the library holds the answer: the hand-written outer step (NesterovOuter) and the syncs
# and the average across replicas built on it. Their re-exports (course_lib.parallel.diloco) and
# the helpers that wrap them (parallel.ft's DiLoCo replicas) are refused by refusal.py.
REFUSE = ("course_lib.parallel.diloco.outer", "course_lib.parallel.diloco.training")

LR, MU = 0.7, 0.9  # the paper's outer optimizer (Douillard et al. 2023): lr_out (1 + mu) = 1.33 != 1
RANKS = dict(backend="gloo", timeout_s=120)

# ---------------------------------------------------------------- check 1: made-up rounds
SHAPES = ((5, 3), (7,), (2, 2, 2))
# Each round's quorum (the replicas whose steps count), per replica count: rounds with a replica
# missing, so the mean over the quorum and the mean over the group differ; every replica absent once.
QUORUMS = {2: ((0, 1), (0,), (0, 1), (1,)), 3: ((0, 1, 2), (0, 2), (1,), (0, 1, 2))}
SEED = 1300


def _start() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def _deltas(k: int, r: int) -> list[torch.Tensor]:
    """Replica r's theta_0 - theta_r in round k (what its H inner steps moved)."""
    gen = torch.Generator().manual_seed(SEED + 100 * (k + 1) + r)
    return [0.1 * torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def _made_up_rank(outer_step, quorums) -> list[dict]:
    rank, dev = dist.get_rank(), rank_device()
    anchor = [a.to(dev) for a in _start()]
    momentum = [torch.zeros_like(a) for a in anchor]
    record = []
    for k, quorum in enumerate(quorums):
        # theta_r as the model holds it: leaf tensors that require grad
        params = [torch.nn.Parameter(a - d.to(dev)) for a, d in zip(anchor, _deltas(k, rank))]
        outer_step(params, anchor, momentum, LR, MU, group=None, present=rank in quorum)
        record.append({name: [t.detach().cpu().clone() for t in ts]
                       for name, ts in (("params", params), ("anchor", anchor), ("momentum", momentum))})
    return record


def _trajectory(n: int, quorums, mistake: str | None = None) -> list[tuple[list, list]]:
    """(theta_0, b) after each round, by torch.optim.SGD(nesterov=True) on the quorum's mean
    delta; or as `mistake` computes it (the keys of MISTAKES)."""
    start = _start()
    theta = [torch.nn.Parameter(a.clone()) for a in start]
    opt = torch.optim.SGD(theta, lr=LR, momentum=MU, nesterov=True)
    anchor, buf = [a.clone() for a in start], [torch.zeros_like(a) for a in start]
    out = []
    for k, quorum in enumerate(quorums):
        counted = range(n) if mistake == "absent counted" else quorum
        deltas = [_deltas(k, r) for r in counted]
        total = [sum(ds) for ds in zip(*deltas)]
        if mistake is None:
            for p, t in zip(theta, total):
                p.grad = t / len(quorum)
            opt.step()
            out.append(([p.detach().clone() for p in theta], [opt.state[p]["momentum_buffer"].clone() for p in theta]))
            continue
        div = {"summed": 1, "divided by the group size": n}.get(mistake, len(counted))
        for a, b, t in zip(anchor, buf, total):
            d = t / div
            b.mul_(0 if mistake == "momentum not kept" else MU).add_(d)
            step = {"parameters averaged": d / LR, "plain momentum": b}.get(mistake, d + MU * b)
            a.add_(LR * step) if mistake == "sign" else a.sub_(LR * step)
        out.append(([a.clone() for a in anchor], [b.clone() for b in buf]))
    return out


# The plausible mistakes, each as the check recognises it (by the whole trajectory of theta_0)
# and what it tells the learner.
MISTAKES = {
    "parameters averaged": "theta_0 became the replicas' mean parameters every round: that is LocalSGD's average, "
                           "not DiLoCo's outer step. The mean delta theta_0 - theta_r is a pseudo-gradient for the "
                           "outer Nesterov optimizer (lr and momentum), not a step to take as it is",
    "sign": "theta_0 moved away from where the replicas went: a sign error. The delta theta_0 - theta_r "
            "points back to the start, like a gradient; the outer step goes against it",
    # stepping with last round's b and updating it after the step is the same trajectory
    "plain momentum": "theta_0 followed plain (heavy-ball) momentum, a step of lr b (or one with last round's b, "
                      "updated after the step: the same thing): DiLoCo's outer optimizer is Nesterov's, "
                      "SGD(momentum=mu, nesterov=True), which looks one momentum step ahead",
    "momentum not kept": "the outer momentum starts from zero every round: b must carry over from round to "
                         "round, updated in place in the `momentum` tensors the caller keeps",
    "summed": "the deltas were summed over the replicas, not averaged: the pseudo-gradient is their mean",
    "divided by the group size": "in a round with a replica outside the quorum, the deltas' sum was divided by "
                                 "all the replicas of the group: the mean is over the replicas in the quorum",
    "absent counted": "a replica outside the quorum contributed its delta: its steps do not count this round, "
                      "yet it must still take part in the round's communication",
}


def _differs(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want))


# float64 (spacing 2^-52 ~ 2.2e-16) on values of order 1 after a few dozen operations, summed in
# another order: differences ~1e-15; a learner's buffer in float32 (spacing 2^-23 ~ 1.2e-7) rounds
# the deltas to ~1e-7 of their size (0.1 here), not a mistake of the step: 1e-6 allows it. Every
# mistake above moves theta_0 by >= ~1e-2 (test_every_known_mistake_is_told_apart).
TOL = 1e-6


def _check_rounds(n: int, quorums, record: list[list[dict]], label: str) -> None:
    for k, quorum in enumerate(quorums):
        where = f"{label}, round {k + 1} (quorum: replicas {list(quorum)})"
        for r, rec in enumerate(record):
            got = rec[k]
            if any(not torch.equal(p, a) for p, a in zip(got["params"], got["anchor"])):
                if r not in quorum:
                    raise CheckFailed(f"{where}: replica {r}, outside the quorum, does not leave the round at the new "
                                      "theta_0: outer_step in student.py must still take part in the round (the same "
                                      "collective calls as the others) and end it where they do")
                before = _start() if k == 0 else rec[k - 1]["anchor"]
                if all(torch.equal(a, b) for a, b in zip(got["anchor"], before)):
                    raise CheckFailed(f"{where}: replica {r}'s theta_0 did not change: outer_step in student.py must "
                                      "update `anchor` (and `momentum`) in place, in the tensors the caller keeps for "
                                      "the next round, and leave the parameters equal to it")
                raise CheckFailed(f"{where}: replica {r}'s parameters are not the new theta_0 after outer_step in "
                                  "student.py: write theta_0 back into every replica's parameters (the next "
                                  "round starts there)")
            for name in ("anchor", "momentum"):
                if any(not torch.equal(g, w) for g, w in zip(got[name], record[0][k][name])):
                    what = "theta_0" if name == "anchor" else "momentum b"
                    state = "outside" if r not in quorum else "in"
                    raise CheckFailed(f"{where}: replica {r} ({state} the quorum) leaves the round with another "
                                      f"{what} than replica 0: every replica, in the quorum or not, must end the "
                                      "round with the same outer state (outer_step in student.py)")
    got = [(rec["anchor"], rec["momentum"]) for rec in record[0]]
    want = _trajectory(n, quorums)
    for k, ((ga, gb), (wa, wb)) in enumerate(zip(got, want)):
        if _differs(ga, wa) > TOL or _differs(gb, wb) > TOL:
            break
    else:
        passed(f"{label}, {len(quorums)} rounds, a replica outside the quorum in {sum(len(q) < n for q in quorums)} "
               "of them: every replica ends each round at the same theta_0, b, and it is DiLoCo's")
        return
    for mistake, message in MISTAKES.items():
        if all(_differs(ga, ma) <= TOL for (ga, _), (ma, _) in zip(got, _trajectory(n, quorums, mistake))):
            raise CheckFailed(f"{label}: outer_step in student.py: {message}")
    which = "theta_0" if _differs(got[k][0], want[k][0]) > TOL else "the momentum b"
    raise CheckFailed(f"{label}, round {k + 1} (quorum: replicas {list(quorums[k])}): {which} differs from DiLoCo's "
                      f"outer step by up to {max(_differs(got[k][0], want[k][0]), _differs(got[k][1], want[k][1])):.3g} "
                      "(the rounds before it were right): the mean delta over the quorum is the gradient of "
                      f"SGD(lr={LR}, momentum={MU}, nesterov=True) stepping theta_0")


def made_up_rounds(student, n: int, quorums, label: str | None = None) -> None:
    """The learner's outer_step on n ranks over the rounds `quorums` (each round's present replicas)."""
    announce()
    label = label or f"{n} replicas"
    try:
        record = run_on_ranks(_made_up_rank, student.outer_step, quorums, world_size=n, **RANKS)
    except RankTimeout as e:
        raise CheckFailed(f"{label}: the ranks waited for each other in outer_step (student.py) until the "
                          "time ran out: every replica, in the quorum or not, must make the same "
                          f"collective calls in the same order\n{e}") from None
    _check_rounds(n, quorums, record, label)


def check_made_up_rounds(student) -> None:
    for n, quorums in sorted(QUORUMS.items()):
        made_up_rounds(student, n, quorums)


# ---------------------------------------------------------------- check 2: real training
H, ROUNDS = 2, 3


def train_setup() -> tuple[GPTConfig, TrainConfig]:
    config = GPTConfig.tiny(CharDataset("train", 16).vocab_size, block_size=16, n_layer=1, n_head=2, d_model=32)
    return config, TrainConfig(steps=H * ROUNDS, batch_size=6, progress=False)  # 6 rows: 3 or 2 per replica


def _train_rank(outer_step, config, cfg, schedules) -> list[dict]:
    """Rank code: replica `rank` trains its copy with AdamW (H steps per round, its share of each
    global batch, as simulate_diloco does) and calls outer_step after each round; once per schedule."""
    rank, n, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    dataset = CharDataset("train", block_size=config.block_size)
    out = []
    for quorums in schedules:
        model = GPT(config, seed=cfg.seed).to(dev)
        opt = make_optimizer(model, cfg)
        params = list(model.parameters())
        anchor = [p.detach().clone() for p in params]
        momentum = [torch.zeros_like(p) for p in params]
        gen = torch.Generator().manual_seed(cfg.seed)
        for step in range(1, cfg.steps + 1):
            x, y = collate(dataset, sample_indices(len(dataset), cfg.batch_size, gen)[share_rows(rank, n, cfg.batch_size)])
            train_step(model, opt, x.to(dev), y.to(dev), cfg.grad_clip)
            if step % H == 0:
                outer_step(params, anchor, momentum, LR, MU, group=None, present=rank in quorums[step // H - 1])
        out.append(flat_params(model))
    return out


def replay(config, cfg, n: int, quorums) -> torch.Tensor:
    """The same rounds in one process: the replicas in turn, then torch's Nesterov SGD on the
    quorum's mean delta; theta_0 after the last round."""
    dataset = CharDataset("train", block_size=config.block_size)
    models = [GPT(config, seed=cfg.seed) for _ in range(n)]
    opts = [make_optimizer(m, cfg) for m in models]
    outer = GPT(config, seed=cfg.seed)
    outer_opt = torch.optim.SGD(outer.parameters(), lr=LR, momentum=MU, nesterov=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    for step in range(1, cfg.steps + 1):
        idx = sample_indices(len(dataset), cfg.batch_size, gen)
        for r, (m, o) in enumerate(zip(models, opts)):
            train_step(m, o, *collate(dataset, idx[share_rows(r, n, cfg.batch_size)]), cfg.grad_clip)
        if step % H:
            continue
        quorum = quorums[step // H - 1]
        with torch.no_grad():
            replicas = [list(m.parameters()) for m in models]
            for i, p0 in enumerate(outer.parameters()):
                p0.grad = sum(p0 - replicas[r][i] for r in quorum) / len(quorum)
            outer_opt.step()
            for ps in replicas:
                for p, p0 in zip(ps, outer.parameters()):
                    p.copy_(p0)
    return flat_params(outer)


def check_training(student) -> None:
    announce()
    config, cfg = train_setup()
    # param_rms_tolerance (course_lib.parallel.diloco.simulate) says why: fp32 sums in another
    # order (the all-reduce), magnified by AdamW to ~1e-4 lr and by the outer step's lr / (1 - mu)
    tol = param_rms_tolerance(cfg.lr, H, LR, MU)
    cases = {2: [[tuple(range(2))] * ROUNDS], 3: [[tuple(range(3))] * ROUNDS, [(0, 1, 2), (0, 2), (0, 1, 2)]]}
    for n, schedules in cases.items():
        runs = run_on_ranks(_train_rank, student.outer_step, config, cfg, schedules, world_size=n, **RANKS)
        for s, quorums in enumerate(schedules):
            finals = [run[s] for run in runs]
            absent = [f"replica {r} outside round {k + 1}'s quorum" for k, q in enumerate(quorums)
                      for r in range(n) if r not in q]
            label = f"{n} replicas, {ROUNDS} rounds of {H} AdamW steps" + (f", {absent[0]}" if absent else "")
            if any(not torch.equal(f, finals[0]) for f in finals):
                raise CheckFailed(f"{label}: the replicas end with different parameters: outer_step in student.py "
                                  "must leave every replica at the same theta_0")
            if absent:
                want, ref = replay(config, cfg, n, quorums), "the same rounds replayed in one process"
            else:
                want = simulate_diloco(config, cfg, n, H, LR, MU)[0].final_params
                ref = "DiLoCo computed in one process"
            rms = (finals[0] - want).pow(2).mean().sqrt().item()
            if not rms <= tol:
                raise CheckFailed(f"{label}: the parameters differ from {ref} by {rms:.3g} in RMS, more than float "
                                  f"rounding explains ({tol:.3g}): check outer_step in student.py against the "
                                  "made-up rounds above")
            passed(f"{label}: every replica equals {ref} (RMS of the difference <= {tol:.1e})")
