"""Zero-bubble's split backward on a stage: B computes input gradients only, W the weights'.

While `deferred_weight_grads(stage, current)` is active, every nn.Linear of the stage computes
y = x W^T + b through LinearInputGradOnly, whose backward returns only dy W (what the previous
stage waits for) and stashes (weight, bias, x, dy) in current["sink"] (the runner sets one list
per micro-batch chunk before its forward). The W action then calls apply_weight_grads(sink):
dW += dy^T x and db += sum(dy), the weight gradients the full backward would have added.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F


class LinearInputGradOnly(torch.autograd.Function):
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


def apply_weight_grads(sink: list) -> None:
    """dW += dy^T x and db += sum of dy over all rows, for every stashed Linear call."""
    for weight, bias, x, dy in sink:
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        gw = dy2.t() @ x2
        weight.grad = gw if weight.grad is None else weight.grad.add_(gw)
        if bias is not None:
            gb = dy2.sum(0)
            bias.grad = gb if bias.grad is None else bias.grad.add_(gb)
    sink.clear()


def stashed_tensors(sink: list):
    """The (x, dy) tensors a sink holds until its W runs."""
    return (t for w in sink for t in w[2:])


@contextlib.contextmanager
def deferred_weight_grads(stage: nn.Module, current: dict):
    """While active, every nn.Linear of the stage computes through LinearInputGradOnly,
    stashing into current["sink"] (set by the runner before each forward)."""
    linears = [m for m in stage.modules() if isinstance(m, nn.Linear)]
    for lin in linears:
        lin.forward = (lambda lin: lambda x: LinearInputGradOnly.apply(x, lin.weight, lin.bias, current["sink"]))(lin)
    try:
        yield
    finally:
        for lin in linears:
            del lin.forward  # back to the class's forward
