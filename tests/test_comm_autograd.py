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
