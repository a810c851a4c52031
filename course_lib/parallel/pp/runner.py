"""Run a schedule (course_lib.parallel.pp.schedules) on real ranks, with real send/recv.

    plan = plan_pipeline("1f1b", n_ranks=4, virtual_stages=1, n_microbatches=8)  # once, at set-up
    loss = run_schedule(stage, idx, targets, plan, n_microbatches=8)             # every step

Three parts, each its own module: the plan (a validated Schedule and its messages in the
batches of p2p_plan.plan_messages, built once per run: PipelinePlan), the executor (here: a
rank's actions in order), and the accounting (accounting.StepAccounting: saved bytes, timeline,
padding), an observer the executor calls around each action. A name or a Schedule is accepted
too: run_schedule then plans it on the call (validated each time; a training loop plans once).

The batch is cut into m equal micro-batches. For each action of this rank, in order:

    F(j, c)  stage s = c*p + rank (V placement: rank, 2p-1-rank): receive the activation from stage s-1
             (stage 0 embeds idx_j),
             run the chunk, send the output to stage s+1; the last stage computes
             L_j = cross_entropy(logits_j, targets_j) and keeps L_j / m for its backward.
    B(j, c)  receive dL/d(output) from stage s+1 (the last stage starts from L_j / m), back-propagate
             through the chunk and send dL/d(input) to stage s-1.
    W(j, c)  zero-bubble schedules only: B computed input gradients only, and every Linear
             stashed (x, dy); W now adds dW = dy^T x and db = sum(dy) to the .grad of its weights
             (deferred.py).

Since the mean loss is L = (1/m) sum_j L_j, the accumulated .grad is dL/dtheta: the single-process
gradient of the whole batch's mean loss. Messages go in the plan's batches, which every rank
issues in the same order (NCCL matches a pair's messages in issue order and ignores tags): a rank
posts its receives as soon as their sender's round has passed, so a message can land while it
still computes, and an action waits only for what has not arrived yet.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib._validate import check_int
from course_lib.parallel.pp.accounting import StepAccounting
from course_lib.parallel.pp.deferred import apply_weight_grads, deferred_weight_grads
from course_lib.parallel.pp.p2p_plan import Mailbox, MessagePlan, plan_messages
from course_lib.parallel.pp.schedules import Schedule, check_schedule, make_schedule


def _check_batch(n_microbatches, batch_size: int) -> None:
    check_int("n_microbatches", n_microbatches, rule="an int >= 1")
    if batch_size % n_microbatches:
        raise ValueError(f"batch size {batch_size} must be divisible by n_microbatches={n_microbatches}")


def _check_shape(sched: Schedule, n_ranks: int, virtual_stages: int, n_microbatches: int) -> None:
    got = (sched.n_ranks, sched.virtual_stages, sched.n_microbatches)
    if got != (n_ranks, virtual_stages, n_microbatches):
        raise ValueError(f"the schedule is for (ranks, virtual_stages, microbatches)={got}, the run has "
                         f"{(n_ranks, virtual_stages, n_microbatches)}")


def validate_run(schedule, n_ranks: int, virtual_stages: int, n_microbatches: int, batch_size: int) -> Schedule:
    """The Schedule to run, or ValueError: the same rules in the parent and on every rank."""
    _check_batch(n_microbatches, batch_size)
    if isinstance(schedule, PipelinePlan):
        schedule = schedule.schedule  # validated when it was planned
        _check_shape(schedule, n_ranks, virtual_stages, n_microbatches)
        return schedule
    if isinstance(schedule, Schedule):
        _check_shape(schedule, n_ranks, virtual_stages, n_microbatches)
        return check_schedule(schedule)
    return make_schedule(schedule, n_ranks, n_microbatches, virtual_stages)


@dataclass(frozen=True)
class PipelinePlan:
    """A validated Schedule and its messages (p2p_plan.MessagePlan, every rank's side): what
    run_schedule needs besides the batch, built once per run by plan_pipeline."""

    schedule: Schedule
    messages: MessagePlan

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def placement(self) -> str:
        return self.schedule.placement

    @property
    def split_backward(self) -> bool:
        return self.schedule.split_backward


def plan_pipeline(schedule, n_ranks: int, virtual_stages: int, n_microbatches: int,
                  batch_size: int | None = None) -> PipelinePlan:
    """Validate `schedule` (a name of schedules.SCHEDULES, a Schedule, or a PipelinePlan, returned
    as it is when its shape fits) and plan its messages. batch_size: also checked to split into
    n_microbatches."""
    if isinstance(schedule, PipelinePlan):
        _check_shape(schedule.schedule, n_ranks, virtual_stages, n_microbatches)
        return schedule
    sched = validate_run(schedule, n_ranks, virtual_stages, n_microbatches,
                         n_microbatches if batch_size is None else batch_size)
    return PipelinePlan(sched, plan_messages(sched))


def run_schedule(stage, idx: torch.Tensor, targets: torch.Tensor, schedule, n_microbatches: int, *,
                 timeline=None, action_seconds: dict | None = None) -> float:
    """Run one forward+backward of the batch through the pipeline; returns the mean loss (every
    rank). schedule: a PipelinePlan (plan_pipeline, built once), or a name of schedules.SCHEDULES
    or a Schedule (planned on this call). timeline: a Timeline that gets every F/B/W, send and
    receive. action_seconds: {"F": s, "B": s, "W": s} added (as sleep) to every action of a whole
    micro-batch, to make a tiny model behave like a big one on a crowded CPU. After the call
    stage.last_peak_activation_bytes holds this rank's peak."""
    _check_batch(n_microbatches, idx.shape[0])
    plan = plan_pipeline(schedule, stage.n_ranks, stage.virtual_stages, n_microbatches)
    if plan.placement != getattr(stage, "placement", "loop"):
        raise ValueError(f"schedule {plan.name!r} places its stages {plan.placement!r}, the stage was built "
                         f"with placement {getattr(stage, 'placement', 'loop')!r} (build_stage(..., placement=...))")
    acc = StepAccounting(stage, timeline, action_seconds, plan.split_backward)
    losses = _execute(stage, plan, idx, targets, acc)
    stage.last_peak_activation_bytes = acc.peak
    stage.sum_tied_gradients()
    # The last stage holds the losses; every rank returns their mean.
    mean = torch.stack(losses).mean() if losses else torch.zeros((), device=idx.device)
    dist.broadcast(mean, stage.global_rank_of_stage(stage.n_stages - 1), group=stage.group)
    return float(mean)


def _stage_loss(stage, out, targets):
    if getattr(stage, "loss_fn", None) is not None:  # e.g. a tensor-parallel head
        return stage.loss_fn(out, targets)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _execute(stage, plan: PipelinePlan, idx, targets, acc: StepAccounting) -> list:
    """The executor: this rank's actions of plan in order, with their messages; returns the
    micro-batch losses (the last stage's, else [])."""
    sched, m, last = plan.schedule, plan.schedule.n_microbatches, stage.n_stages - 1
    # Own storage per micro-batch (as a loader would give them), so saved bytes count only it.
    idx_mb, tgt_mb = [t.clone() for t in idx.chunk(m)], [t.clone() for t in targets.chunk(m)]
    mb, T = idx_mb[0].shape
    d_model = stage.chunks[0].blocks[0].ln1.normalized_shape[0]
    dtype = next(stage.parameters()).dtype
    tokens = T // getattr(stage, "sequence_shards", 1)  # sequence parallelism: the tp rank's T/tp
    box = Mailbox(plan.messages, stage.rank, stage.group,
                  lambda: torch.empty(mb, tokens, d_model, dtype=dtype, device=idx.device))
    inputs, outputs, sinks, losses, local = {}, {}, {}, [], {}
    current = {"sink": None}

    # Messages are keyed (kind, micro-batch, stage): ("F", j, s) the activation entering stage s,
    # ("B", j, s) the gradient leaving stage s.
    def send(t, s_to, key, label, i):
        if stage.global_rank_of_stage(s_to) == dist.get_rank():
            local[key] = t.detach().clone()
            return
        box.put(key, t)
        with acc.comm(label):
            box.issue(box.rounds[i] + 1)  # the batch of this round: what this action made

    def recv(key, label):
        if key in local:
            return local.pop(key)
        with acc.comm(label):
            return box.get(key)

    split = deferred_weight_grads(stage, current) if sched.split_backward else contextlib.nullcontext()
    with split:
        for i, act in enumerate(sched.actions[stage.rank]):
            box.issue(box.rounds[i])  # every batch of an earlier round: this action's receive is posted
            j, c = act.microbatch, act.chunk
            s, name = stage.stage_of(c), str(act)
            if act.kind == "F":
                x = idx_mb[j] if s == 0 else recv(("F", j, s), f"recv {name}").requires_grad_()
                current["sink"] = sinks[(j, c)] = []
                with acc.forward((j, c), name):
                    out = stage.chunks[c](x)
                    if s == last:
                        loss = _stage_loss(stage, out, tgt_mb[j])
                        losses.append(loss.detach())
                        out = loss / m
                inputs[(j, c)], outputs[(j, c)] = x, out
                if s != last:
                    send(out, s + 1, ("F", j, s + 1), f"send {name}", i)
            elif act.kind == "B":
                dy = None if s == last else recv(("B", j, s + 1), f"recv {name}")
                with acc.backward((j, c), name, sinks[(j, c)] if sched.split_backward else None):
                    torch.autograd.backward(outputs.pop((j, c)), dy)
                x = inputs.pop((j, c))
                if s != 0:
                    send(x.grad, s - 1, ("B", j, s), f"send {name}", i)
            else:
                sink = sinks.pop((j, c))
                with acc.weight(name, sink):
                    apply_weight_grads(sink)
            acc.done()
    box.finish()
    return losses
