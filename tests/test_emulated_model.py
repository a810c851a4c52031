"""The emulated-rank alpha-beta-gamma model (course_lib.estimate.emulated) and the fit of its
constants (course_lib.measure.emulated_fit): the formula's properties and the fit's recovery of
known constants from synthetic timings. No measured time is asserted."""

from __future__ import annotations

import math

import pytest

from course_lib.comm import costmodel
from course_lib.estimate import emulated
from course_lib.estimate.emulated import EmulatedConstants
from course_lib.measure import emulated_fit

ALGORITHMS = ("ring", "tree", "rabenseifner", "ps", "sharded_ps", "all_to_all", "reduce_scatter", "all_gather")
MiB = 1 << 20
ALPHA, BETA = 2.0**-14, 2.0**30  # powers of two: the line's times below are exact in binary
SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26)
# The model's sums run in another order than costmodel.predict_time's a*alpha + b*S/beta: equal
# up to a few float64 roundings (about 1e-16 each), so 1e-12 relative.
REL = 1e-12


def line(gamma=0.0, cores=8, copy_cores=2.0, copy_all=1.0):
    """Constants whose exchange table is exactly the alpha-beta line alpha + m / beta."""
    return EmulatedConstants(sizes=SIZES, seconds=tuple(ALPHA + s / BETA for s in SIZES), gamma=gamma, cores=cores,
                             copy_cores=copy_cores, copy_all=copy_all)


def convex(cores=2):
    """A table like the measured ones: a fixed cost, and beta falling with the message size."""
    seconds = (5e-5, 1e-4, 6e-4, 1.2e-2, 8e-2)
    return EmulatedConstants(sizes=SIZES, seconds=seconds, gamma=1e-10, cores=cores, copy_cores=10e9, copy_all=4e9)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduces_to_alpha_beta(algorithm, n):
    """gamma = 0, ranks <= cores, whole messages, a table that is one line, a free local copy (the
    all-to-all's own part: alpha-beta has no term for it): costmodel's alpha-beta."""
    c, link = line(cores=8, copy_cores=math.inf, copy_all=math.inf), costmodel.LinkModel(ALPHA, BETA)
    for s in (1 * MiB, 16 * MiB, 64 * MiB):
        assert emulated.predict(algorithm, s, n, c) == pytest.approx(costmodel.predict_time(algorithm, s, n, link), rel=REL)


def test_gamma_adds_r_bytes_times_gamma():
    for algorithm in ALGORITHMS:
        for n in (2, 3, 4):
            r = emulated.reduction_terms(algorithm, n)
            extra = emulated.predict(algorithm, 16 * MiB, n, line(gamma=1e-10)) - emulated.predict(algorithm, 16 * MiB, n, line())
            assert extra == pytest.approx(r * 16 * MiB * 1e-10, rel=1e-9)  # a difference of two sums: cancellation
    assert emulated.reduction_terms("ring", 4) == 3 / 4
    assert emulated.reduction_terms("tree", 4) == 2.0
    assert emulated.reduction_terms("tree", 3) == 2.0  # log2(2) rounds + the fold-in's add
    assert emulated.reduction_terms("all_to_all", 4) == 0.0


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_monotone_in_size(algorithm, n):
    """Whole messages: monotone for any rising table. Cut into pieces: monotone when the table is
    one line (each piece pays alpha again); where beta falls with the size, one more piece can
    make a larger tensor faster (why the ring cuts its chunks), so that case is not asked."""
    sizes = sorted({int(k * MiB / 8) for k in range(1, 8 * 80)} | {2 * MiB * n + d for d in (-1, 0, 1)})
    for c, piece in ((convex(), None), (line(gamma=1e-10, cores=2), None), (line(gamma=1e-10, cores=2), 2 * MiB)):
        times = [emulated.predict(algorithm, s, n, c, piece) for s in sizes]
        assert all(a <= b for a, b in zip(times, times[1:])), (algorithm, n, piece)


