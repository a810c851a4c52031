"""Predicted against measured step times (notebook 11): the numbers that say how good the model is.

    spearman(xs, ys)                 rank correlation (ties get their mean rank)
    compare(config, cluster, runs)   per run: predicted terms beside the measured time; summary
    load_validation(path)            the stored measurement (benchmarks/bench_planner.py wrote it)
    summarize(predicted, measured)   rank correlation, median |error|, signed median, share over/under
    step_periods(durations, ends)    one round of a layout: its steps' times over all ranks
    round_seconds(step_seconds)      a layout's time per round (its fastest step after the first);
    measured_seconds(step_seconds)   and over the rounds (their median)
    round_order(n, k, rounds)        the order of n layouts in round k (moved and turned round by round)
    bootstrap_rounds(n, statistic)   statistic(rounds drawn with replacement), many times: the spread
    interval(values, level)          the central `level` share of values (low, high)
    wait_until_idle(cores, max_wait_s)  before measuring: wait (bounded) for the load to fall below cores
    train_as(kind, dims, config, train_cfg)  rank code: train the layout `dims` with one of the
                                             course's trainers

A run is {"label", "layout": course_lib.dims.ParallelDims fields, "measured": seconds}, all on
one global batch (the stored "batch"). The summary holds the rank
correlation, the median and largest |predicted - measured| / measured, the signed median and the
shares predicted slower and faster (summarize), and the planner's pick (the run predicted
fastest) against the fastest measured.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import statistics
import time

from course_lib.dims import ParallelDims
from course_lib.estimate.step_time import step_time
from course_lib.measure.calibrate import cluster_from_dict
from course_lib.model import GPTConfig
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.parallel.hybrid import train_hybrid
from course_lib.parallel.pp.training import train_pipeline
from course_lib.parallel.tp.training import train_tensor_parallel
from course_lib.parallel.zero.training import train_zero

DEFAULT_PATH = pathlib.Path(__file__).resolve().parents[1] / "assets" / "planner_validation.json"


def _ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs, ys) -> float:
    """Pearson correlation of the ranks: 1 when the two orderings agree exactly."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need two equally long lists of >= 2 values, got {len(xs)} and {len(ys)}")
    rx, ry = _ranks(list(xs)), _ranks(list(ys))
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def compare(config, cluster, runs, batch_size: int, seq: int | None = None, recipe: str = "fp32") -> dict:
    """{"rows": [{"label", "measured", "predicted", "error", terms...}], "spearman",
    "median_error", "max_error", "pick" (label predicted fastest), "pick_over_best" (its
    measured time / the fastest measured)}."""
    rows = []
    for run in runs:
        t = step_time(config, ParallelDims(**run["layout"]), cluster, batch_size, seq, recipe)
        rows.append({"label": run["label"], "measured": run["measured"], "predicted": t["total"],
                     "error": (t["total"] - run["measured"]) / run["measured"], "terms": t})
    pred, meas = [r["predicted"] for r in rows], [r["measured"] for r in rows]
    pick = min(rows, key=lambda r: r["predicted"])
    return summarize(pred, meas) | {"rows": rows, "pick": pick["label"],
                                    "pick_over_best": pick["measured"] / min(meas)}


