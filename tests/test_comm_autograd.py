"""Differentiable collectives: each forward/backward pair equals the single-process computation."""

import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.comm import autograd as ca
from course_lib.runtime.device import rank_device


def _gradients():
    """On every rank: x_r = (r+1) * base. Loss weights differ per rank so that a wrong
    backward (identity where a sum is needed, or a sum twice) changes the gradient."""
    r, n = dist.get_rank(), dist.get_world_size()
    base = torch.arange(1.0, 9.0, device=rank_device()).reshape(4, 2)  # NCCL: on the rank's device
    out = {}
    for name in ("copy", "reduce", "gather", "scatter", "split"):
        x = (base * (r + 1)).requires_grad_()
        # g (reduce) assumes what follows it is replicated: the same loss on every rank
        w = torch.full((1,), 2.0 if name == "reduce" else float(r + 2))
        if name == "copy":
            y = ca.copy_to_group(x)
        elif name == "reduce":
            y = ca.reduce_from_group(x)
        elif name == "gather":
            y = ca.gather_along_dim(x, 0)
        elif name == "scatter":
            y = ca.scatter_along_dim(x, 1)
        else:
            y = ca.split_along_dim(x, 0)
        (y * w * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        out[name] = (y.detach(), x.grad)
    # all-to-all: rank r sends r+1 rows to every rank
    rows = torch.arange(float(n * (r + 1) * 2), device=rank_device()).reshape(-1, 2) + 100 * r
    x = rows.clone().requires_grad_()
    y = ca.all_to_all_single(x, [s + 1 for s in range(n)], [r + 1] * n)
    (y * (r + 1)).sum().backward()
    out["a2a"] = (y.detach(), x.grad)
    return out


def exact(got, want, msg=None):
    """Every value here is a small integer (arange, rank multiples, their weighted sums < 2^24),
    which fp32 holds and adds exactly in any order: compared bit for bit, not to a tolerance."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=msg)


def test_autograd_collectives_match_single_process():
    n = 2
    res = run_on_ranks(_gradients, world_size=n, timeout_s=60)
    base = torch.arange(1.0, 9.0).reshape(4, 2)
    xs = [(base * (r + 1)).requires_grad_() for r in range(n)]

    def ref(build, name):
        """The whole n-rank computation in one process. f (copy) and split take one tensor
        that every rank holds (rank r's value stands for it); g (reduce) feeds one loss."""
        xs_ = [x.detach().clone().requires_grad_() for x in xs]
        ys = build(xs_)
        ws = [2.0] if name == "reduce" else [float(r + 2) for r in range(n)]
        sum((y * w * torch.arange(y.numel()).reshape(y.shape)).sum() for y, w in zip(ys, ws)).backward()
        return [y.detach() for y in ys], [x.grad for x in xs_]

    builds = {
        "copy": lambda xs_: [xs_[0]] * n,
        "reduce": lambda xs_: [sum(xs_)] * n,
        "gather": lambda xs_: [torch.cat(xs_, 0)] * n,
        "scatter": lambda xs_: list(sum(xs_).chunk(n, 1)),
        "split": lambda xs_: list(xs_[0].chunk(n, 0)),
    }
    for name, build in builds.items():
        ys, gs = ref(build, name)
        replicated_input = name in ("copy", "split")  # one tensor: every rank gets its whole gradient
        for r in range(n):
            if name == "copy":
                exact(res[r][name][0], xs[r].detach(), msg=name)
            elif name == "split":
                exact(res[r][name][0], xs[r].detach().chunk(n, 0)[r], msg=name)
            else:
                exact(res[r][name][0], ys[r], msg=name)
            exact(res[r][name][1], gs[0] if replicated_input else gs[r], msg=name)
    # all-to-all: rank s sends s+1 rows to every rank
    for r in range(n):
        y, g = res[r]["a2a"]
        sent = [torch.arange(float(n * (s + 1) * 2)).reshape(-1, 2) + 100 * s for s in range(n)]
        exact(y, torch.cat([sent[s][r * (s + 1):(r + 1) * (s + 1)] for s in range(n)]))
        # the gradient of row i on rank r is the multiplier of the rank it was sent to
        sent_to = torch.arange(n).repeat_interleave(r + 1)
        exact(g, (sent_to + 1).float().unsqueeze(1).expand(-1, 2))


def _bad_split():
    ca.gather_along_dim(torch.ones(3, 2, device=rank_device()), 0)  # fine: gathering needs nothing divisible
    ca.scatter_along_dim(torch.ones(3, 2, device=rank_device()), 0)


def test_indivisible_scatter_is_a_clear_error():
    import pytest

    from course_lib import RankError

    with pytest.raises(RankError, match="size 3 of dim 0 must be divisible by the group size 2"):
        run_on_ranks(_bad_split, world_size=2, timeout_s=60)


def _deferred(micro_batches: int):
    """Two parameters through copy_parameter_to_group and, as the reference, the same two through
    copy_to_group, over `micro_batches` backward passes accumulating into .grad; rank r weights its
    loss by r + 1. Integer-valued floats: every sum is exact in any order, so equal means equal."""
    from course_lib.observe import CommTracer

    r = dist.get_rank()
    dev = rank_device()
    made = {}
    for how in ("deferred", "per call"):
        a = torch.nn.Parameter(torch.arange(1.0, 5.0, device=dev))
        b = torch.nn.Parameter(torch.arange(1.0, 3.0, device=dev))
        calls = []
        for _ in range(micro_batches):
            enter = ca.copy_parameter_to_group if how == "deferred" else ca.copy_to_group
            loss = ((enter(a) * (r + 1)).sum() + (enter(b) * enter(b)).sum() * (r + 1))
            with CommTracer() as t:
                loss.backward()
            calls.append(t.summary().get("all_reduce", {}).get("calls", 0))
        made[how] = (a.grad.clone(), b.grad.clone(), calls)
    return made


def test_deferred_parameter_gradients_are_summed_once_per_backward():
    """copy_parameter_to_group is f with its all-reduce made at the end of the backward pass, for
    every such parameter at once: the gradients equal copy_to_group's (summed over ranks, and
    accumulated over micro-batches), in one call per pass, not one per use."""
    for n in (2, 3):
        for out in run_on_ranks(_deferred, 2, world_size=n, timeout_s=60):
            deferred, per_call = out["deferred"], out["per call"]
            assert torch.equal(deferred[0], per_call[0]) and torch.equal(deferred[1], per_call[1])
            ranks = sum(r + 1 for r in range(n))
            assert torch.equal(deferred[0].cpu(), 2 * ranks * torch.ones(4))  # 2 micro-batches
            assert deferred[2] == [1, 1] and per_call[2] == [3, 3]  # b is used twice: two f's


def test_deferred_copy_needs_a_parameter():
    import pytest

    x = torch.ones(3, requires_grad=True) * 2  # not a leaf
    with pytest.raises(ValueError, match="leaf tensor"):
        ca.copy_parameter_to_group(x)
