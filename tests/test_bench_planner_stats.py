"""The planner validation's repetition logic (course_lib.measure.validation, benchmarks/bench_planner.py):
the round medians, the layouts' order per round, the bootstrap spread, the signed errors and the
idle-machine check. Pure functions on made-up numbers; no time is measured or asserted (the idle
check runs on a fake clock)."""

import importlib.util
import pathlib
import statistics
import sys

import pytest

from course_lib.measure.validation import (
    bootstrap_rounds, compare, idle_enough, interval, load_validation, measured_seconds, round_order, round_seconds,
    step_periods, summarize, wait_until_idle)

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_summarize_signed_errors_and_shares():
    # measured 1, 2, 4, 8 s; predicted 1.5 (+50%), 1 (-50%), 4 (0%), 6 (-25%): binary fractions, exact
    s = summarize([1.5, 1.0, 4.0, 6.0], [1.0, 2.0, 4.0, 8.0])
    assert s["median_error"] == 0.375 and s["max_error"] == 0.5
    assert s["signed_median_error"] == -0.125
    assert s["over_share"] == 0.25 and s["under_share"] == 0.5  # the exact one counts as neither
    assert s["spearman"] == pytest.approx(0.8)  # ranks (2,1,3,4) vs (1,2,3,4): 1 - 6*2/(4*15); float sums
    with pytest.raises(ValueError, match="equally long"):
        summarize([1.0], [1.0, 2.0])


def test_compare_carries_the_signed_summary():
    data = load_validation()
    result = compare(data["config"], data["cluster"], data["runs"], data["batch"], data["seq"], "fp32")
    signed = [r["error"] for r in result["rows"]]
    assert result["signed_median_error"] == statistics.median(signed)
    assert result["over_share"] == sum(e > 0 for e in signed) / len(signed)
    assert result["under_share"] == sum(e < 0 for e in signed) / len(signed)
    assert result["median_error"] == statistics.median(abs(e) for e in signed)


def test_round_seconds_skip_the_first_step_and_take_the_median_round():
    steps = [[9.0, 3.0, 2.0], [9.0, 5.0, 4.0], [1.0, 7.0, 6.0]]  # the first step (9, 9, 1) never counts
    assert round_seconds(steps) == [2.0, 4.0, 6.0]
    assert measured_seconds(steps) == 4.0
    with pytest.raises(ValueError, match="2 steps"):
        round_seconds([[1.0]])


def test_step_periods_are_the_last_ends_apart_not_the_slowest_duration():
    # two ranks; rank 1 starts step 2 late (at 10) and ends it at 14, rank 0 started it at 6 and waited:
    # its duration 8 is the slowest, but the run took 14 - 10 = 4 for that step (exact binary values)
    durations = [[5.0, 8.0, 3.0], [4.0, 4.0, 4.0]]
    ends = [[5.0, 14.0, 17.0], [10.0, 14.0, 18.0]]
    assert step_periods(durations, ends) == [5.0, 4.0, 4.0]  # first: the slowest first step; then last-end gaps
    assert max(d[1] for d in durations) == 8.0  # what the slowest rank's duration would have said
    with pytest.raises(ValueError, match="one step_seconds and one step_ends list per rank"):
        step_periods(durations, ends[:1])
    with pytest.raises(ValueError, match="all of one length"):
        step_periods([[1.0, 2.0], [1.0]], [[1.0, 2.0], [1.0]])


def test_round_order_is_a_permutation_that_moves_every_layout():
    n, rounds = 19, 9
    orders = [round_order(n, k, rounds) for k in range(rounds)]
    assert orders[0] == list(range(n))
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) == rounds  # no two rounds alike
    # in one fixed order layout j would sit at position j every round (mean positions 0..18); here
    # every layout's mean position over the rounds is near the middle
    for j in range(n):
        mean = statistics.fmean(o.index(j) for o in orders)
        assert abs(mean - (n - 1) / 2) <= n / 4, (j, mean)
    # and a layout does not always follow the same one
    for j in range(n):
        before = {o[o.index(j) - 1] for o in orders if o.index(j) > 0}
        assert len(before) >= 2, (j, before)
    with pytest.raises(ValueError, match="0 <= k < rounds"):
        round_order(5, 3, 3)