def test_sharing_only_when_ranks_outnumber_cores():
    c = convex(cores=2)
    for n in (1, 2):
        assert emulated.sharing(n, c) == 1.0
        assert emulated.terms("ring", 64 * MiB, n, c)["sharing"] == 0.0
    for n in (3, 4):
        assert emulated.sharing(n, c) == 10e9 / 4e9
        assert emulated.terms("ring", 64 * MiB, n, c)["sharing"] > 0
        assert emulated.terms("all_to_all", 64 * MiB, n, c)["sharing"] == 0.0  # nothing added
    # copy rates change nothing while every rank has a core
    other = EmulatedConstants(c.sizes, c.seconds, c.gamma, 4, copy_cores=1.0, copy_all=1e9)
    same = EmulatedConstants(c.sizes, c.seconds, c.gamma, 4, copy_cores=1e9, copy_all=1.0)
    assert emulated.predict("tree", 64 * MiB, 4, other) == emulated.predict("tree", 64 * MiB, 4, same)
    # a machine whose cores share nothing (all copy as fast as a few): sigma 1, never below
    assert emulated.sharing(4, EmulatedConstants(c.sizes, c.seconds, c.gamma, 2, copy_cores=1.0, copy_all=3.0)) == 1.0


def test_start_is_paid_once_per_wait():
    c = convex()
    started = EmulatedConstants(c.sizes, c.seconds, c.gamma, c.cores, c.copy_cores, c.copy_all, start=2.0**-10)
    for algorithm in ALGORITHMS:
        for n in (2, 4):
            parts, plain = emulated.terms(algorithm, 16 * MiB, n, started), emulated.terms(algorithm, 16 * MiB, n, c)
            s = emulated.starts(algorithm, n, 16 * MiB, None, c.cores)  # n = 2: a core each; n = 4: shared
            assert parts["start"] == s * 2.0**-10 and plain["start"] == 0.0  # exact: an integer times a power of two
            assert {k: v for k, v in parts.items() if k != "start"} == {k: v for k, v in plain.items() if k != "start"}
    assert emulated.predict("ring", 16 * MiB, 1, started) == 0.0  # one rank: no collective, no start


def test_exchange_table_is_piecewise_alpha_beta():
    c = convex()
    for s, t in zip(c.sizes, c.seconds):
        assert emulated.exchange_time(s, c) == t
    mid = (SIZES[2] + SIZES[3]) / 2  # halfway between two measured sizes: halfway between their times
    assert emulated.exchange_time(mid, c) == pytest.approx((6e-4 + 1.2e-2) / 2, rel=1e-12)  # float rounding only
    beyond = emulated.exchange_time(2 * SIZES[-1], c)  # the last line continued
    assert beyond == pytest.approx(8e-2 + (8e-2 - 1.2e-2) / (SIZES[-1] - SIZES[-2]) * SIZES[-1], rel=1e-12)
    assert emulated.exchange_time(0, c) == 0.0


def test_messages():
    assert emulated.messages("ring", 64 * MiB, 4, 2 * MiB) == [(48, 2 * MiB)]
    assert emulated.messages("ring", 64 * MiB, 4) == [(6, 16 * MiB)]
    assert emulated.messages("ring", 1 * MiB, 4, 2 * MiB) == [(6, MiB / 4)]
    assert emulated.messages("tree", 8 * MiB, 4) == [(2, 8 * MiB)]
    assert emulated.messages("tree", 8 * MiB, 3) == [(1, 8 * MiB), (2, 8 * MiB)]
    assert emulated.messages("rabenseifner", 8 * MiB, 4) == [(2, 4 * MiB), (2, 2 * MiB)]
    assert emulated.messages("all_to_all", 8 * MiB, 4) == [(3, 2 * MiB)]
    assert emulated.messages("ring", 8 * MiB, 1) == []


def test_bad_input():
    with pytest.raises(ValueError, match="ascending"):
        EmulatedConstants(sizes=(2, 1), seconds=(1.0, 2.0), gamma=0.0, cores=2)
    with pytest.raises(ValueError, match="gamma"):
        EmulatedConstants(sizes=(1, 2), seconds=(1.0, 2.0), gamma=-1.0, cores=2)
    with pytest.raises(ValueError, match="algorithm='butterfly'"):
        emulated.predict("butterfly", MiB, 4, convex())


