"""DiLoCo inside fault-tolerant replica groups: the quorum is taken at the syncs only.

Each replica (one process, replicas.py's world and store) takes an AdamW step on its own rows at
every step, with no communication; after every H-th step (t % H == 0) it announces itself and
the quorum of the sync is decided as replicas.py decides a step's (quorum.decide_quorum). The
replicas that were in the last sync's quorum give their deltas Delta_s = theta_0 - theta_s,
averaged over them through the lowest slot (quorum.quorum_mean), and take the outer Nesterov
step (parallel.diloco.outer.NesterovOuter; Douillard et al. 2023, Alg. 1), which sets every
replica to the new theta_0. A replica killed between syncs (at the start of kill_step) loses its
inner steps since the last sync; the others keep training without waiting, and their next sync
averages over the survivors only. A joiner (the spare, replicas.py's simplification) enters at
a sync (rejoin_step, a multiple of H): it gives no delta, and after the outer step the lowest
slot that stayed sends it parameters, AdamW state, theta_0 and the momentum b in one flat
tensor; from the next step it trains on the killed replica's rows. The reference is
replay.replay_diloco: the same data and the same quorum sequence in one process.
"""

from __future__ import annotations

import torch

from course_lib.parallel.diloco.outer import NesterovOuter
from course_lib.parallel.ft.quorum import ReplicaResult, heal, join_quorum, quorum_mean, stayed_and_joiners
from course_lib.parallel.ft.replay import FtConfig, build, flat_params, flat_state, load_flat_state, local_gradient
from course_lib.platform import kill_self_hard


def outer_state(model, optimizer, outer: NesterovOuter) -> torch.Tensor:
    """What a joiner receives: parameters and AdamW state (replay.flat_state), then theta_0 and b."""
    return torch.cat([flat_state(model, optimizer)] + [t.reshape(-1) for t in outer.anchor + outer.buf])


@torch.no_grad()
def load_outer_state(model, optimizer, outer: NesterovOuter, flat: torch.Tensor) -> None:
    n = flat_state(model, optimizer).numel()
    load_flat_state(model, optimizer, flat[:n])
    at = n
    for t in outer.anchor + outer.buf:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


def diloco_replica(cfg: FtConfig, store, rank: int) -> ReplicaResult:
    """Rank code: one DiLoCo replica (or the spare, rank R) for the whole run."""
    spare = rank == cfg.replicas
    slot = cfg.kill_slot if spare else rank
    model, optimizer = build(cfg, cfg.seed + 1 if spare else cfg.seed)  # the spare's state is not the run's
    outer = NesterovOuter(model.parameters(), cfg.outer_lr, cfg.outer_momentum)
    res = ReplicaResult(slot, rank, {}, {}, torch.empty(0), {}, {}, {})
    first = cfg.rejoin_step if spare else 1
    if spare:
        store.set(f"alive/{first}/{slot}", str(rank))  # announce: ready to join at the sync rejoin_step
    last = {s: s for s in range(cfg.replicas)}  # the quorum before step 1: everyone
    for t in range(first, cfg.steps + 1):
        if not spare and slot == cfg.kill_slot and t == cfg.kill_step:
            kill_self_hard()
        joining = spare and t == first
        if not joining:  # an inner step: no communication
            res.losses[t], _ = local_gradient(model, cfg, t, slot)
            optimizer.step()
        if t % cfg.inner_steps:
            continue
        quorum = join_quorum(store, t, slot, rank, last, cfg.replicas, cfg.quorum_timeout_s, joining)
        stayed, _ = stayed_and_joiners(quorum, last)
        if slot in stayed:
            delta = torch.cat([d.reshape(-1) for d in outer.deltas()])
            mean = quorum_mean(delta, {s: quorum[s] for s in stayed}, slot)
            outer.step(m.view_as(p) for m, p in zip(torch.split(mean, [p.numel() for p in outer.params]),
                                                      outer.params))
        heal(lambda: outer_state(model, optimizer, outer),
             lambda flat: load_outer_state(model, optimizer, outer, flat), quorum, last, slot, t, res, joining)
        res.quorums[t], last = dict(quorum), quorum
    res.final_params = flat_params(model)
    return res
