"""The catalogue's runs that finish with wrong numbers, or right numbers at the wrong cost: each
a rank function `fn(fixed, bad_rank) -> dict` with the bug and its mended twin side by side,
and the single process it must equal (`reference_*(world, bad_rank)`).

Most train the same tiny regression model (8 -> 16 -> 1, tanh, mean squared error) with SGD
for STEPS steps on a global batch of B rows that every rank and the reference draw alike; a
rank keeps its 1/N share (`share_rows`). With equal shares the mean of the ranks' losses is the
whole batch's loss, and the mean of their gradients its gradient: a correct run equals the
single process up to the order of its sums. Each step records the loss (the mean over ranks),
the gradient norm and a checksum of the gradient (replicas must agree bitwise).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.comm.autograd import reduce_from_group
from course_lib.loop import share_rows
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.device import rank_device

B, D_IN, HIDDEN, STEPS, LR, ACCUM = 48, 8, 16, 3, 0.1, 2


def tiny_model() -> nn.Module:
    """The same weights in every process: initialised from a fixed seed."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, D_IN, generator=gen)
    return x, torch.sin(x.sum(1, keepdim=True))


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def checksum(t: torch.Tensor) -> str:
    """8 hex digits of the tensor's bytes: equal exactly when the tensors are bitwise equal
    (up to a hash collision, about 1 in 4e9)."""
    return hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:8]


def train(body, steps: int = STEPS) -> dict:
    """SGD(LR) on tiny_model for `steps` steps; body(model, x, y) back-propagates (and syncs) one
    step's gradient and returns the loss to record. Model and batches on the rank's device."""
    dev = rank_device()
    model = tiny_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"losses": [], "grad_norms": [], "checksums": []}
    for step in range(1, steps + 1):
        x, y = (t.to(dev) for t in global_batch(step))
        opt.zero_grad(set_to_none=False)
        out["losses"].append(value(body(model, x, y)))
        g = flat_grad(model)
        out["grad_norms"].append(float(g.norm()))
        out["checksums"].append(checksum(g))
        opt.step()
    return out


def value(v) -> float:
    """A loss as a Python float (detached first: it may still hold its graph)."""
    return float(v.detach()) if torch.is_tensor(v) else float(v)


def mse(model, x, y) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def mean_over_ranks(loss) -> float:
    t = torch.tensor([value(loss)], device=rank_device())
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def average_gradients(model: nn.Module) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def reference(world: int, bad_rank=None) -> dict:
    """The single process on the whole batch."""
    def body(model, x, y):
        loss = mse(model, x, y)
        loss.backward()
        return loss
    return train(body)


