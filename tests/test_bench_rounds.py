"""benchmarks/rounds.py's median_interval: the spread bench_collectives records beside a median of
paired calls. Pure functions on made-up numbers; no time is measured or asserted."""

import importlib.util
import pathlib
import statistics

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def rounds(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # rounds.py imports summary.py beside it
    spec = importlib.util.spec_from_file_location("_bench_rounds", BENCH / "rounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_median_interval_holds_the_median_and_narrows_with_more_calls(rounds):
    few = [i / 10 for i in range(11)]  # 0.0 .. 1.0, median 0.5, quartiles 0.25 and 0.75
    many = [i / 200 for i in range(201)]  # the same spread of single calls, 201 of them
    for values in (few, many):
        lo, hi = rounds.median_interval(values)
        assert lo <= statistics.median(values) <= hi
        q1, _, q3 = rounds.quartiles(values)
        assert q1 == pytest.approx(0.25) and q3 == pytest.approx(0.75)  # inclusive quartiles, float steps
    lo_few, hi_few = rounds.median_interval(few)
    lo_many, hi_many = rounds.median_interval(many)
    # a median of 201 calls is pinned about sqrt(201 / 11) ~ 4x tighter than one of 11; the calls'
    # quartiles (0.25-0.75 for both) do not narrow at all: the mutant that records them fails here
    assert hi_many - lo_many < 0.5 * (hi_few - lo_few)
    assert hi_many - lo_many < 0.5 * (0.75 - 0.25)


def test_median_interval_is_seeded_and_exact_for_equal_values(rounds):
    values = [0.93, 0.97, 1.02, 0.88, 0.95, 1.10, 0.91]
    assert rounds.median_interval(values) == rounds.median_interval(values)  # seeded: the same draws
    assert rounds.median_interval([0.9] * 5) == (0.9, 0.9)
    assert rounds.median_interval([1.25]) == (1.25, 1.25)
    lo, hi = rounds.median_interval(values)
    assert min(values) <= lo <= hi <= max(values)  # a median of draws from the values lies among them