def test_fit_recovers_known_constants():
    gamma, fixed = 1.5e-10, 3e-6
    adds = [fixed + s * gamma for s in emulated_fit.ADD_SIZES]
    assert emulated_fit.fit_gamma(emulated_fit.ADD_SIZES, adds) == pytest.approx(gamma, rel=1e-9)  # normal equations' rounding
    table = [ALPHA + s / BETA for s in emulated_fit.EXCHANGE_SIZES]
    raw = [{"exchange": table, "add": adds, "copy_cores": 12e9, "copy_all": 5e9, "start": 2e-4},
           {"exchange": None, "add": None, "copy_cores": 8e9, "copy_all": 3e9},
           {"exchange": None, "add": None, "copy_cores": None, "copy_all": 4e9},
           {"exchange": None, "add": None, "copy_cores": None, "copy_all": 4e9}]
    c = emulated_fit.fit_constants(raw, cores=2)
    assert c.sizes == emulated_fit.EXCHANGE_SIZES and c.seconds == tuple(table)
    assert c.gamma == pytest.approx(gamma, rel=1e-9)
    assert (c.copy_cores, c.copy_all, c.cores, c.start) == (10e9, 4e9, 2, 2e-4)
    assert emulated.sharing(4, c) == 2.5
    # the fitted constants give back the alpha-beta line they were made from
    link = costmodel.LinkModel(ALPHA, BETA)
    parts = emulated.terms("all_to_all", 16 * MiB, 2, c)
    assert parts["start"] == 0.0  # 2 ranks on 2 cores, one exchange and no add: no wait
    got = sum(parts.values()) - parts["copy"]  # alpha-beta has no copy of the own part
    assert got == pytest.approx(costmodel.predict_time("all_to_all", 16 * MiB, 2, link), rel=REL)


def test_tree_messages_in_pieces():
    """The course's recursive doubling sends its whole tensor in 2 MiB pieces (trees._add_from),
    the fold-in too; the answer goes back to a folded-in rank in one message."""
    assert emulated.messages("tree", 8 * MiB, 4, 2 * MiB) == [(8, 2 * MiB)]
    assert emulated.messages("tree", 1 * MiB, 4, 2 * MiB) == [(2, MiB)]
    assert emulated.messages("tree", 8 * MiB, 3, 2 * MiB) == [(4, 2 * MiB), (4, 2 * MiB), (1, 8 * MiB)]


def test_small_collectives_are_sampled_more_often():
    """A 1 MiB call is timed 8 times a round, a 16 MiB call once (emulated_fit.repeats)."""
    assert [emulated_fit.repeats(mb) for mb in (0.25, 1, 2, 4, 8, 16, 64)] == [8, 8, 4, 2, 1, 1, 1]


@pytest.mark.gloo_only("the alpha-beta-gamma micro-benchmarks model emulated CPU ranks: their buffers live in host "
                       "memory on purpose, which NCCL's rules refuse")
def test_interleaved_returns_every_measurement():
    """interleaved() on 2 ranks at small sizes: one median per algorithm and size, the exchange
    table on rank 0 only, and t0 (every value checked for being there and positive, not for its
    size: that is the benchmark's job)."""
    from course_lib import run_on_ranks

    sizes = (1 << 12, 1 << 16)
    raw = run_on_ranks(emulated_fit.interleaved, 2, [0.0625, 1], ("ring", "tree", "all_to_all"), 2, sizes, 0.01,
                       world_size=2, timeout_s=120, check_collectives=False)
    assert len(raw[0]["exchange"]) == len(sizes) and raw[1]["exchange"] is None
    assert raw[0]["exchange_after_add"] is None  # 2 ranks on 2 cores: no one is descheduled by an add
    for r in raw:
        assert r["start"] > 0
        assert {name: sorted(by) for name, by in r["measured"].items()} == {
            name: [0.0625, 1] for name in ("ring", "tree", "all_to_all")}
        assert all(0 < t < float("inf") for by in r["measured"].values() for t in by.values())
    c = emulated_fit.fit_constants(raw, 2, sizes=sizes, add_sizes=emulated_fit.ADD_SIZES)
    assert c.start == raw[0]["start"]