# ------------------------------------------------------------------ sum_not_avg
def sum_not_avg(fixed: bool, bad_rank=None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = share_rows(rank, world, B)

    def body(model, x, y):
        loss = mse(model, x[rows], y[rows])
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # SUM, the default op (gloo has no ReduceOp.AVG)
            if fixed:  # the bug: stopping at the sum
                p.grad /= world  # the fix: the mean of the ranks' gradients
        return mean_over_ranks(loss)
    return train(body)


# ------------------------------------------------------------------ never_sync / sync_every_microbatch
def _accumulating(is_sync_step) -> dict:
    """ACCUM micro-batches per step; the gradients are averaged after micro-batch j when
    is_sync_step(j). The all_reduce calls of the whole run are counted (CommTracer)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = share_rows(rank, world, B)

    def body(model, x, y):
        total = 0.0
        for j, (xm, ym) in enumerate(zip(x[rows].chunk(ACCUM), y[rows].chunk(ACCUM))):
            loss = mse(model, xm, ym) / ACCUM
            loss.backward()
            total += value(loss)
            if is_sync_step(j):
                average_gradients(model)
        return mean_over_ranks(total)
    with CommTracer() as tracer:
        out = train(body)
    out["all_reduce_calls"] = tracer.summary()["all_reduce"]["calls"]
    return out


def never_sync(fixed: bool, bad_rank=None) -> dict:
    if fixed:
        return _accumulating(lambda j: j == ACCUM - 1)  # the fix: after the last micro-batch
    return _accumulating(lambda j: j == ACCUM)  # the bug: j runs to ACCUM - 1, so never


def sync_every_microbatch(fixed: bool, bad_rank=None) -> dict:
    if fixed:
        return _accumulating(lambda j: j == ACCUM - 1)  # the fix: once, after the last micro-batch
    return _accumulating(lambda j: True)  # the bug: after every micro-batch (right numbers, ACCUM x the traffic)


# ------------------------------------------------------------------ overlapping_shards
def overlapping_shards(fixed: bool, bad_rank=None) -> dict:
    """Ranks are laid out on nodes of world // 2; each picks its shard of the batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = max(world // 2, 1)
    index = rank if fixed else rank % per_node  # the bug: the local rank (LOCAL_RANK) where RANK is meant
    rows = share_rows(index, world, B)

    def body(model, x, y):
        loss = mse(model, x[rows], y[rows])
        loss.backward()
        average_gradients(model)
        return mean_over_ranks(loss)
    return train(body) | {"rows": [rows.start, rows.stop]}


# ------------------------------------------------------------------ nan_on_one_rank
def valid_rows(world: int, bad_rank: int) -> torch.Tensor:
    """1 for a real row, 0 for padding: bad_rank's whole share is padding."""
    mask = torch.ones(B)
    mask[share_rows(bad_rank, world, B)] = 0
    return mask


def nan_on_one_rank(fixed: bool, bad_rank: int) -> dict:
    """The loss is the mean squared error over the real rows only (a mask)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = share_rows(rank, world, B)
    mask = valid_rows(world, bad_rank)[rows].to(rank_device())
    finite = []

    def body(model, x, y):
        err = (model(x[rows]) - y[rows]).pow(2).squeeze(1)
        n_valid = torch.tensor([float(mask.sum())], device=rank_device())
        dist.all_reduce(n_valid)  # real rows over every rank
        if fixed:
            loss = (err * mask).sum() / n_valid * world  # the fix: divide by the count over every rank
        else:
            loss = (err * mask).sum() / mask.sum()  # the bug: this rank's count, 0 on bad_rank: 0/0 = NaN
        loss.backward()
        finite.append(bool(flat_grad(model).isfinite().all()))  # before the all-reduce spreads it
        average_gradients(model)
        return mean_over_ranks(loss)
    return train(body) | {"finite_before_sync": finite}


def reference_masked(world: int, bad_rank: int) -> dict:
    mask = valid_rows(world, bad_rank).to(rank_device())

    def body(model, x, y):
        loss = ((model(x) - y).pow(2).squeeze(1) * mask).sum() / mask.sum()
        loss.backward()
        return loss
    return train(body)


# ------------------------------------------------------------------ unsynced_dropout
SEED = 1234


def _tp_weights():
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(HIDDEN, D_IN, generator=gen) / D_IN ** 0.5, torch.randn(HIDDEN, generator=gen) * 0.1,
            torch.randn(D_IN, HIDDEN, generator=gen) / HIDDEN ** 0.5, torch.randn(D_IN, generator=gen) * 0.1)


def _tp_forward(x, y, w1, b1, w2, b2, reduce) -> torch.Tensor:
    z = reduce(torch.tanh(x @ w1.T + b1) @ w2.T) + b2  # the MLP's output: replicated after the reduce
    return (F.dropout(z, p=0.5, training=True) - y).pow(2).mean()


def unsynced_dropout(fixed: bool, bad_rank=None) -> dict:
    """One step of a tensor-parallel MLP (Megatron: W1 split by rows, W2 by columns, an all-reduce
    forward, identity backward), then dropout on its replicated output."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    w1, b1, w2, b2 = (t.to(dev) for t in _tp_weights())
    h = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
    params = [t.clone().requires_grad_() for t in (w1[h], b1[h], w2[:, h], b2)]
    x = global_batch(1)[0].to(dev)
    y = torch.cos(x)
    torch.manual_seed(SEED if fixed else SEED + rank)  # the bug: a per-rank seed for a replicated region
    loss = _tp_forward(x, y, *params, reduce=lambda t: reduce_from_group(t))
    loss.backward()
    return {"losses": [value(loss)], "bias_grad_checksum": checksum(params[3].grad)}


def reference_dropout(world: int, bad_rank=None) -> dict:
    params = [t.clone().requires_grad_() for t in _tp_weights()]
    x, _ = global_batch(1)
    with torch.random.fork_rng():  # the caller's random state stays as it was
        torch.manual_seed(SEED)
        loss = _tp_forward(x, torch.cos(x), *params, reduce=lambda t: t)
    loss.backward()
    return {"losses": [value(loss)], "bias_grad_checksum": checksum(params[3].grad)}
