"""Tests for course_lib.comm.costmodel: the alpha-beta fit, the per-algorithm formulas, the
crossovers, and that the measuring helpers run (no assertions on how fast anything is)."""

import math
import random

import pytest

from course_lib.comm import costmodel as cm
from course_lib import comm, run_on_ranks
from course_lib.runtime.device import rank_device

IB = cm.CLUSTERS["HDR InfiniBand 200 Gb/s (inter-node)"]


def test_fit_recovers_alpha_beta_exactly_from_clean_data():
    alpha, beta = 25e-6, 3e9  # beta is a bandwidth: T = alpha + S / beta
    sizes = [8, 1024, 65536, 1 << 20, 1 << 24]
    link = cm.fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    # pure-Python float64 normal equations (the same bits on every CPU); the cancellation in their
    # determinant costs a few of the 16 digits: 1e-9 relative, where a wrong formula is off by > 1 %
    assert link.alpha == pytest.approx(alpha, rel=1e-9)
    assert link.beta == pytest.approx(beta, rel=1e-9)
    assert link.bandwidth == pytest.approx(3e9, rel=1e-9)


def test_fit_is_robust_to_relative_noise():
    rng = random.Random(0)
    alpha, beta = 50e-6, 1e9
    sizes = [2**k for k in range(3, 25)]
    times = [(alpha + s / beta) * (1 + rng.uniform(-0.05, 0.05)) for s in sizes]
    link = cm.fit_alpha_beta(sizes, times)
    # 1/t weighting keeps alpha meaningful although it is 300x smaller than the largest time: with
    # +-5 % noise on every (made-up, seeded) time, the fit lands within 10 %; unweighted it does not
    assert link.alpha == pytest.approx(alpha, rel=0.1)
    assert link.beta == pytest.approx(beta, rel=0.1)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="two distinct"):
        cm.fit_alpha_beta([8, 8], [1e-5, 1e-5])
    with pytest.raises(ValueError, match="> 0"):
        cm.fit_alpha_beta([8, 16], [1e-5, 0.0])
    with pytest.raises(ValueError, match="beta"):
        cm.fit_alpha_beta([8, 1 << 20], [1e-3, 1e-4])


@pytest.mark.parametrize("n", range(2, 17))
def test_cost_terms_match_the_formulas(n):
    p = 2 ** int(math.log2(n))
    assert cm.cost_terms("ring", n) == (2 * (n - 1), 2 * (n - 1) / n)
    assert cm.cost_terms("reduce_scatter", n) == cm.cost_terms("all_gather", n) == (n - 1, (n - 1) / n)
    assert cm.cost_terms("ps", n) == (2 * (n - 1), 2 * (n - 1))
    steps = math.log2(p) + (2 if n != p else 0)
    assert cm.cost_terms("tree", n) == (steps, steps)
    fold = 2 if n != p else 0  # hand the tensor in and get the result back
    assert cm.cost_terms("rabenseifner", n) == (2 * math.log2(p) + fold, 2 * (p - 1) / p + fold)
    assert cm.cost_terms("sharded_ps", n) == cm.cost_terms("ring", n)  # push = reduce-scatter, pull = all-gather
    # a ring all-reduce is a reduce-scatter followed by an all-gather
    rs, ring = cm.cost_terms("reduce_scatter", n), cm.cost_terms("ring", n)
    assert ring == (2 * rs[0], 2 * rs[1])
    # the bandwidth terms agree with the per-rank bytes comm.py is tested to send
    s = 1 << 20
    assert ring[1] * s == comm.theory_bytes_sent("ring", s, n)
    assert cm.cost_terms("ps", n)[1] * s == 2 * comm.theory_bytes_sent("ps", s, n)  # server: in, then out
    assert cm.cost_terms("sharded_ps", n)[1] * s == comm.theory_bytes_sent("sharded_ps", s, n)
    # fold: S in and S out; float64 formulas in another order (~1e-16 relative; approx's default 1e-6)
    assert cm.cost_terms("rabenseifner", n)[1] * s == pytest.approx(
        comm.theory_bytes_sent("rabenseifner", s, n) + (s if n != p else 0))


def test_predict_time_and_regimes():
    s = 1 << 30
    assert IB.beta == 25e9 and IB.message_time(s) == IB.alpha + s / 25e9  # beta: bytes per second
    # a formula on made-up inputs, float64 in another order: approx's default 1e-6 relative
    assert cm.predict_time("ring", s, 64, IB) == pytest.approx(126 * IB.alpha + 126 / 64 * s / IB.beta)
    # ring bandwidth term tends to 2 S / beta: adding ranks barely costs bandwidth (1e-12 s: the
    # float64 rounding of ~0.1 s, ~1e-17 s, with room)
    assert cm.predict_time("ring", s, 1024, IB) < 2 * s / IB.beta + 2 * 1023 * IB.alpha + 1e-12
    assert cm.regime("ring", 8, 64, IB) == "latency-bound"
    assert cm.regime("ring", s, 64, IB) == "bandwidth-bound"
    assert cm.predict_time("ring", s, 1, IB) == 0.0
    with pytest.raises(ValueError, match="algorithm"):
        cm.predict_time("butterfly", s, 4, IB)
    with pytest.raises(ValueError, match="world_size"):
        cm.cost_terms("ring", 0)


