"""Predicted against measured step times (notebook 11): the numbers that say how good the model is.

    spearman(xs, ys)                 rank correlation (ties get their mean rank)
    compare(config, cluster, runs)   per run: predicted terms beside the measured time; summary
    load_validation(path)            the stored measurement (benchmarks/bench_planner.py wrote it)
    train_as(kind, dims, config, train_cfg)  rank code: train the layout `dims` with one of the
                                             course's trainers

A run is {"label", "layout": course_lib.dims.ParallelDims fields, "measured": seconds}, all on
one global batch (the stored "batch"). The summary holds the rank
correlation, the median and largest |predicted - measured| / measured, and the planner's pick
(the run predicted fastest) against the fastest measured.
"""

from __future__ import annotations

import json
import pathlib
import statistics

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
    errors = [abs(r["error"]) for r in rows]
    return {"rows": rows, "spearman": spearman(pred, meas), "median_error": statistics.median(errors),
            "max_error": max(errors), "pick": pick["label"], "pick_over_best": pick["measured"] / min(meas)}


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
