"""Exercise 05's last check: an MLP split over tp ranks when tp does not divide its hidden width.

    check_uneven_mlp fc -> GELU -> proj with a hidden width tp does not divide (7 on 2 ranks, 10
                     on 4): which hidden features each rank's shards hold (read off the shards
                     by matching them against the full layers: every feature once, balanced,
                     proj's columns the features fc computes), then outputs and all gradients
                     against the single process, and the all-reduces counted

No layout is stored: the split is read off the learner's own shards. It sits beside
ex05_tensor_parallel.py (whose helpers it uses) so that each module stays near 300 lines.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.grading.ex05_tensor_parallel import RANKS, _close, _grad, _module, _same
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import run_on_ranks


UNEVEN_CASES = ((2, 7), (4, 10))  # (tp, hidden): 7 = 2*3 + 1; 10 = 4*2 + 2 (two ranks take one more)


def _features(shard, full, axis: int):
    """Which features of `full` (rows: axis 0; columns: axis 1) the shard holds, in its order, found
    by bitwise match (random weights: no two rows or columns are equal); None where one is no copy."""
    if not isinstance(shard, torch.Tensor) or shard.dim() != 2 or shard.shape[1 - axis] != full.shape[1 - axis]:
        return None
    s, w = (shard.detach(), full.detach()) if axis == 0 else (shard.detach().T, full.detach().T)
    found = []
    for row in s:
        hits = [j for j in range(w.shape[0]) if torch.equal(row, w[j])]
        if not hits:
            return None
        found.append(hits[0])
    return found


def _uneven_on_rank(name: str, hidden: int):
    student, n = _module(name), dist.get_world_size()
    torch.manual_seed(0)  # the same full layers and input on every rank
    fc, proj = nn.Linear(16, hidden), nn.Linear(hidden, 16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    full = proj(F.gelu(fc(x)))
    full.square().sum().backward()
    fc_before, proj_before = fc.weight.detach().clone(), proj.weight.detach().clone()
    mlp = student.uneven_mlp(fc, proj)
    col, row = getattr(mlp, "fc", None), getattr(mlp, "proj", None)
    cw, cb, rw, rb = (getattr(layer, a, None) for layer in (col, row) for a in ("weight", "bias"))
    mine = _features(cw, fc.weight, 0)
    res = {"params": [isinstance(p, nn.Parameter) for p in (cw, cb, rw, rb)],
           "fc features": mine, "proj features": _features(rw, proj.weight, 1),
           "fc bias matches": mine is not None and _same(cb, fc.bias[mine]),
           "proj bias whole": _same(rb, proj.bias), "bias counted": 1, "full unchanged": True}
    # shards that cannot be multiplied on some rank (fc and proj of different widths) would fail
    # there and leave the others waiting in the all-reduce: all ranks skip forward together, and
    # the check reports the layout (an untraced all-reduce, before the measured ones)
    fits = torch.tensor([float(mine is not None and res["proj features"] is not None
                               and len(mine) == len(res["proj features"]))])
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if fits.item() == 0:
        return res
    xr = x.detach().clone().requires_grad_(True)
    with CommTracer() as forward:
        out = mlp(xr)
    with CommTracer() as backward:
        out.square().sum().backward()
    res["calls"] = [(s.get("all_reduce", {}).get("calls", 0), s.get("all_reduce", {}).get("bytes_sent", 0),
                     sum(v["calls"] for op, v in s.items() if op != "all_reduce"))
                    for s in (forward.summary(), backward.summary())]
    if _grad(cw) is not None:
        res["compare"] = {"output": (out, full), "input gradient": (xr.grad, x.grad),
                          "fc weight gradient": (_grad(cw), fc.weight.grad[mine]),
                          "fc bias gradient": (_grad(cb), fc.bias.grad[mine]),
                          "proj weight gradient": (_grad(rw), proj.weight.grad[:, mine]),
                          "proj bias gradient": (_grad(rb), proj.bias.grad)}
    # a whole number k > 1 of biases in the output, where the full layer has one: (k-1) b extra on
    # every token (fp32 sums of 10 products: ~1e-7 apart when that is the only difference)
    extra = out.detach() - full.detach()
    res["bias counted"] = next((k for k in range(2, n + 1)
                                if torch.allclose(extra, (k - 1) * proj.bias.detach().expand_as(extra), atol=1e-5)), 1)
    with torch.no_grad():  # one SGD step on the shards: the full layers must not move (shards are copies)
        for shard in (cw, cb, rw, rb):
            if isinstance(shard, torch.Tensor) and shard.grad is not None:
                shard.sub_(0.1 * shard.grad)
    res["full unchanged"] = torch.equal(fc.weight, fc_before) and torch.equal(proj.weight, proj_before)
    return res


def _share_problems(features, hidden: int, tp: int) -> str | None:
    """Why the ranks' fc and proj shards are not a balanced split of the hidden features (exact)."""
    for r, res in enumerate(features):
        if res["fc features"] is None:
            return (f"rank {r}: mlp.fc.weight is not a set of rows copied from the full fc weight (each row: "
                    f"one hidden feature's weights, all {16} inputs)")
        if res["proj features"] is None:
            return (f"rank {r}: mlp.proj.weight is not a set of columns copied from the full proj weight "
                    f"(each column: one hidden feature's weights, all {16} outputs)")
    sizes = [len(res["fc features"]) for res in features]
    held = sorted(i for res in features for i in res["fc features"])
    if len(set(held)) != len(held):
        return f"some hidden features are computed on more than one rank (fc shard widths {sizes} add up to {len(held)})"
    if held != list(range(hidden)):
        return (f"{hidden - len(held)} of the {hidden} hidden features are computed on no rank (fc shard "
                f"widths {sizes}): the layer must still compute all of them")
    if max(sizes) - min(sizes) > 1:
        return (f"fc shard widths {sizes} differ by more than one: the slowest rank sets the pace, so "
                f"the {hidden} features must be shared as evenly as {tp} ranks allow")
    for r, res in enumerate(features):
        if res["proj features"] != res["fc features"]:
            return (f"rank {r}: proj's columns are not the hidden features its fc computes, in the same order "
                    f"(fc holds {len(res['fc features'])} features, proj reads {len(res['proj features'])} "
                    f"columns): the row-parallel split must follow the column-parallel one")
    return None


