"""course_lib.parallel.zero.muon: sharded Muon (gather / owner / balanced) equal to the single
process's Muon on real gloo ranks, its bytes equal to course_lib.estimate.muon, bad input refused.

The gradients are small dyadic numbers (k / 16, |k| <= 8): their sum over ranks and its division by
N = 2 or 4 are exact in fp32, so the sharded mean gradient is bitwise the reference's. Every
operation before Newton-Schulz is element-wise (a row block gives the same bits as the whole
tensor), Newton-Schulz runs on the same matrix, and the reference runs in the same rank process
(same kernels, same threads): so the comparisons are exact.
"""

import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.estimate.muon import assign_owners, flops_per_rank, load_imbalance, muon_traffic
from course_lib.observe import CommTracer
from course_lib.parallel.zero.muon import ShardedMuon, check_sharded_muon_args
from course_lib.techniques.muon import Muon

STEPS = 3
# at N = 4 (c = ceil(d0 / 4) rows per rank): (6, 10) leaves rank 3 only padding, (2, 12) spans
# exactly two shards (ranks 0 and 1), (16, 5) is tall (Newton-Schulz transposes it), (5, 7) odd
SHAPES = [(6, 10), (2, 12), (16, 5), (5, 7)]
THREE = SHAPES[:3]  # three matrices at N = 4: rank 3 owns none under "owner" and "balanced"
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def _grad(shape, step, rank, i):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
    return torch.randint(-8, 9, shape, generator=g).float() / 16


def _params(shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _on_rank(shapes, method, kw):
    rank, n = dist.get_rank(), dist.get_world_size()
    params = _params(shapes)
    opt = ShardedMuon(params, method=method, **kw)
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, step, rank, i)
        with CommTracer() as tracer:  # the last step's summary is the one kept
            opt.step()
        opt.zero_grad()
    momentum = opt.full_momentum()
    ref_params = _params(shapes)
    ref = Muon(ref_params, **kw)
    for step in range(STEPS):
        for i, p in enumerate(ref_params):
            p.grad = sum(_grad(p.shape, step, r, i) for r in range(n)) / n  # exact (module docstring)
        ref.step()
    same_params = [torch.equal(a.detach(), b.detach()) for a, b in zip(params, ref_params)]
    same_momentum = [torch.equal(m, ref.state[p]["momentum_buffer"]) for m, p in zip(momentum, ref_params)]
    moved = max((a - b).abs().max().item() for a, b in zip(params, _params(shapes)))
    return same_params, same_momentum, moved, tracer.summary(), opt.ns_flops // STEPS, opt.owners


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("method", ["gather", "owner", "balanced"])
@pytest.mark.parametrize("shapes", [SHAPES, THREE], ids=["four", "three"])
def test_equals_single_process_and_formula(world_size, method, shapes):
    out = run_on_ranks(_on_rank, shapes, method, KW, world_size=world_size, timeout_s=240)
    for rank, (same_params, same_momentum, moved, summary, flops, owners) in enumerate(out):
        assert all(same_params), (rank, same_params)  # exact: module docstring
        assert all(same_momentum), (rank, same_momentum)
        assert moved > 0.01  # the parameters did move (lr 0.02 times an update of order 1)
        assert summary == muon_traffic(shapes, world_size, method)[rank]  # bytes and calls: exact
        assert flops == flops_per_rank(shapes, world_size, method)[rank]
        assert owners == assign_owners(shapes, world_size, method)
    if method != "gather" and world_size == 4 and len(shapes) == 3:
        assert 3 not in out[0][5]  # a rank that owns no matrix took part in every collective all the same


@pytest.mark.parametrize("method", ["gather", "owner"])
def test_other_hyperparameters(method):
    kw = dict(lr=0.05, weight_decay=0.0, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw", ns_steps=3)
    out = run_on_ranks(_on_rank, SHAPES, method, kw, world_size=2, timeout_s=240)
    assert all(all(o[0]) and all(o[1]) for o in out)  # exact: module docstring


def test_owner_assignment_and_balance():
    shapes = [(64, 64), (256, 64), (64, 256), (192, 64)] * 2  # the course GPT's 8 hidden matrices
    assert assign_owners(shapes, 4, "owner") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert assign_owners(shapes, 4, "gather") is None
    balanced = assign_owners(shapes, 4, "balanced")
    load = [sum(d0 * d1 for (d0, d1), o in zip(shapes, balanced) if o == r) for r in range(4)]
    # the four 16,384-element matrices one per rank, then 192x64 on ranks 0 and 1, 64x64 on 2 and 3
    assert load == [28672, 28672, 20480, 20480]
    dealt = assign_owners(shapes, 4, "owner")
    dealt_load = [sum(d0 * d1 for (d0, d1), o in zip(shapes, dealt) if o == r) for r in range(4)]
    assert dealt_load == [8192, 32768, 32768, 24576]
    assert load_imbalance(flops_per_rank(shapes, 4, "balanced")) <= load_imbalance(flops_per_rank(shapes, 4, "owner"))
    # three matrices at four ranks: the fourth owns none
    assert sorted(set(assign_owners(THREE, 4, "balanced"))) == [0, 1, 2]


def test_bad_input_refused_before_any_rank():
    with pytest.raises(ValueError, match=r"parameter bias has shape \(4,\)"):
        check_sharded_muon_args([("w", (4, 4)), ("bias", (4,))], "owner")
    with pytest.raises(ValueError, match="method='local' must be one of"):
        check_sharded_muon_args([("w", (4, 4))], "local")
    # the constructor checks before it asks for a process group (none exists in this process)
    with pytest.raises(ValueError, match="method='x'"):
        ShardedMuon([torch.nn.Parameter(torch.ones(3, 3))], method="x")
    with pytest.raises(ValueError, match="2-D"):
        ShardedMuon([torch.nn.Parameter(torch.ones(3))], method="gather")


def test_every_communicated_tensor_is_on_the_rank_device():
    # NCCL's device rule checked on CPU ranks (observe/device_rule.py): a tensor made without a device and handed to a
    # collective would pass on gloo and fail on the first NCCL run
    from course_lib.observe.device_rule import under_rule
    from course_lib.runtime.device import rank_device
    for method in ("gather", "owner"):
        out = run_on_ranks(under_rule(_on_rank, rank_device), THREE, method, KW, world_size=2, timeout_s=240)
        assert all(all(o[0]) for o in out)  # exact, as above
