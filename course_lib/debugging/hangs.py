"""The catalogue's runs that hang (and the one that dies): each a rank function
`fn(fixed, bad_rank) -> dict` with the bug and its mended twin side by side, plus what the
mended twin must return (`*_expected(world, bad_rank)`, in one process).

A hang is bounded by the caller (run_bug's timeout, the torchrun demo's --timeout): the buggy
branch waits in a call another rank never makes, and the flight recorder's dumps say which.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm.process_groups import new_groups
from course_lib.dims import split_layers
from course_lib.observe.memory import SavedActivations
from course_lib.parallel.ep.dispatch import combine, dispatch, exchange_counts
from course_lib.runtime.device import rank_device

D = 4  # features of every small tensor here


# ------------------------------------------------------------------ skip_collective
def skip_collective(fixed: bool, bad_rank: int, probe_s: float | None = None) -> dict:
    """Three steps all-reduce a gradient; at step 3 bad_rank's batch was all padding, so its
    gradient is zero and it decides there is nothing to add. probe_s: a gloo monitored_barrier
    (timeout probe_s) just before the all-reduce, where a debugging session would put one:
    rank 0 then raises naming the rank that did not arrive, instead of hanging."""
    rank, sums = dist.get_rank(), []
    for step in (1, 2, 3):
        grad = torch.full((D,), float(step * (rank + 1)), device=rank_device())
        if rank == bad_rank and step == 3:
            grad.zero_()  # this rank's rows were all padding
        if fixed:
            dist.all_reduce(grad)  # the fix: every rank calls every collective, zeros included
        elif grad.any():
            if probe_s is not None:
                dist.monitored_barrier(timeout=timedelta(seconds=probe_s), wait_all_ranks=True)
            dist.all_reduce(grad)  # the bug: a rank with nothing to add skips the call
        sums.append(grad.tolist())
    return {"sums": sums}


def skip_collective_expected(world: int, bad_rank: int) -> dict:
    total = [step * sum(r + 1 for r in range(world) if not (r == bad_rank and step == 3)) for step in (1, 2, 3)]
    return {"sums": [[float(t)] * D for t in total]}


# ------------------------------------------------------------------ reorder_collectives
def reorder_collectives(fixed: bool, bad_rank: int) -> dict:
    """Two buckets synchronised with two different collectives; bad_rank walks them in the other
    order (as when hooks fire in an order that depends on the rank's own graph)."""
    rank = dist.get_rank()
    dev = rank_device()
    grads = torch.full((D,), float(rank + 1), device=dev)
    weights = torch.full((D,), 10.0 * (rank + 1), device=dev)
    dist.all_reduce(torch.zeros(1, device=dev))  # every rank starts together
    calls = [lambda: dist.all_reduce(grads), lambda: dist.broadcast(weights, src=0)]
    if not fixed and rank == bad_rank:
        calls.reverse()  # the bug: this rank's order is not the others'
    for call in calls:  # the fix: one order, the same on every rank
        call()
    return {"grads": grads.tolist(), "weights": weights.tolist()}


def reorder_collectives_expected(world: int, bad_rank: int) -> dict:
    return {"grads": [float(world * (world + 1) / 2)] * D, "weights": [10.0] * D}


# ------------------------------------------------------------------ wrong_group
def wrong_group(fixed: bool, bad_rank: int) -> dict:
    """A 2-wide tensor-parallel by data-parallel mesh: tp groups [0, 1], [2, 3], ...; dp groups
    [0, 2, ...], [1, 3, ...]. The activations are gathered over tp; bad_rank picks its dp group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = new_groups([[2 * i, 2 * i + 1] for i in range(world // 2)])  # every rank creates every group
    dp = new_groups([range(j, world, 2) for j in range(2)])
    x = torch.full((D,), float(rank), device=rank_device())
    out = [torch.empty(D, device=x.device) for _ in range(2)]
    group = tp[rank // 2]
    if not fixed and rank == bad_rank:
        group = dp[rank % 2]  # the bug: the group of the other mesh dimension
        dist.all_reduce(x, group=group)  # (and the other dimension's collective)
        return {"gathered": [x.tolist()]}
    dist.all_gather(out, x, group=group)  # the fix: the tp group, as on every rank
    return {"gathered": [t.tolist() for t in out]}


def wrong_group_expected(world: int, bad_rank: int) -> list[dict]:
    return [{"gathered": [[float(2 * (r // 2))] * D, [float(2 * (r // 2) + 1)] * D]} for r in range(world)]


# ------------------------------------------------------------------ microbatches_below_stages
def _pipe_layers(n: int) -> list[nn.Linear]:
    gen = torch.Generator().manual_seed(7)
    layers = []
    for _ in range(n):
        lin = nn.Linear(D, D)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(D, D, generator=gen) / D ** 0.5)
            lin.bias.copy_(torch.randn(D, generator=gen) * 0.1)
        layers.append(lin)
    return layers


def _pipe_batch(m: int) -> torch.Tensor:
    return torch.randn(m, 3, D, generator=torch.Generator().manual_seed(11))  # m micro-batches of 3 rows


def microbatches_below_stages(fixed: bool, bad_rank=None) -> dict:
    """A hand-written 1F1B over p stages (one Linear each) with m = p - 2 micro-batches. Rank r
    runs w = min(p - r - 1, m) warm-up forwards, then one-forward-one-backward, then drains its
    backwards. Sends are isend (never block); receives block."""
    p, r = dist.get_world_size(), dist.get_rank()
    m = max(p - 2, 1)
    dev = rank_device()
    layer = _pipe_layers(p)[r].to(dev)
    xs = _pipe_batch(m).to(dev)
    inputs, outputs, sends, loss_sum = {}, {}, [], 0.0

    def forward(j):
        nonlocal loss_sum
        x = xs[j].clone() if r == 0 else torch.empty(3, D, device=dev)
        if r > 0:
            dist.recv(x, r - 1)
        x.requires_grad_(r > 0)
        inputs[j], outputs[j] = x, torch.tanh(layer(x))

    def send_forward(j):
        if r < p - 1:
            sends.append(dist.isend(outputs[j].detach(), r + 1))

    def backward(j):
        loss = outputs[j].pow(2).mean() / m if r == p - 1 else None
        if loss is not None:
            loss.backward()
        else:
            grad = torch.empty(3, D, device=dev)
            dist.recv(grad, r + 1)  # waits for the next stage's gradient of micro-batch j
            outputs[j].backward(grad)
        if r > 0:
            sends.append(dist.isend(inputs[j].grad, r - 1))
        return float(loss.detach()) if loss is not None else 0.0

    warmup = min(p - r - 1, m)
    drain = warmup if fixed else p - r - 1  # the bug: the drain assumes m >= p (then it equals the warm-up)
    for j in range(warmup):
        forward(j)
        send_forward(j)
    for j in range(m - warmup):
        forward(warmup + j)
        loss_sum += backward(j)  # its gradient arrives before this forward's output leaves: NCCL
        send_forward(warmup + j)  # matches a pair's messages in issue order (two sends first: deadlock)
    for j in range(m - warmup, m - warmup + drain):
        loss_sum += backward(j)
    for s in sends:
        s.wait()
    return {"weight_grad": layer.weight.grad.reshape(-1).tolist(), "loss": loss_sum}


def microbatches_below_stages_expected(world: int, bad_rank=None) -> list[dict]:
    m = max(world - 2, 1)
    layers = _pipe_layers(world)
    loss = 0.0
    for x in _pipe_batch(m):
        for layer in layers:
            x = torch.tanh(layer(x))
        mb = x.pow(2).mean() / m
        mb.backward()
        loss += float(mb.detach())
    return [{"weight_grad": lin.weight.grad.reshape(-1).tolist(), "loss": loss if r == world - 1 else 0.0}
            for r, lin in enumerate(layers)]


# ------------------------------------------------------------------ zero_token_expert
def _expert(e: int) -> nn.Linear:
    torch.manual_seed(100 + e)
    return nn.Linear(D, D)


def _tokens(rank: int, world: int, bad_rank: int) -> tuple[torch.Tensor, list[int]]:
    """6 tokens per rank, routed round-robin over every expert but bad_rank's (one expert a rank)."""
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(rank))
    others = [e for e in range(world) if e != bad_rank]
    return x, [others[i % len(others)] for i in range(6)]