def check_uneven_mlp(student, cases=UNEVEN_CASES):
    """uneven_mlp(fc, proj) with hidden widths tp does not divide, against the full layers."""
    x_bytes = 2 * 5 * 16 * 4  # X: (2, 5, 16) fp32, and the output the same size
    for n, hidden in cases:
        results = run_on_ranks(_uneven_on_rank, student.__name__, hidden, world_size=n, **RANKS)
        where = f"hidden width {hidden} on {n} ranks"
        for r, res in enumerate(results):
            check_equal(f"{where}, rank {r}: mlp.fc and mlp.proj have weight and bias nn.Parameters",
                        res["params"], [True] * 4)
        problem = _share_problems(results, hidden, n)
        if problem:
            raise CheckFailed(f"{where}: {problem}")
        passed(f"{where}: every hidden feature on one rank, shares as even as they can be, proj following fc")
        for r, res in enumerate(results):
            at = f"{where}, rank {r}"
            if not res["fc bias matches"]:
                raise CheckFailed(f"{at}: mlp.fc.bias must hold the bias entries of the features its weight rows hold")
            if not res["proj bias whole"]:
                raise CheckFailed(f"{at}: mlp.proj.bias must be a copy of the whole proj bias")
            if not res["full unchanged"]:
                raise CheckFailed(f"{at}: an SGD step on the shards moved the full layers (a shard must be a "
                                  f"copy, not a view)")
            if "compare" not in res:
                raise CheckFailed(f"{at}: mlp.fc.weight has no gradient: the shard did not take part in backward")
            if res["bias counted"] > 1:
                raise CheckFailed(f"{at}: the proj bias is counted {res['bias counted']} times in the output: "
                                  f"each rank's partial product is summed over the ranks, so where does the bias go?")
            for name, (got, want) in res["compare"].items():
                if got is None:
                    raise CheckFailed(f"{at}: {name} is None: the shard did not take part in backward")
                # fp32 sums of at most 10 products split over the ranks and added again: the same terms in
                # another order (~1e-7); a missing or doubled term is off by 1e-2 and more
                _close(f"{at}: {name} equals the single process's", got, want, rtol=1e-5, atol=1e-5)
            check_equal(f"{at}: (all-reduces, bytes each rank gives them, other collectives) in forward and "
                        f"in backward", res["calls"], [(1, x_bytes, 0), (1, x_bytes, 0)])
