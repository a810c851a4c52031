"""Run a schedule (course_lib.parallel.pp.schedules) on real ranks, with real send/recv.

    loss = run_schedule(stage, idx, targets, "1f1b", n_microbatches=8)

The batch is cut into m equal micro-batches. For each action of this rank, in order:

    F(j, c)  stage s = c*p + rank (V placement: rank, 2p-1-rank): receive the activation from stage s-1
             (stage 0 embeds idx_j),
             run the chunk, send the output to stage s+1; the last stage computes
             L_j = cross_entropy(logits_j, targets_j) and keeps L_j / m for its backward.
    B(j, c)  receive dL/d(output) from stage s+1 (the last stage starts from L_j / m), back-propagate
             through the chunk and send dL/d(input) to stage s-1.
    W(j, c)  zero-bubble schedules only: B computed input gradients only, and every Linear
             stashed (x, dy); W now adds dW = dy^T x and db = sum(dy) to the .grad of its weights.

Since the mean loss is L = (1/m) sum_j L_j, the accumulated .grad is dL/dtheta: the single-process
gradient of the whole batch's mean loss. Messages go in the batches of
p2p_plan.plan_messages, which every rank issues in the same order (NCCL matches a pair's messages
in issue order and ignores tags): a rank posts its receives as soon as their sender's round has
passed, so a message can land while it still computes, and an action waits only for what has not
arrived yet.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel.pp.p2p_plan import Mailbox, plan_messages
from course_lib.parallel.pp.schedules import Schedule, check_schedule, make_schedule

CATEGORY = {"F": "forward", "B": "backward", "W": "weight-grad"}


class _LinearInputGradOnly(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dy W (the input gradient) and stashes (x, dy)
    in `sink` for the weight gradient, computed later by the W action."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x)
        # The parameters themselves, not saved copies: W sets their .grad.
        ctx.weight, ctx.bias, ctx.sink = weight, bias, sink
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        ctx.sink.append((ctx.weight, ctx.bias, x, dy.clone()))  # autograd may reuse dy's buffer in place
        return dy @ ctx.weight, None, None, None


def _apply_weight_grads(sink: list) -> None:
    """dW += dy^T x and db += sum of dy over all rows, for every stashed Linear call."""
    for weight, bias, x, dy in sink:
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        gw = dy2.t() @ x2
        weight.grad = gw if weight.grad is None else weight.grad.add_(gw)
        if bias is not None:
            gb = dy2.sum(0)
            bias.grad = gb if bias.grad is None else bias.grad.add_(gb)
    sink.clear()


@contextlib.contextmanager
def _deferred_weight_grads(stage: nn.Module, current: dict):
    """While active, every nn.Linear of the stage computes through _LinearInputGradOnly,
    stashing into current["sink"] (set by the runner before each forward)."""
    linears = [m for m in stage.modules() if isinstance(m, nn.Linear)]
    for lin in linears:
        lin.forward = (lambda lin: lambda x: _LinearInputGradOnly.apply(x, lin.weight, lin.bias, current["sink"]))(lin)
    try:
        yield
    finally:
        for lin in linears:
            del lin.forward  # back to the class's forward


def _storage_bytes(tensors, exclude: set) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in exclude:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def validate_run(schedule, n_ranks: int, virtual_stages: int, n_microbatches: int, batch_size: int) -> Schedule:
    """The Schedule to run, or ValueError: the same rules in the parent and on every rank."""
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches!r} must be an int >= 1")
    if batch_size % n_microbatches:
        raise ValueError(f"batch size {batch_size} must be divisible by n_microbatches={n_microbatches}")
    if isinstance(schedule, Schedule):
        got = (schedule.n_ranks, schedule.virtual_stages, schedule.n_microbatches)
        if got != (n_ranks, virtual_stages, n_microbatches):
            raise ValueError(f"the schedule is for (ranks, virtual_stages, microbatches)={got}, the run has "
                             f"{(n_ranks, virtual_stages, n_microbatches)}")
        return check_schedule(schedule)
    return make_schedule(schedule, n_ranks, n_microbatches, virtual_stages)


def run_schedule(stage, idx: torch.Tensor, targets: torch.Tensor, schedule, n_microbatches: int, *,
                 timeline=None, action_seconds: dict | None = None) -> float:
    """Run one forward+backward of the batch through the pipeline; returns the mean loss (every
    rank). schedule: a name of schedules.SCHEDULES or a Schedule. timeline: a Timeline that
    gets every F/B/W, send and receive. action_seconds: {"F": s, "B": s, "W": s} added (as sleep)
    to every action of a whole micro-batch, to make a tiny model behave like a big one on a
    crowded CPU. After the call stage.last_peak_activation_bytes holds this rank's peak."""
    p, v, m = stage.n_ranks, stage.virtual_stages, n_microbatches
    sched = validate_run(schedule, p, v, m, idx.shape[0])
    if sched.placement != getattr(stage, "placement", "loop"):
        raise ValueError(f"schedule {sched.name!r} places its stages {sched.placement!r}, the stage was built "
                         f"with placement {getattr(stage, 'placement', 'loop')!r} (build_stage(..., placement=...))")
    last = stage.n_stages - 1
    pad = {k: 0.0 for k in "FBW"} | dict(action_seconds or {})
    if not sched.split_backward:
        pad["B"] += pad["W"]
    span = timeline.span if timeline is not None else (lambda *a: contextlib.nullcontext())
    # Own storage per micro-batch (as a loader would give them), so saved bytes count only it.
    idx_mb, tgt_mb = [t.clone() for t in idx.chunk(m)], [t.clone() for t in targets.chunk(m)]
    mb, T = idx_mb[0].shape
    d_model = stage.chunks[0].blocks[0].ln1.normalized_shape[0]
    dtype = next(stage.parameters()).dtype
    params = {p_.untyped_storage().data_ptr() for p_ in stage.parameters()}
    inputs, outputs, graph_bytes, sinks, losses = {}, {}, {}, {}, []
    local = {}
    live = peak = 0
    current = {"sink": None}
    tokens = T // getattr(stage, "sequence_shards", 1)  # sequence parallelism: the tp rank's T/tp
    box = Mailbox(plan_messages(sched), stage.rank, stage.group,
                  lambda: torch.empty(mb, tokens, d_model, dtype=dtype, device=idx.device))

    # Messages are keyed (kind, micro-batch, stage): ("F", j, s) the activation entering stage s,
    # ("B", j, s) the gradient leaving stage s.
    def send(t, s_to, key, label, i):
        if stage.global_rank_of_stage(s_to) == dist.get_rank():
            local[key] = t.detach().clone()
            return
        box.put(key, t)
        with span(label, "comm"):
            box.issue(box.rounds[i] + 1)  # the batch of this round: what this action made

    def recv(key, label):
        if key in local:
            return local.pop(key)
        with span(label, "comm"):
            return box.get(key)

    split = _deferred_weight_grads(stage, current) if sched.split_backward else contextlib.nullcontext()
    with split:
        for i, act in enumerate(sched.actions[stage.rank]):
            box.issue(box.rounds[i])  # every batch of an earlier round: this action's receive is posted
            j, c = act.microbatch, act.chunk
            s, name = stage.stage_of(c), str(act)
            if act.kind == "F":
                x = idx_mb[j] if s == 0 else recv(("F", j, s), f"recv {name}").requires_grad_()
                saved = []
                current["sink"] = sinks[(j, c)] = []
                with span(name, CATEGORY["F"]), torch.autograd.graph.saved_tensors_hooks(
                        lambda t: saved.append(t) or t, lambda t: t):
                    out = stage.chunks[c](x)
                    if s == last:
                        if getattr(stage, "loss_fn", None) is not None:  # e.g. a tensor-parallel head
                            loss = stage.loss_fn(out, tgt_mb[j])
                        else:
                            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt_mb[j].reshape(-1))
                        losses.append(loss.detach())
                        out = loss / m
                    time.sleep(pad["F"] / v)
                graph_bytes[(j, c)] = _storage_bytes(saved, params)
                del saved
                live += graph_bytes[(j, c)]
                inputs[(j, c)], outputs[(j, c)] = x, out
                if s != last:
                    send(out, s + 1, ("F", j, s + 1), f"send {name}", i)
            elif act.kind == "B":
                dy = None if s == last else recv(("B", j, s + 1), f"recv {name}")
                with span(name, CATEGORY["B"]):
                    torch.autograd.backward(outputs.pop((j, c)), dy)
                    time.sleep(pad["B"] / v)
                x = inputs.pop((j, c))
                live -= graph_bytes.pop((j, c))
                if sched.split_backward:
                    live += _storage_bytes((t for w in sinks[(j, c)] for t in w[2:]), params)
                if s != 0:
                    send(x.grad, s - 1, ("B", j, s), f"send {name}", i)
            else:
                sink = sinks.pop((j, c))
                live -= _storage_bytes((t for w in sink for t in w[2:]), params)
                with span(name, CATEGORY["W"]):
                    _apply_weight_grads(sink)
                    time.sleep(pad["W"] / v)
            peak = max(peak, live)
    box.finish()
    stage.last_peak_activation_bytes = peak
    stage.sum_tied_gradients()
    # The last stage holds the losses; every rank returns their mean.
    mean = torch.stack(losses).mean() if losses else torch.zeros((), device=idx.device)
    dist.broadcast(mean, stage.global_rank_of_stage(last), group=stage.group)
    return float(mean)