def summarize(predicted, measured) -> dict:
    """{"spearman", "median_error" (median |p - m| / m), "max_error", "signed_median_error"
    (median (p - m) / m: below 0 when the model predicts faster than runs), "over_share" and
    "under_share" (the share of runs predicted slower, and faster, than measured)}. A model whose
    errors are all of one sign has a systematic error that a small median hides."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError(f"need equally long non-empty lists, got {len(predicted)} and {len(measured)}")
    signed = [(p - m) / m for p, m in zip(predicted, measured)]
    errors = [abs(e) for e in signed]
    return {"spearman": spearman(predicted, measured), "median_error": statistics.median(errors),
            "max_error": max(errors), "signed_median_error": statistics.median(signed),
            "over_share": sum(e > 0 for e in signed) / len(signed),
            "under_share": sum(e < 0 for e in signed) / len(signed)}


def step_periods(durations, ends) -> list[float]:
    """One round of a layout, from every rank's TrainResult.step_seconds (`durations[r]`) and
    step_ends (`ends[r]`): [the slowest rank's first step, then for each later step s its period,
    the last rank's end of step s minus the last rank's end of step s-1].

    A period is the time step s added to the run, what tokens per second divides by, and what
    the step-time model predicts. The slowest rank's duration of a step overstates it: ranks
    sharing cores end a step at different times (the optimizer takes 6-34 ms on different ranks
    of one DDP step here), so they start the next one at different times too, and a rank that
    starts early waits inside its step for the late ones. Measured on 8 ranks, DDP dp8: periods
    90-122 ms, the slowest rank's durations of the same steps 108-166 ms. The first step has no
    period (nothing ended before it); it is not timed anyway (round_seconds)."""
    if not durations or len(durations) != len(ends) or any(len(e) != len(durations[0]) or len(d) != len(e)
                                                          for d, e in zip(durations, ends)):
        raise ValueError("need one step_seconds and one step_ends list per rank, all of one length; got "
                         f"{[len(d) for d in durations]} and {[len(e) for e in ends]}")
    last = [max(e[s] for e in ends) for s in range(len(ends[0]))]
    return [max(d[0] for d in durations)] + [b - a for a, b in zip(last, last[1:])]


def round_seconds(step_seconds) -> list[float]:
    """A layout's time in each round: step_seconds[round][step] (step_periods: a step's period over
    all ranks), the fastest step after the first (the first builds caches and groups)."""
    if any(len(steps) < 2 for steps in step_seconds):
        raise ValueError("every round needs >= 2 steps: the first is not timed")
    return [min(steps[1:]) for steps in step_seconds]


def measured_seconds(step_seconds) -> float:
    """A layout's measured time: the median over rounds of round_seconds. The median, not the
    fastest round: a step is predicted from calibration rounds taken the same way (calibrate.
    median_of_rounds), and the fastest of each separately is a machine no step ran on."""
    return statistics.median(round_seconds(step_seconds))


def round_order(n: int, k: int, rounds: int) -> list[int]:
    """The order of n layouts in round k of `rounds`: started at a different layout each round
    (offsets spread over the whole list) and walked backwards in odd rounds. In the same order
    every round, the layouts late in it would always meet the machine late in a round (and the
    same neighbour before them); this way a load spike or a drift within a round falls on
    different layouts in different rounds, and the median over rounds evens it out."""
    if n < 1 or rounds < 1 or not 0 <= k < rounds:
        raise ValueError(f"need n >= 1, rounds >= 1 and 0 <= k < rounds, got n={n}, k={k}, rounds={rounds}")
    offset = k * n // rounds
    order = [(i + offset) % n for i in range(n)]
    return order[::-1] if k % 2 else order


def bootstrap_rounds(n_rounds: int, statistic, samples: int = 200, seed: int = 0) -> list:
    """[statistic(rounds)] for `samples` lists of n_rounds round indices drawn with replacement
    (seeded). The spread of a statistic computed from the median of n rounds, as another run of
    n rounds on the same machine would give it (Efron and Tibshirani, 1993): one run can then say
    how far a second would land."""
    if n_rounds < 2 or samples < 1:
        raise ValueError(f"need n_rounds >= 2 (one round has no spread) and samples >= 1, got {n_rounds}, {samples}")
    rng = random.Random(seed)
    return [statistic([rng.randrange(n_rounds) for _ in range(n_rounds)]) for _ in range(samples)]


def interval(values, level: float = 0.9) -> tuple[float, float]:
    """(low, high): the central `level` share of values (nearest-rank quantiles)."""
    if not values or not 0 < level <= 1:
        raise ValueError(f"need values and 0 < level <= 1, got {len(values)} values, level={level}")
    xs = sorted(values)
    tail = (1 - level) / 2
    return xs[int(tail * (len(xs) - 1) + 0.5)], xs[int((1 - tail) * (len(xs) - 1) + 0.5)]


def idle_enough(load1: float, cores: int) -> bool:
    """The machine counts as idle when its 1-minute load average is below its core count: fewer
    runnable processes than cores, so the ranks about to run are not sharing them with others."""
    return load1 < cores


def wait_until_idle(cores: int, max_wait_s: float = 60, poll_s: float = 5, load=os.getloadavg,
                    sleep=time.sleep, clock=time.monotonic) -> dict:
    """Before measuring: poll the 1-minute load average every poll_s until idle_enough, for at most
    max_wait_s. Returns {"idle", "load" (the last one read), "waited_s"}; the caller warns when
    "idle" is False (the measurement then ran beside other work)."""
    start = clock()
    while True:
        load1 = load()[0]
        waited = clock() - start
        if idle_enough(load1, cores) or waited >= max_wait_s:
            return {"idle": idle_enough(load1, cores), "load": load1, "waited_s": waited}
        sleep(min(poll_s, max_wait_s - waited))


def load_validation(path=None) -> dict:
    """The stored run: {"config", "batch", "seq", "cluster" (a Cluster), "calibration", "runs",
    "produced_by", "machine_load", "date"}."""
    data = json.loads(pathlib.Path(path or DEFAULT_PATH).read_text())
    data["config"] = GPTConfig(**data["config"])
    data["cluster"] = cluster_from_dict(data["cluster"])
    return data


TRAINERS = ("dp", "zero", "tp", "pp", "hybrid")  # train_as's kinds: which trainer runs a layout


def train_as(kind: str, dims: ParallelDims, config, train_cfg):
    """Rank code: train `config` in the layout `dims` with one of the course's trainers, the way
    benchmarks/bench_planner.py runs each layout; returns its TrainResult. The options come from
    dims: "dp" (DDP, microbatches accumulated), "zero" (stage dims.zero, microbatches
    accumulated), "tp" (dims.sequence_parallel), "pp" (dims.schedule, dims.microbatches) or
    "hybrid" (every field: the composed trainer). A single-axis trainer takes the whole world as
    its one axis: dims must have no other degree above 1."""
    if kind not in TRAINERS:
        raise ValueError(f"kind={kind!r} must be one of {TRAINERS}")
    if kind != "hybrid":
        axis = {"dp": "dp", "zero": "dp", "tp": "tp", "pp": "pp"}[kind]
        others = {d: getattr(dims, d) for d in ("dp", "tp", "pp", "ep") if d != axis and getattr(dims, d) > 1}
        if others:
            raise ValueError(f"kind={kind!r} trains one axis ({axis}); the layout {dims.describe()} also has "
                             f"{others}: use kind='hybrid'")
    m = dims.microbatches
    if kind == "dp":
        return train_data_parallel(config, train_cfg, "ddp", m)
    if kind == "zero":
        return train_zero(config, train_cfg, dims.zero, accum_steps=m)
    if kind == "tp":
        return train_tensor_parallel(config, train_cfg, dims.sequence_parallel)
    if kind == "pp":
        return train_pipeline(config, train_cfg, dims.schedule, m)
    return train_hybrid(dims, config, train_cfg)
