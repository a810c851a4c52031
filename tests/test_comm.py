"""Tests for course_lib.comm (collectives from send/recv) and course_lib.comm.ringviz.

Each world size 2..8 gets ONE run_on_ranks call that loops over every dtype, size and
algorithm inside the ranks and returns its comparisons; the parent asserts on them. Every tensor
is made on the rank's device, as NCCL needs (checked under COURSE_NCCL_RULES=1).
"""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib import CommTracer, run_on_ranks
from course_lib import comm
from course_lib.comm import ringviz
from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.runtime.device import rank_device

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


def _cases(n):
    """(dtype, numel): every dtype at a size smaller than N, one N does not divide and one it
    does; float32 also at N-1. (Kept short: on 8 ranks each case costs ~60 sequential steps.)"""
    cases = [(dtype, numel) for dtype in DTYPES for numel in (1, 2 * n + 1, 8 * n)]
    return cases + ([(torch.float32, n - 1)] if n > 2 else [])


def _random(numel, dtype):
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (numel,), dtype=dtype, device=rank_device())
    return torch.randn(numel, dtype=torch.float64).to(rank_device(), dtype)


def _padded(x, n):
    """Chunk i of x (tensor_split) placed at i*c in a zero buffer of n*c (gloo needs equal sizes)."""
    c = max(1, math.ceil(x.numel() / n))
    out = torch.zeros(n * c, dtype=x.dtype, device=x.device)
    for i, (s, e) in enumerate(comm.chunk_bounds(x.numel(), n)):
        out[i * c:i * c + e - s] = x[s:e]
    return out, c


def _check_everything():
    """Rank code: compare every course collective with its built-in; returns a list of
    (label, ok, detail) plus traced bytes and the observed ring states."""
    rank, n = dist.get_rank(), dist.get_world_size()
    results, traffic = [], []
    for dtype, numel in _cases(n):
        x = _random(numel, dtype)
        ref = x.clone()
        dist.all_reduce(ref)
        if dtype.is_floating_point:
            # Any summation order is within (N-1) * eps * sum|x_i| of the exact sum, so two
            # orders (ours and gloo's) are within twice that of each other.
            abs_sum = x.abs().double()
            dist.all_reduce(abs_sum)
            tol = 2 * (n - 1) * torch.finfo(dtype).eps * abs_sum + 1e-30
        outputs = []
        for name, fn in comm.ALL_REDUCE_ALGORITHMS.items():
            y = x.clone()
            with CommTracer() as tr:
                out = fn(y)
            if dtype.is_floating_point:
                ok = bool(((y.double() - ref.double()).abs() <= tol).all())
            else:
                ok = torch.equal(y, ref)
            results.append((f"{name} {dtype} numel={numel}", ok and out is y, "differs from dist.all_reduce"))
            traffic.append((name, dtype.itemsize, numel, tr.total_bytes()["bytes_sent"], tr.total_bytes()["bytes_recv"]))
            outputs.append(y)
        mine = torch.cat(outputs)  # every algorithm must leave all ranks bit-identical
        everyone = torch.empty(n * mine.numel(), dtype=dtype, device=x.device)
        all_gather_single(everyone, mine)
        same = all(torch.equal(chunk, mine) for chunk in everyone.chunk(n))
        results.append((f"identical across ranks {dtype} numel={numel}", same, ""))

        s, e = comm.chunk_bounds(numel, n)[rank]
        # reduce-scatter against reduce_scatter_single on the chunk-padded tensor
        padded, c = _padded(x, n)
        expected = torch.empty(c, dtype=dtype, device=x.device)
        reduce_scatter_single(expected, padded)
        y = x.clone()
        with CommTracer() as tr:
            mine = comm.ring_reduce_scatter(y)
        traffic.append(("reduce_scatter", dtype.itemsize, numel, tr.total_bytes()["bytes_sent"],
                        tr.total_bytes()["bytes_recv"]))
        if dtype.is_floating_point:
            ok = bool(((mine.double() - expected[:e - s].double()).abs() <= tol[s:e]).all())
        else:
            ok = torch.equal(mine, expected[:e - s])
        results.append((f"reduce_scatter {dtype} numel={numel}", ok and mine.numel() == e - s, ""))

        # all-gather: rank r contributes chunk r of its x; compare with padded all_gather_single
        y = torch.zeros_like(x)
        y[s:e] = x[s:e]
        piece = torch.zeros(c, dtype=dtype, device=x.device)
        piece[:e - s] = x[s:e]
        gathered = torch.empty(n * c, dtype=dtype, device=x.device)
        all_gather_single(gathered, piece)
        expected = torch.cat([gathered[i * c:i * c + b - a] for i, (a, b) in enumerate(comm.chunk_bounds(numel, n))])
        with CommTracer() as tr:
            comm.ring_all_gather(y)
        traffic.append(("all_gather", dtype.itemsize, numel, tr.total_bytes()["bytes_sent"],
                        tr.total_bytes()["bytes_recv"]))
        results.append((f"all_gather {dtype} numel={numel}", torch.equal(y, expected), ""))

        # all-to-all with uneven splits against all_to_all_single
        splits = [b - a for a, b in comm.chunk_bounds(numel, n)]
        inputs = list(torch.tensor_split(x, n))
        outputs = [torch.empty(splits[rank], dtype=dtype, device=x.device) for _ in range(n)]
        expected = torch.empty(splits[rank] * n, dtype=dtype, device=x.device)
        dist.all_to_all_single(expected, x, output_split_sizes=[splits[rank]] * n, input_split_sizes=splits)
        with CommTracer() as tr:
            comm.pairwise_all_to_all(outputs, inputs)
        traffic.append(("all_to_all", dtype.itemsize, numel, tr.total_bytes()["bytes_sent"],
                        tr.total_bytes()["bytes_recv"]))
        results.append((f"all_to_all {dtype} numel={numel}", torch.equal(torch.cat(outputs), expected), ""))
    return results, traffic, ringviz.observe_ring_all_reduce()


