"""The measuring loop the strategy benchmarks share: variants timed side by side, in rounds.

Each round runs every variant once on the same ranks, in a rotated order (so no variant always
runs first, on a cooler or a warmer machine); a variant's time in a round is the median over
its steps after warm-up of the slowest rank's step. Ratios are formed per round (paired), then
summarised by their median and interquartile spread, which is what `summary.record` keeps.
"""

from __future__ import annotations

import statistics
import time

from course_lib import run_on_ranks
from course_lib.measure.validation import bootstrap_rounds, interval
from summary import QUICK_ROUNDS, add_quick, quick_mode, record, shown_verdict

WARMUP = 2  # steps of every run left out of the timing


def quartiles(values) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], q[1], q[2]


def median_interval(values, level: float = 0.9, samples: int = 400) -> tuple[float, float]:
    """(low, high): the central `level` share of the medians of `samples` bootstrap draws of
    `values` (validation.bootstrap_rounds, seeded): how far the median of as many calls would
    land in another run (Efron and Tibshirani, 1993). Unlike the quartiles of the calls
    themselves, it narrows as the calls grow in number (as 1 / sqrt(calls)). One value: a point."""
    if len(values) < 2:
        return values[0], values[0]
    return interval(bootstrap_rounds(len(values), lambda idx: statistics.median(values[i] for i in idx), samples),
                    level)


def step_time(per_rank_step_seconds: list[list[float]], warmup: int = WARMUP) -> float:
    """Median over the steps after warm-up of the slowest rank's step time."""
    steps = range(warmup, len(per_rank_step_seconds[0]))
    return statistics.median(max(rank[s] for rank in per_rank_step_seconds) for s in steps)


def run_rounds(one_round, names: list[str], rounds: int, args: tuple, warm_args: tuple | None,
               **run_kwargs) -> list[dict]:
    """Call `one_round(*args, order)` on the ranks `rounds` times (after one warm-up call with
    warm_args, unless it is None: a --quick run); one_round returns {name: step_seconds list}
    per rank. Returns per round {name: step_time}."""
    if warm_args is not None:
        run_on_ranks(one_round, *warm_args, names, **run_kwargs)
    per_round = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        res = run_on_ranks(one_round, *args, order, **run_kwargs)
        per_round.append({name: step_time([rank[name] for rank in res]) for name in names})
    return per_round


def report(bench: str, per_round: list[dict], ratios: dict, save: bool = True, started: float | None = None) -> None:
    """Print each variant's median step and each ratio {label: (numerator, denominator, target,
    better)} paired per round; record the ratios with summary.record unless save is False."""
    width = max(len(n) for n in per_round[0]) + 2
    print(f"\n{'variant':<{width}}{'median step (ms)':>18}{'quartiles (ms)':>20}")
    for name in per_round[0]:
        lo, mid, hi = quartiles([r[name] for r in per_round])
        print(f"{name:<{width}}{mid * 1e3:>18.1f}{f'{lo * 1e3:.1f}-{hi * 1e3:.1f}':>20}")
    print("\nratios, paired per round (median, interquartile spread):")
    width = max(len(label) for label in ratios) + 2
    for label, (num, den, target, better) in ratios.items():
        lo, mid, hi = quartiles([r[num] / r[den] for r in per_round])
        row = {"ratio": mid, "target": target, "better": better, "spread": [lo, hi]}
        goal = "" if target is None else f"target {'<=' if better == 'lower' else '>='} {target:g}"
        print(f"  {label:<{width}} {mid:6.3f}x  ({lo:.3f}-{hi:.3f})  {goal:<14} {shown_verdict(row)}")
        if save:
            record(bench, label, mid, target=target, better=better, spread=(lo, hi))
    if started is not None:
        print(f"\n{len(per_round)} rounds in {time.perf_counter() - started:.0f} s")


def rank_share_args(description: str, rounds: int, argv=None):
    """The command line of the benchmarks whose ranks each take a share of the batch
    (data parallel, ZeRO): --world-size, --steps, --rounds, --micro-batch, --no-record, --quick
    (2 ranks, WARMUP + 1 steps, 1 round, 1 sequence per rank), checked."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, world_size=2, steps=WARMUP + 1, rounds=QUICK_ROUNDS, micro_batch=1)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1 or args.world_size < 2 or args.micro_batch < 1:
        parser.error(f"need --steps > {WARMUP}, --rounds >= 1, --world-size >= 2, --micro-batch >= 1")
    quick_mode(args)
    return args