def test_starts_count_the_partners_met_one_after_another():
    for n in (2, 3, 4, 8):
        assert emulated.starts("ring", n) == emulated.starts("reduce_scatter", n) == 1  # the same two neighbours
        assert emulated.starts("all_to_all", n) == n - 1  # a new partner every step
        assert emulated.starts("sharded_ps", n) == 2 * (n - 1) and emulated.starts("ps", n) == n
    assert [emulated.starts("tree", n) for n in (2, 3, 4, 6, 8)] == [1, 3, 2, 4, 3]  # log2 p, + 2 for a fold-in
    assert [emulated.starts("rabenseifner", n) for n in (2, 4, 8)] == [1, 3, 5]  # the gather meets the last again
    assert emulated.starts("ring", 1) == 0
    with pytest.raises(ValueError, match="unknown"):
        emulated.starts("butterfly", 4)


def test_with_a_core_per_rank_the_waits_are_the_adds_an_exchange_follows():
    # ranks <= cores: no partner is descheduled, so a new partner costs nothing; an exchange that
    # follows an add waits for the partner's add (the course's collectives, in 2 MiB pieces)
    piece = 2 * MiB
    assert emulated.starts("all_to_all", 2, 64 * MiB, None, cores=2) == 0  # one exchange, no add
    assert emulated.starts("all_to_all", 4, 64 * MiB, None, cores=2) == 3  # shared cores: a wait per partner
    assert [emulated.starts("ring", 2, mb * MiB, piece, cores=2) for mb in (1, 16, 64)] == [1, 4, 16]
    assert [emulated.starts("tree", 2, mb * MiB, piece, cores=2) for mb in (1, 16, 64)] == [0, 7, 31]
    assert emulated.starts("ring", 4, 16 * MiB, piece, cores=4) == 3 * 2  # 3 reduce-scatter steps of 2 pieces
    assert emulated.starts("reduce_scatter", 4, 16 * MiB, piece, cores=4) == 5  # ends on its last add
    assert emulated.starts("all_gather", 4, 16 * MiB, piece, cores=8) == 0
    # recursive doubling on 3 ranks: rank 0 adds rank 2's 8 pieces, then 8 pieces of 1 round, then
    # sends the answer back: every one of its 16 adds is followed by an exchange
    assert emulated.starts("tree", 3, 16 * MiB, piece, cores=4) == 16
    assert emulated.starts("rabenseifner", 4, 16 * MiB, None, cores=4) == 2  # halving adds; the gather adds none
    assert emulated.starts("rabenseifner", 3, 16 * MiB, piece, cores=4) == 1 + 8  # + the folded-in pieces
    assert emulated.starts("ps", 4, MiB, None, cores=4) == 3 and emulated.starts("sharded_ps", 4, MiB, None, cores=4) == 1
    assert emulated.starts("ring", 1, MiB, piece, cores=2) == 0
    # where ranks outnumber cores, or cores are not given, the partner count (test above) holds
    assert emulated.starts("tree", 4, 16 * MiB, piece, cores=2) == emulated.starts("tree", 4) == 2
    with pytest.raises(ValueError, match="unknown"):
        emulated.adds_before_exchanges("butterfly", MiB, 4)


def test_exchanges_follow_adds_only_when_ranks_outnumber_cores():
    """A rank with a core of its own is never descheduled while it adds; with more ranks than
    cores it is (emulated_fit.after_compute)."""
    assert emulated_fit.after_compute(4, 2) and emulated_fit.after_compute(3, 2)
    assert not emulated_fit.after_compute(2, 2) and not emulated_fit.after_compute(2, 4)


def _accumulated(after_add: bool) -> list:
    import torch
    import torch.distributed as dist

    buffers = emulated_fit._buffers([1 << 16, 1 << 22])  # 16 exchanges, then 4 (see _pass)
    for out, _, _ in buffers:
        out.fill_(1)  # each received message is bytes 0x01, read as float32
    rank = dist.get_rank()
    seconds = emulated_fit._pass(buffers, 1 - rank, 1 - rank, after_add)
    one = torch.ones(1, dtype=torch.uint8).repeat(4).view(torch.float32).item()
    return [all(s >= 0 for s in seconds)] + [bool(torch.all(acc == steps * one)) for (_, _, acc), steps in
                                             zip(buffers, (16, 4))]