@pytest.mark.parametrize("world_size", range(2, 9))
def test_collectives_match_builtins_bytes_and_schedule(world_size):
    per_rank = run_on_ranks(_check_everything, world_size=world_size, timeout_s=60, check_collectives=False)
    n = world_size
    failures = [(r, label, detail) for r, (results, _, _) in enumerate(per_rank)
                for label, ok, detail in results if not ok]
    assert not failures, failures[:10]
    assert len(per_rank[0][0]) == len(_cases(n)) * (len(comm.ALL_REDUCE_ALGORITHMS) + 4)

    # Bytes from the tracer equal the formulas: exactly when N divides numel, otherwise within
    # chunk rounding (every message is one chunk, off by at most one element).
    for rank, (_, traffic, _) in enumerate(per_rank):
        for algo, itemsize, numel, sent, recv in traffic:
            nbytes = numel * itemsize
            expected = comm.theory_bytes_sent(algo, nbytes, n, rank)
            p = 1 << (n.bit_length() - 1)
            # elements a message may be off by, summed over the messages
            steps = {"ring": 2 * (n - 1), "sharded_ps": 2 * (n - 1), "rabenseifner": 2 * p}.get(algo, n - 1)
            exact = numel % (p if algo == "rabenseifner" else n) == 0 or algo in ("tree", "ps")
            where = f"{algo} numel={numel} rank={rank}"
            if exact:
                assert sent == expected, where
                assert recv == sent, where  # every schedule here is symmetric
            else:
                assert abs(sent - expected) <= steps * itemsize, where
                assert abs(recv - expected) <= steps * itemsize, where

    # The real ring went through exactly the states the simulation predicts.
    sim = ringviz.simulate_ring(n)
    real = [[per_rank[r][2][step] for r in range(n)] for step in range(len(sim))]
    assert real == sim