def zero_token_expert(fixed: bool, bad_rank: int) -> dict:
    """Expert parallelism, one expert per rank: dispatch (all-to-all), run, combine (all-to-all
    back). The router sends no token to bad_rank's expert."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, route = _tokens(rank, world, bad_rank)
    x = x.to(rank_device())
    order = sorted(range(6), key=lambda i: route[i])  # rows sorted by expert = by rank
    counts = [route.count(e) for e in range(world)]
    send, recv = exchange_counts(counts, device=x.device)
    received = dispatch(x[order], send, recv)
    if not fixed and received.shape[0] == 0:
        return {"out": None}  # the bug: "no tokens, nothing to do" skips the all-to-all back
    expert_out = _expert(rank).to(x.device)(received)  # the fix: run (on zero rows too) and always combine
    back = combine(expert_out, send, recv)
    out = torch.empty_like(x)
    out[order] = back
    return {"out": out.tolist()}


def zero_token_expert_expected(world: int, bad_rank: int) -> list[dict]:
    rows = []
    for r in range(world):
        x, route = _tokens(r, world, bad_rank)
        rows.append({"out": torch.stack([_expert(e)(x[i]) for i, e in enumerate(route)]).tolist()})
    return rows


# ------------------------------------------------------------------ uneven_oom
def _uneven_split(n_layer: int, p: int) -> list[range]:
    per = n_layer // p  # the bug: every stage n // p layers, the last one the rest as well
    starts = [s * per for s in range(p)] + [n_layer]
    return [range(starts[s], starts[s + 1]) for s in range(p)]


def uneven_oom(fixed: bool, bad_rank=None) -> dict:
    """A pipeline of n = 3p - 1 small layers under an emulated per-rank memory cap: what
    ceil(n / p) layers save for backward on one micro-batch, measured with the course's
    accounting (observe.memory.SavedActivations), and the stage's own saved bytes checked
    against it after its forward. Nothing exhausts the machine: the cap is a number."""
    p, r = dist.get_world_size(), dist.get_rank()
    n_layer = 3 * p - 1
    dev = rank_device()
    layers = [lin.to(dev) for lin in _pipe_layers(n_layer)]
    split = split_layers(n_layer, p) if fixed else _uneven_split(n_layer, p)  # the fix: the balanced split
    cap_layers = -(-n_layer // p)
    probe = nn.Sequential(*[nn.Sequential(lin, nn.Tanh()) for lin in _pipe_layers(cap_layers)])
    with SavedActivations(probe) as at_cap:
        probe(torch.zeros(3, D, requires_grad=True))
    mine = nn.Sequential(*[nn.Sequential(layers[i], nn.Tanh()) for i in split[r]])
    x = _pipe_batch(1)[0].clone().to(dev) if r == 0 else torch.empty(3, D, device=dev)
    if r > 0:
        dist.recv(x, r - 1)
    x.requires_grad_(True)
    with SavedActivations(mine) as saved:
        y = mine(x)
    if saved.bytes > at_cap.bytes:
        raise MemoryError(f"out of memory on rank {r} (emulated cap): its {len(split[r])} layers saved "
                          f"{saved.bytes} bytes of activations > the cap of {at_cap.bytes} bytes "
                          f"(what {cap_layers} layers save)")
    if r < p - 1:
        dist.send(y.detach(), r + 1)
        grad = torch.empty_like(y)
        dist.recv(grad, r + 1)
        y.backward(grad)
    else:
        y.pow(2).mean().backward()
    if r > 0:
        dist.send(x.grad, r - 1)
    return {"layers": len(split[r]), "saved_bytes": saved.bytes,
            "weight_grads": [layers[i].weight.grad.reshape(-1).tolist() for i in split[r]]}


def uneven_oom_expected(world: int, bad_rank=None) -> list[dict]:
    n_layer = 3 * world - 1
    layers = _pipe_layers(n_layer)
    x = _pipe_batch(1)[0]
    for lin in layers:
        x = torch.tanh(lin(x))
    x.pow(2).mean().backward()
    return [{"weight_grads": [layers[i].weight.grad.reshape(-1).tolist() for i in rng]}
            for rng in split_layers(n_layer, world)]