@pytest.mark.gloo_only("the alpha-beta-gamma micro-benchmarks model emulated CPU ranks: their buffers live in host "
                       "memory on purpose, which NCCL's rules refuse")
def test_after_add_every_received_message_is_added_once():
    """_pass(after_add=True) adds each message it received into the accumulator (the adds timed
    alone first add the still-empty receive buffer: zeros); back to back adds nothing. The sums
    are exact: a few small multiples of one float32 value."""
    from course_lib.runtime import run_on_ranks

    assert run_on_ranks(_accumulated, True, world_size=2, timeout_s=60) == [[True, True, True]] * 2
    assert run_on_ranks(_accumulated, False, world_size=2, timeout_s=60) == [[True, False, False]] * 2


def test_the_all_to_all_copies_its_own_part_at_the_shared_copy_rate():
    """k = 2 S/N / copy_all for the all-to-all (its own part read and written), 0 for collectives
    that work in place; powers of two, so exact."""
    c = line(copy_cores=2.0**33, copy_all=2.0**31)
    for n in (2, 4, 8):
        assert emulated.terms("all_to_all", 64 * MiB, n, c)["copy"] == 2 * 64 * MiB / n / 2.0**31
        for algorithm in ("ring", "tree", "reduce_scatter", "all_gather"):
            assert emulated.terms(algorithm, 64 * MiB, n, c)["copy"] == 0.0
    assert emulated.predict("all_to_all", 64 * MiB, 1, c) == 0.0  # one rank: no collective


def test_exchanges_after_an_add_are_priced_by_their_own_table_where_ranks_share_cores():
    """x+(m): where ranks outnumber cores, the busiest rank's exchanges that follow an add
    (adds_before_exchanges) are priced by the after-add table, the rest back to back. The ring
    on 4 ranks: 3 of its 6 exchanges follow an add; the all-to-all's none. With a core per rank
    the table is not read (the start t0 prices that wait instead). Tables of powers of two: the
    mixes below are exact."""
    c = convex(cores=2)
    slower = EmulatedConstants(c.sizes, c.seconds, c.gamma, c.cores, c.copy_cores, c.copy_all,
                               after_add=tuple(2 * t for t in c.seconds))
    x = emulated.exchange_time(MiB / 4, c)
    assert emulated.exchange_time(MiB / 4, slower, after_add=True) == 2 * x
    assert emulated.terms("ring", MiB, 4, slower)["messages"] == 3 * x + 3 * 2 * x
    assert emulated.terms("all_to_all", MiB, 4, slower)["messages"] == emulated.terms("all_to_all", MiB, 4, c)["messages"]
    assert emulated.terms("tree", 8 * MiB, 4, slower)["messages"] == pytest.approx(  # 1 of 2 rounds after an add
        emulated.exchange_time(8 * MiB, c) * 3, rel=1e-12)  # (1/2 x + 1/2 x+) per message, 2 messages; rounding
    own_core = EmulatedConstants(c.sizes, c.seconds, c.gamma, 8, c.copy_cores, c.copy_all, after_add=slower.after_add)
    assert emulated.terms("ring", MiB, 4, own_core)["messages"] == 6 * x
    with pytest.raises(ValueError, match="after_add"):
        EmulatedConstants(c.sizes, c.seconds, c.gamma, 2, after_add=(1.0,))


def test_fit_reads_the_after_add_table_when_measured():
    table = [ALPHA + s / BETA for s in emulated_fit.EXCHANGE_SIZES]
    adds = [1e-6 + s * 1e-10 for s in emulated_fit.ADD_SIZES]
    rank0 = {"exchange": table, "exchange_after_add": [2 * t for t in table], "add": adds, "copy_cores": 1e9,
             "copy_all": 1e9}
    others = {"exchange": None, "exchange_after_add": None, "add": None, "copy_cores": None, "copy_all": 1e9}
    assert emulated_fit.fit_constants([rank0, others, others], cores=2).after_add == tuple(2 * t for t in table)
    assert emulated_fit.fit_constants([rank0 | {"exchange_after_add": None}, others], cores=2).after_add == ()