def _subgroup_check():
    group = dist.new_group([0, 2, 4])
    if dist.get_rank() not in (0, 2, 4):
        return None
    out = {}
    x = torch.randn(11, dtype=torch.float64).to(rank_device())
    ref = x.clone()
    dist.all_reduce(ref, group=group)
    for name, fn in comm.ALL_REDUCE_ALGORITHMS.items():
        y = fn(x.clone(), group=group)
        # float64, 3 values of |x| < ~5 summed in another order: within 2 * 2 * eps64 * sum|x| ~ 1e-14
        # (the bound of the test above); 1e-12 leaves 100x, a missing rank is off by ~1
        out[name] = bool(torch.allclose(y, ref, rtol=0, atol=1e-12))
    inputs = list(torch.tensor_split(x, 3))
    outputs = [torch.empty_like(inputs[dist.get_rank(group)]) for _ in range(3)]
    comm.pairwise_all_to_all(outputs, inputs, group=group)
    everyone = [torch.empty(11, dtype=torch.float64, device=x.device) for _ in range(3)]
    dist.all_gather(everyone, x, group=group)
    out["all_to_all"] = all(torch.equal(outputs[j], torch.tensor_split(everyone[j], 3)[dist.get_rank(group)])
                            for j in range(3))
    return out


def test_collectives_work_on_a_subgroup():
    results = run_on_ranks(_subgroup_check, world_size=5, timeout_s=60)
    assert results[1] is None and results[3] is None
    for r in (0, 2, 4):
        assert results[r] == {**{name: True for name in comm.ALL_REDUCE_ALGORITHMS}, "all_to_all": True}, (r, results[r])
    assert {"ring", "tree", "rabenseifner", "ps", "sharded_ps"} <= set(results[0])


def _traced_halving_doubling():
    """Rank code: bytes sent per round of Rabenseifner on 8 ranks, 64 float32 (256 B)."""
    x = torch.full((64,), float(dist.get_rank()), device=rank_device())
    with CommTracer() as tracer:
        comm.rabenseifner_all_reduce(x)
    return x[0].item(), tracer.total_bytes()["bytes_sent"], tracer.summary()["isend"]["calls"]


def test_rabenseifner_halves_then_doubles():
    """Halving sends 128, 64, 32 B and doubling 32, 64, 128 B: 2(p-1)/p S = 448 B in 6 messages
    (log2 8 = 3 rounds each way), where recursive doubling sends 3 x 256 = 768 B."""
    for total, sent, calls in run_on_ranks(_traced_halving_doubling, world_size=8, timeout_s=60):
        assert total == sum(range(8)) and sent == 448 == comm.theory_bytes_sent("rabenseifner", 256, 8) and calls == 6


def test_chunk_bounds_match_tensor_split():
    for numel in (0, 1, 5, 16, 37):
        for n in (1, 2, 3, 7, 8):
            sizes = [e - s for s, e in comm.chunk_bounds(numel, n)]
            assert sizes == [len(c) for c in torch.tensor_split(torch.arange(numel), n)]
    with pytest.raises(ValueError, match="world_size"):
        comm.chunk_bounds(4, 0)


@pytest.mark.parametrize("n", range(2, 9))
def test_ring_schedule_properties(n):
    states = ringviz.simulate_ring(n)
    full = (1 << n) - 1
    after_rs = states[n - 1]
    for r in range(n):
        # after the reduce-scatter, rank r owns the complete chunk r (like the built-in)
        assert after_rs[r][r] == full
        assert all(after_rs[r][c] != full for c in range(n) if c != r)
        assert comm.ring_send_chunk(r, n - 1, n) == r  # all-gather starts with the owned chunk
        assert states[-1][r] == [full] * n
    for step in range(2 * (n - 1)):
        # every step each chunk index is sent by exactly one rank: all links busy, no duplicates
        assert sorted(c for _, _, c in ringviz.ring_transfers(n, step)) == list(range(n))


def test_bad_inputs_raise_before_communicating():
    with pytest.raises(ValueError, match="contiguous"):
        comm.ring_all_reduce(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="torch.Tensor"):
        comm.tree_all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="contiguous"):
        comm.rabenseifner_all_reduce(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="torch.Tensor"):
        comm.sharded_ps_all_reduce("gradient")
    with pytest.raises(ValueError, match="world_size"):
        ringviz.simulate_ring(1)
    with pytest.raises(ValueError, match="algorithm"):
        comm.theory_bytes_sent("butterfly", 8, 4)


def test_static_ring_figure_has_one_panel_per_step():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = ringviz.plot_ring_steps(3, cols=3)
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert len(titled) == 2 * (3 - 1) + 1
    assert "reduce-scatter" in titled[1].get_title() and "all-gather" in titled[-1].get_title()
    plt.close(fig)

