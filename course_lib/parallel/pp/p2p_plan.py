"""The pipeline's messages in an order NCCL accepts: batches every rank issues in the same order.

NCCL matches a pair's sends and receives in issue order, ignores tags, and runs a pair's calls
one after the other, each blocking until its partner runs; only calls fused in one group
(batch_isend_irecv) progress together (course_lib/observe/nccl_rules.py). A schedule checked to
run with non-blocking sends and blocking receives can still hang there: in 1F1B rank 0 sends
activation 1 before it receives gradient 0, while rank 1 sends gradient 0 before it receives
activation 1, so each side's first call waits for the other's second.

The plan runs the schedule in rounds (every rank runs its next action once what it needs was
made in an earlier round) and puts each message into the batch of the round that made it, on
the sender and on the receiver alike. A rank issues its batches in round order: before an
action, every batch of an earlier round (so its receives are posted), and right after an action,
the batch holding what it just made. Both ends of every pair then issue the same batches in the
same order, with the messages of a batch sorted the same way, so the k-th send meets the k-th
receive and no batch waits for one issued later. Megatron-LM's 1F1B pairs "send forward, receive
backward" into one batch for the same reason (Narayanan et al. 2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist

from course_lib.parallel.pp.actions import Schedule, ScheduleError, rank_of, stage_of


@dataclass
class MessagePlan:
    """rounds[r][i]: the round of rank r's i-th action; batches[r]: [(round, [(op, key, peer)])] in
    round order, op "send"/"recv", key (kind, microbatch, stage), peer a rank of the pipeline group."""

    rounds: list[list[int]]
    batches: list[list[tuple[int, list[tuple[str, tuple, int]]]]] = field(default_factory=list)


def message_key(sched: Schedule, rank: int, act) -> tuple[tuple | None, tuple | None]:
    """(what `act` receives, what it sends), each ((kind, microbatch, stage), peer rank) or None:
    F on stage s receives ("F", j, s) from stage s-1 and sends ("F", j, s+1); B on stage s
    receives ("B", j, s+1) from stage s+1 and sends ("B", j, s). Messages within one rank (the
    turn of a V) are None: they never leave the rank."""
    p, last = sched.n_ranks, sched.n_stages - 1
    s, j = stage_of(sched.placement, p, rank, act.chunk), act.microbatch
    inn = out = None
    if act.kind == "F":
        inn = (("F", j, s), rank_of(sched.placement, p, s - 1)) if s > 0 else None
        out = (("F", j, s + 1), rank_of(sched.placement, p, s + 1)) if s < last else None
    elif act.kind == "B":
        inn = (("B", j, s + 1), rank_of(sched.placement, p, s + 1)) if s < last else None
        out = (("B", j, s), rank_of(sched.placement, p, s - 1)) if s > 0 else None
    return (inn if inn and inn[1] != rank else None), (out if out and out[1] != rank else None)


def plan_messages(sched: Schedule) -> MessagePlan:
    acts, p = sched.actions, sched.n_ranks
    rounds = [[-1] * len(a) for a in acts]
    made, messages, ptr, t = {}, [], [0] * p, 0
    while any(ptr[r] < len(acts[r]) for r in range(p)):
        run = [r for r in range(p) if ptr[r] < len(acts[r])
               and (message_key(sched, r, acts[r][ptr[r]])[0] is None
                    or made.get(message_key(sched, r, acts[r][ptr[r]])[0][0], t) < t)]
        if not run:
            raise ScheduleError(f"the schedule {sched.name!r} deadlocks (ranks wait at actions "
                                f"{[str(acts[r][ptr[r]]) if ptr[r] < len(acts[r]) else '-' for r in range(p)]})")
        for r in run:
            out = message_key(sched, r, acts[r][ptr[r]])[1]
            if out is not None:
                made[out[0]] = t
                messages.append((t, out[0], r, out[1]))
            rounds[r][ptr[r]] = t
            ptr[r] += 1
        t += 1
    per_rank = [{} for _ in range(p)]
    for t, key, src, dst in sorted(messages):
        per_rank[src].setdefault(t, []).append(("send", key, dst))
        per_rank[dst].setdefault(t, []).append(("recv", key, src))
    return MessagePlan(rounds, [sorted(b.items()) for b in per_rank])


class Mailbox:
    """One rank's side of a MessagePlan: put() what an action made, issue() the batches up to a
    round, get() a received tensor (waits for its batch), finish() at the end."""

    def __init__(self, plan: MessagePlan, rank: int, group, make_buffer):
        self.rounds, self.batches, self.next = plan.rounds[rank], plan.batches[rank], 0
        self.group, self.make_buffer = group, make_buffer
        self.outbox, self.inbox, self.sent = {}, {}, []

    def put(self, key, tensor) -> None:
        self.outbox[key] = tensor.detach().contiguous()

    def pending_round(self) -> float:
        """The round of the next batch not issued yet (inf when all are)."""
        return self.batches[self.next][0] if self.next < len(self.batches) else math.inf

    def issue(self, until: float) -> None:
        """Issue every batch of a round before `until`, in round order."""
        while self.pending_round() < until:
            ops, recvs, keep = [], [], []
            for op, key, peer in self.batches[self.next][1]:
                peer = dist.get_global_rank(self.group, peer) if self.group is not None else peer
                if op == "send":
                    keep.append(self.outbox.pop(key))
                    ops.append(dist.P2POp(dist.isend, keep[-1], peer, self.group))
                else:
                    recvs.append((key, self.make_buffer()))
                    ops.append(dist.P2POp(dist.irecv, recvs[-1][1], peer, self.group))
            batch = _Batch(dist.batch_isend_irecv(ops), keep)
            self.inbox.update({key: (batch, buf) for key, buf in recvs})
            self.sent.append(batch)
            self.next += 1

    def get(self, key):
        batch, buf = self.inbox.pop(key)
        batch.wait()
        return buf

    def finish(self) -> None:
        self.issue(math.inf)
        for batch in self.sent:
            batch.wait()
        self.sent.clear()


class _Batch:
    """The works of one batch_isend_irecv, waited once (a gloo receive's work must not be
    waited twice), and the tensors it sends, alive until then."""

    def __init__(self, works, tensors):
        self.works, self.tensors = works, tensors

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.tensors = [], []