def test_bootstrap_draws_rounds_with_replacement_seeded():
    draws = bootstrap_rounds(5, tuple, samples=200, seed=1)
    assert len(draws) == 200 and all(len(d) == 5 and set(d) <= set(range(5)) for d in draws)
    assert any(len(set(d)) < 5 for d in draws)  # with replacement: some round drawn twice
    assert draws == bootstrap_rounds(5, tuple, samples=200, seed=1)  # seeded: the same spread every time
    # a statistic that does not vary over rounds has no spread; one that does, has
    per_round = [1.0, 1.0, 1.0, 1.0, 1.0]
    assert set(bootstrap_rounds(5, lambda ks: statistics.median(per_round[k] for k in ks))) == {1.0}
    varying = [0.8, 0.9, 1.0, 1.1, 1.2]
    low, high = interval(bootstrap_rounds(5, lambda ks: statistics.median(varying[k] for k in ks)))
    assert 0.8 <= low < 1.0 < high <= 1.2
    with pytest.raises(ValueError, match="no spread"):
        bootstrap_rounds(1, tuple)


def test_interval_nearest_rank():
    assert interval(list(range(101)), 0.9) == (5, 95)
    assert interval([3.0], 0.9) == (3.0, 3.0)
    assert interval(list(range(101)), 1.0) == (0, 100)
    with pytest.raises(ValueError):
        interval([], 0.9)


class FakeClock:
    def __init__(self, loads):
        self.now, self.loads, self.slept = 0.0, list(loads), []

    def load(self):
        return (self.loads.pop(0) if len(self.loads) > 1 else self.loads[0], 0.0, 0.0)

    def sleep(self, s):
        self.slept.append(s)
        self.now += s

    def clock(self):
        return self.now


def test_idle_check_waits_until_the_load_falls():
    assert idle_enough(1.9, 2) and not idle_enough(2.0, 2)
    fake = FakeClock([5.0, 3.0, 1.5, 9.0])
    out = wait_until_idle(2, max_wait_s=60, poll_s=5, load=fake.load, sleep=fake.sleep, clock=fake.clock)
    assert out == {"idle": True, "load": 1.5, "waited_s": 10.0} and fake.slept == [5, 5]


def test_idle_check_gives_up_after_max_wait_and_says_busy():
    fake = FakeClock([8.0])
    out = wait_until_idle(2, max_wait_s=12, poll_s=5, load=fake.load, sleep=fake.sleep, clock=fake.clock)
    assert out == {"idle": False, "load": 8.0, "waited_s": 12.0}
    assert fake.slept == [5, 5, 2]  # never sleeps past the bound
    fake = FakeClock([1.0])
    assert wait_until_idle(2, max_wait_s=0, load=fake.load, sleep=fake.sleep, clock=fake.clock)["idle"]
    assert fake.slept == []


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("_bench_planner_stats", BENCH / "bench_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_rows_carry_the_targets_spread_and_warning(bench, capsys):
    result = {"spearman": 0.96, "median_error": 0.08, "signed_median_error": -0.02, "over_share": 0.4,
              "under_share": 0.6, "pick_over_best": 1.0}
    rounds = [dict(result, spearman=r) for r in (0.94, 0.96, 0.97)]
    boot = [dict(result, spearman=r, median_error=e) for r, e in ((0.93, 0.07), (0.96, 0.08), (0.99, 0.12))]
    busy = {"idle": False, "load": 7.5, "waited_s": 60.0}
    rows = bench.report(result, {"rounds": rounds, "bootstrap": boot, "loads": [7.5, 7.0, 6.0]}, busy, 6.5)
    by_what = {what: (ratio, target, better, spread, note) for what, ratio, target, better, spread, note in rows}
    rho = by_what["rank correlation, predicted vs measured step time"]
    assert rho[:4] == (0.96, 0.95, "higher", (0.93, 0.99))
    assert by_what["median |predicted - measured| / measured"][:4] == (0.08, 0.10, "lower", (0.07, 0.12))
    half, target, better = by_what["rank correlation, half-width of its 90% bootstrap"][:3]
    assert half == pytest.approx(0.03, abs=1e-12) and (target, better) == (0.03, "lower")  # (0.99 - 0.93) / 2 in floats
    assert by_what["errors' rarer sign: min(over, under) share"][:3] == (0.4, 0.25, "higher")
    assert all("machine busy: load 7.5" in note for *_, note in rows)
    out = capsys.readouterr().out
    assert "signed median error -2%: 40% of layouts predicted slower than measured, 60% faster" in out
    # too few rounds: no interval, and the half-width row says so with None
    rows = bench.report(result, {"rounds": rounds[:2], "bootstrap": None, "loads": [1.0, 1.0]},
                        {"idle": True, "load": 1.0, "waited_s": 0.0}, 1.0)
    assert rows[0][4] is None and rows[2][1] is None and all(note == "" for *_, note in rows)
