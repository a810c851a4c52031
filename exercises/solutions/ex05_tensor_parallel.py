"""Reference solution for exercise 05 (kept apart from the learner's stubs)."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _summed(t, group):
    """The sum of t over the group's ranks, in a new tensor (t itself may still be needed by autograd)."""
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


class CopyToGroup(torch.autograd.Function):
    """f: identity forward; backward, the gradient summed over the group (every rank used x)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class ReduceFromGroup(torch.autograd.Function):
    """g: the sum over the group forward; backward, each term's gradient is the sum's (identity)."""

    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x, group=None):
    return CopyToGroup.apply(x, group)


def g(x, group=None):
    return ReduceFromGroup.apply(x, group)


def qkv_rows_for_rank(d_model: int, n_head: int, tp: int, rank: int) -> list[int]:
    """Rows of the fused qkv weight [Q | K | V] (d_model rows each) that rank `rank` keeps: the
    rows of its n_head/tp whole heads in Q, then in K, then in V. Rank r's heads are the r-th
    contiguous block, whose outputs are the input features of its attn.proj shard."""
    local = d_model // tp
    mine = list(range(rank * local, (rank + 1) * local))
    return [part * d_model + i for part in range(3) for i in mine]


class ColumnParallelLinear(nn.Module):
    """This rank's output features of `full` (rows: which ones; default a contiguous 1/tp)."""

    def __init__(self, full: nn.Linear, group=None, rows=None):
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        if rows is None:
            local = full.out_features // tp
            rows = list(range(rank * local, (rank + 1) * local))
        rows = torch.as_tensor(rows)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone()) if full.bias is not None else None

    def forward(self, x):
        return F.linear(f(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of `full` (a contiguous 1/tp); the bias whole, added once."""

    def __init__(self, full: nn.Linear, group=None):
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        local = full.in_features // tp
        self.weight = nn.Parameter(full.weight.detach()[:, rank * local:(rank + 1) * local].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x):
        y = g(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


def _hidden_share(hidden: int, tp: int, rank: int) -> list[int]:
    """Rank `rank`'s contiguous block of `hidden` features: the first hidden % tp ranks one more."""
    base, extra = divmod(hidden, tp)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


class _RowShard(nn.Module):
    """proj's columns `cols` (this rank's hidden features, in fc's order); the bias whole, added once after g."""

    def __init__(self, full: nn.Linear, cols, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[:, torch.as_tensor(cols)].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, h):
        y = g(F.linear(h, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class _UnevenMLP(nn.Module):
    def __init__(self, fc: nn.Linear, proj: nn.Linear, group):
        super().__init__()
        mine = _hidden_share(fc.out_features, dist.get_world_size(group), dist.get_rank(group))
        self.fc = ColumnParallelLinear(fc, group, rows=mine)
        self.proj = _RowShard(proj, mine, group)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def uneven_mlp(fc: nn.Linear, proj: nn.Linear, group=None) -> nn.Module:
    """fc -> GELU -> proj over the group when tp does not divide the hidden width fc.out_features:
    balanced contiguous blocks of hidden features (sizes differ by at most one), proj's matching columns."""
    return _UnevenMLP(fc, proj, group)
