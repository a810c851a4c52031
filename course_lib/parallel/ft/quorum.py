"""What every fault-tolerant replica loop shares (replicas.py's data parallelism, local.py's
DiLoCo): the result a process returns, the quorum over the store, the mean over a quorum by
point-to-point, and healing a joiner from a healthy peer (replicas.py's docstring says why by
hand, and what torchft does instead).

    decide_quorum(store, t, expected, R, timeout_s)   one quorum per step, whoever writes it
    read_quorum(store, t)                             a joiner's: wait for the quorum the others decide
    quorum_mean(flat, quorum, slot)                   the quorum's mean through its lowest slot
    heal(get, put, quorum, last, slot, t, res, joining)  the joiners receive one flat state
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.parallel.ft.replay import mean_in_slot_order

POLL_S = 0.005


@dataclass
class ReplicaResult:
    """What one process returns: its slot, the steps it completed with their quorums ({t: {slot:
    process rank}}: every step for data parallelism, the sync steps for DiLoCo) and its losses,
    its final parameters; for healing, the flat state it received (before: what it held just
    before) or sent, keyed by step."""

    slot: int
    rank: int
    quorums: dict
    losses: dict
    final_params: torch.Tensor
    received: dict
    before_heal: dict
    sent: dict


def decide_quorum(store, t: int, expected: dict[int, int], replicas: int, timeout_s: float) -> dict[int, int]:
    """Wait (at most timeout_s) until every slot s of `expected` (the last quorum, {slot: process
    rank}) has written alive/t/<s> or its process is known to have ended (ended/<rank>, written
    by the process's parent as torchft's lighthouse learns a death from missed heartbeats: no
    one waits out the timeout for a process that is gone), then propose every slot announced
    for t; the first proposal wins (compare_set), every caller returns it. The timeout bounds
    the wait for a replica that is alive but late."""
    deadline = time.monotonic() + timeout_s
    while not all(store.check([f"alive/{t}/{s}"]) or store.check([f"ended/{r}"]) for s, r in expected.items()) \
            and time.monotonic() < deadline:
        time.sleep(POLL_S)
    present = {s: int(store.get(f"alive/{t}/{s}")) for s in range(replicas) if store.check([f"alive/{t}/{s}"])}
    won = store.compare_set(f"quorum/{t}", "", json.dumps(present))
    return {int(s): r for s, r in json.loads(won).items()}


def read_quorum(store, t: int) -> dict[int, int]:
    """Step t's quorum as the live replicas decided it (a joiner waits for it)."""
    store.wait([f"quorum/{t}"], timedelta(seconds=600))
    return {int(s): r for s, r in json.loads(store.get(f"quorum/{t}")).items()}


def join_quorum(store, t: int, slot: int, rank: int, last, replicas: int, timeout_s: float,
                joining: bool) -> dict[int, int]:
    """Step t's quorum as seen by replica `slot` (process `rank`): a joiner waits for the one the live
    replicas decide; a live replica announces itself, then decides. A live replica left out (it was
    later than timeout_s) raises: this small version does not heal a fenced replica."""
    if joining:
        quorum = read_quorum(store, t)
    else:
        store.set(f"alive/{t}/{slot}", str(rank))
        quorum = decide_quorum(store, t, last, replicas, timeout_s)
    if quorum.get(slot) != rank:
        raise RuntimeError(f"replica {slot} (rank {rank}) is not in step {t}'s quorum {quorum}: it was later "
                           f"than quorum_timeout_s={timeout_s}")
    return quorum


def quorum_mean(flat: torch.Tensor, quorum: dict[int, int], slot: int) -> torch.Tensor:
    """The mean of the quorum's tensors, through the leader (its lowest slot), point-to-point."""
    slots = sorted(quorum)
    leader = quorum[slots[0]]
    if slot != slots[0]:
        dist.send(flat, leader)
        mean = torch.empty_like(flat)
        dist.recv(mean, leader)
        return mean
    parts = [flat]
    for s in slots[1:]:
        g = torch.empty_like(flat)
        dist.recv(g, quorum[s])
        parts.append(g)
    mean = mean_in_slot_order(parts)
    for s in slots[1:]:
        dist.send(mean, quorum[s])
    return mean


def stayed_and_joiners(quorum: dict[int, int], last: dict[int, int]) -> tuple[list[int], list[int]]:
    """The slots of the quorum on the same process as in the last one, and the others (joiners)."""
    return (sorted(s for s in quorum if last.get(s) == quorum[s]),
            sorted(s for s in quorum if last.get(s) != quorum[s]))


def heal(get, put, quorum, last, slot, t, res: ReplicaResult, joining: bool) -> None:
    """Each joiner (in quorum, not in the last one, or the same slot on a new process) receives
    the whole state (get(): one flat tensor; put(flat) loads it) from the lowest slot that stayed."""
    stayed, joiners = stayed_and_joiners(quorum, last)
    for j in joiners:
        if slot == j and joining:
            res.before_heal[t] = get()
            buf = torch.empty_like(res.before_heal[t])
            dist.recv(buf, quorum[stayed[0]])
            put(buf)
            res.received[t] = get()
        elif slot == stayed[0]:
            res.sent[t] = get()
            dist.send(res.sent[t], quorum[j])