@pytest.mark.parametrize("name", sorted(cm.CLUSTERS))
@pytest.mark.parametrize("n", [8, 64, 1000])
def test_tree_wins_small_ring_wins_large_ps_never_wins(name, n):
    link = cm.CLUSTERS[name]
    s_star = cm.crossover_bytes("tree", "ring", n, link)
    assert s_star is not None and s_star > 0
    # at the crossover the two formulas are equal up to float64 rounding (approx's default 1e-6)
    assert cm.predict_time("tree", s_star, n, link) == pytest.approx(cm.predict_time("ring", s_star, n, link))
    assert cm.predict_time("tree", s_star / 4, n, link) < cm.predict_time("ring", s_star / 4, n, link)
    assert cm.predict_time("tree", s_star * 4, n, link) > cm.predict_time("ring", s_star * 4, n, link)
    for size in (8, 1 << 20, 1 << 30):
        assert cm.predict_time("ps", size, n, link) >= cm.predict_time("ring", size, n, link)
    assert cm.crossover_bytes("ring", "ps", n, link) is None  # equal alpha terms: ring always ahead


@pytest.mark.parametrize("n", [2, 4, 8, 64, 1024])
def test_tree_beats_ring_below_the_closed_form_crossover(n):
    """Recursive doubling vs ring for N a power of two: L alpha + L S/beta = 2(N-1) alpha +
    2(N-1)/N S/beta at S* = (2(N-1) - L) alpha beta / (L - 2(N-1)/N), L = log2 N."""
    L = math.log2(n)
    s_star = cm.crossover_bytes("tree", "ring", n, IB)
    if n == 2:  # one exchange of S either way: the two are the same algorithm
        assert s_star is None
        return
    # the closed form, float64 in another order (approx's default 1e-6 relative)
    assert s_star == pytest.approx((2 * (n - 1) - L) * IB.alpha * IB.beta / (L - 2 * (n - 1) / n))
    if n > 4:  # the more ranks, the more ring steps a tree saves: the crossover grows with N
        assert s_star > cm.crossover_bytes("tree", "ring", n // 2, IB)


@pytest.mark.parametrize("n", [2, 4, 8, 64, 1024])
def test_rabenseifner_is_never_slower_than_the_ring_in_the_model(n):
    for size in (8, 1 << 16, 1 << 30):
        assert cm.predict_time("rabenseifner", size, n, IB) <= cm.predict_time("ring", size, n, IB)
    if n > 2:  # same bytes, fewer messages: the gap is pure latency
        gap = cm.predict_time("ring", 1 << 30, n, IB) - cm.predict_time("rabenseifner", 1 << 30, n, IB)
        # a difference of two ~0.1 s formulas: float64 cancellation leaves ~1e-17 s of error on a
        # gap of >= 2 alpha = 1e-5 s; approx's default (1e-6 relative, 1e-12 absolute) covers it
        assert gap == pytest.approx((2 * (n - 1) - 2 * math.log2(n)) * IB.alpha)


def test_rabenseifner_fold_in_costs_bandwidth_when_n_is_not_a_power_of_two():
    # N = 6: two ranks hand their whole tensor in and get it back, 2S more on the critical path
    assert cm.predict_time("rabenseifner", 1 << 30, 6, IB) > cm.predict_time("ring", 1 << 30, 6, IB)
    assert cm.predict_time("rabenseifner", 8, 6, IB) < cm.predict_time("ring", 8, 6, IB)


def test_sharded_ps_moves_ring_traffic_single_ps_does_not():
    s = 1 << 20
    for n in (4, 64):
        assert comm.theory_bytes_sent("sharded_ps", s, n) == 2 * (n - 1) / n * s
        assert comm.theory_bytes_sent("ps", s, n) == (n - 1) * s
        assert cm.predict_time("sharded_ps", s, n, IB) == cm.predict_time("ring", s, n, IB)


def _measure_small():
    import torch.distributed as dist

    dev = rank_device()  # the buffers on the rank's device, as NCCL needs
    pp = cm.ping_pong(sizes_bytes=(8, 4096), rounds=2, iters=2, warmup=1, all_pairs=True, device=dev)
    t = cm.time_collective(comm.ring_all_reduce, 4096, iters=2, device=dev)
    return pp, t, dist.get_rank()


def test_measuring_helpers_run_and_agree_across_ranks():
    results = run_on_ranks(_measure_small, world_size=4, timeout_s=60, check_collectives=False)
    pp, t, _ = results[0]
    # measured seconds: only their type and finiteness, and >= 0 (differences of the monotonic
    # perf_counter); how large they are depends on the machine and its load
    assert len(pp) == 2 and all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in pp)
    assert all(r[0] is None for r in results[1:])  # only rank 0 reports the ping-pong
    assert isinstance(t, float) and math.isfinite(t) and t >= 0
    assert all(r[1] == t for r in results)  # exact: the MAX all-reduce gives every rank the same value


def test_ping_pong_validates_before_communicating():
    """Rank code: a bad argument fails on every rank before any message, so nothing waits."""
    from course_lib import RankError

    with pytest.raises(RankError, match="rounds=0 must be a positive int"):
        run_on_ranks(cm.ping_pong, (8,), rounds=0, world_size=2, timeout_s=30)
