"""The step-time model against measured runs: nineteen layouts of one model on 8 gloo ranks.

Calibrates the model here (course_lib.measure.calibrate.probe on every rank at once: the
model's forward+backward at a few micro-batch sizes -> fixed cost per layer and FLOP/s; the
optimizer per tensor and flat -> cost per tensor and bandwidth; a table of collective times
per op, group size and bytes), then times each layout with the course's own strategy (DDP, ZeRO 1-3, tensor
parallelism, GPipe and 1F1B pipelines, notebook 10's hybrid meshes and their full composition with
ZeRO-2/3 and sequence parallelism), predicts each with
course_lib.estimate.step_time and prints both side by side: the rank correlation, the median error, and the planner's pick against the fastest measured.

The measurement is stored in course_lib/assets/planner_validation.json (notebook 11 reads it
rather than spending minutes re-measuring): `python benchmarks/bench_planner.py --store`.
`--quick` (2 steps, 1 round, QUICK_LAYOUTS only, the collective table at QUICK_PROBE_SIZES,
nothing recorded or stored) is a smoke test of the same calls: every trainer and every option
train_as reads from a layout, in seconds.
Calibration and layouts alternate over --rounds; a layout's time in a round is the slowest
rank's time of a step, the fastest of the steps after the first, and its measured time the
median of its rounds; the calibration keeps each probed quantity at its median round
(calibrate.median_of_rounds). Medians on both sides: on this shared machine the speed drifts
from minute to minute, and the fastest of each part on its own adds up to a step faster than
any that ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from summary import QUICK_ROUNDS, add_quick, quick_mode, record, shown_verdict  # noqa: E402

from course_lib.data import CharDataset  # noqa: E402
from course_lib.measure.calibrate import cluster_to_dict  # noqa: E402
from course_lib.dims import ParallelDims  # noqa: E402
from course_lib.measure.validation import DEFAULT_PATH, compare  # noqa: E402
from course_lib.model import GPTConfig  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

WORLD, BATCH, SEQ = 8, 16, 32

# (label, layout, which trainer runs it: course_lib.measure.validation.train_as); every layout
# runs the same global batch BATCH
LAYOUTS = [
    ("DDP dp8", ParallelDims(dp=8), "dp"),
    ("DDP dp8, 2 micro-batches", ParallelDims(dp=8, microbatches=2), "dp"),
    ("ZeRO-1 dp8", ParallelDims(dp=8, zero=1), "zero"),
    ("ZeRO-2 dp8", ParallelDims(dp=8, zero=2), "zero"),
    ("ZeRO-3 dp8", ParallelDims(dp=8, zero=3), "zero"),
    ("TP tp8", ParallelDims(tp=8), "tp"),
    ("ZeRO-2 dp8, 2 micro-batches", ParallelDims(dp=8, microbatches=2, zero=2), "zero"),
    ("GPipe pp8 m8", ParallelDims(pp=8, microbatches=8, schedule="gpipe"), "pp"),
    ("1F1B pp8 m8", ParallelDims(pp=8, microbatches=8), "pp"),
    ("1F1B pp8 m16", ParallelDims(pp=8, microbatches=16), "pp"),
    # notebook 10's hybrid runs (course_lib.parallel.hybrid): several dimensions on one mesh
    ("dp4 x tp2", ParallelDims(dp=4, tp=2), "hybrid"),
    ("dp2 x tp4", ParallelDims(dp=2, tp=4), "hybrid"),
    ("dp2 x pp4 m4", ParallelDims(dp=2, pp=4, microbatches=4), "hybrid"),
    ("tp2 x pp4 m4", ParallelDims(tp=2, pp=4, microbatches=4), "hybrid"),
    ("dp2 x tp2 x pp2 ZeRO-1 m2", ParallelDims(dp=2, tp=2, pp=2, microbatches=2, zero=1), "hybrid"),
    # the full composition (course_lib.parallel.hybrid.zero_pp): ZeRO-2/3 reduce once per step
    # across the micro-batches; stage 3 gathers each unit per micro-batch, or once per step
    ("dp2 x tp2 x pp2 ZeRO-2 m2", ParallelDims(dp=2, tp=2, pp=2, microbatches=2, zero=2), "hybrid"),
    ("dp2 x tp2 x pp2 ZeRO-3 m2", ParallelDims(dp=2, tp=2, pp=2, microbatches=2, zero=3), "hybrid"),
    ("dp2 x tp2 x pp2 ZeRO-3 m2, kept", ParallelDims(dp=2, tp=2, pp=2, microbatches=2, zero=3,
                                                    reshard_after_forward=False), "hybrid"),
    ("dp2 x tp2 x pp2 SP m2", ParallelDims(dp=2, tp=2, pp=2, microbatches=2, zero=1, sequence_parallel=True),
     "hybrid"),
]
# --quick: one layout per kind of run that still uses every option (accumulation, ZeRO stage,
# sequence_parallel, schedule and m, a hybrid mesh with ZeRO and micro-batches)
QUICK_LAYOUTS = ["DDP dp8, 2 micro-batches", "ZeRO-2 dp8, 2 micro-batches", "TP tp8", "1F1B pp8 m8",
                 "dp2 x tp2 x pp2 ZeRO-1 m2", "dp2 x tp2 x pp2 ZeRO-3 m2, kept"]
QUICK_PROBE_SIZES = (4, 1 << 16, 1 << 20)  # bytes; the full run measures calibrate.TABLE_SIZES
assert set(QUICK_LAYOUTS) <= {label for label, _, _ in LAYOUTS}, "QUICK_LAYOUTS names a layout not in LAYOUTS"


def model_config() -> GPTConfig:
    vocab = CharDataset("train", SEQ).vocab_size
    return GPTConfig(vocab_size=vocab, block_size=SEQ, n_layer=8, n_head=8, d_model=64)


def _time_layouts(config, train_cfg, runs, rounds, probe_sizes=None):
    """Rank code: `rounds` times, calibrate (probe) then run every layout in turn on the world.
    Returns (probes per round, per round and layout the step seconds)."""
    from course_lib.measure.calibrate import probe
    from course_lib.measure.validation import train_as
    from course_lib.runtime.groups import scoped_groups

    def scoped(fn, *args):  # each layout's groups (and their threads) end with it, so no layout runs
        with scoped_groups():  # beside the idle groups of those before it (course_lib.runtime.groups)
            return fn(*args)

    probes, times = [], []
    for _ in range(rounds):
        probes.append(scoped(probe, config, 2, config.block_size, probe_sizes))
        times.append([scoped(train_as, kind, dims, config, train_cfg).step_seconds for dims, kind in runs])
    return probes, times


def measure(config, steps: int = 4, rounds: int = 2, timeout_s: float = 600, layouts=LAYOUTS, probe_sizes=None):
    """(Cluster, raw calibration, runs): runs = [{"label", "layout", "step_seconds" (per round, the
    slowest rank per step), "measured"}] for `layouts` (default LAYOUTS). Calibration (its
    collective table at probe_sizes, default calibrate.TABLE_SIZES) and layouts alternate over
    `rounds`, and each quantity keeps its median round: the calibration's (median_of_rounds),
    each layout's fastest step after the first in a round."""
    from course_lib.measure.calibrate import cluster_from_probes, median_of_rounds
    from course_lib.runtime import run_on_ranks

    train_cfg = TrainConfig(steps=steps, batch_size=BATCH, progress=False, eval_every=0)
    # check_collectives=False: its extra check before every collective would be timed too
    per_rank = run_on_ranks(_time_layouts, config, train_cfg, [(dims, kind) for _, dims, kind in layouts], rounds,
                            probe_sizes,
                            world_size=WORLD, timeout_s=timeout_s, check_collectives=False)
    cluster, raw = cluster_from_probes([median_of_rounds(probes) for probes, _ in per_rank], config, 2, SEQ)
    runs = []
    for i, (label, lay, _) in enumerate(layouts):
        slowest = [[max(times[k][i][s] for _, times in per_rank) for s in range(steps)] for k in range(rounds)]
        runs.append({"label": label, "layout": dataclasses.asdict(lay), "step_seconds": slowest,
                     "measured": statistics.median(min(per_round[1:]) for per_round in slowest)})
    return cluster, raw, runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", action="store_true", help=f"write {DEFAULT_PATH.name} for notebook 11")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_PATH, help="where --store writes")
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, steps=2, rounds=QUICK_ROUNDS)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        parser.error("need --steps >= 2 (the first step of a layout is not timed) and --rounds >= 1")
    if args.quick and args.store:
        parser.error("--quick measures nothing worth storing: leave out --store")
    quick_mode(args)
    config = model_config()
    layouts = [lay for lay in LAYOUTS if lay[0] in QUICK_LAYOUTS] if args.quick else LAYOUTS
    cluster, raw, runs = measure(config, args.steps, args.rounds, layouts=layouts,
                                 probe_sizes=QUICK_PROBE_SIZES if args.quick else None)
    result = compare(config, cluster, runs, BATCH, SEQ, "fp32")
    print(f"calibrated: {cluster.achievable_flops / 1e9:.3g} GFLOP/s per rank, "
          f"{cluster.layer_overhead * 1e3:.3g} ms per layer and micro-batch, "
          f"{cluster.tensor_overhead * 1e6:.3g} us per optimizer tensor; all-reduce line alpha "
          f"{cluster.intra.alpha * 1e6:.3g} us, beta {cluster.intra.beta / 1e9:.3g} GB/s")
    print(f"{'layout':<28}{'measured ms':>12}{'predicted ms':>14}{'error':>8}")
    for r in result["rows"]:
        print(f"{r['label']:<28}{r['measured'] * 1e3:12.1f}{r['predicted'] * 1e3:14.1f}{r['error']:8.0%}")
    print(f"rank correlation {result['spearman']:.2f}, median |error| {result['median_error']:.0%}, "
          f"planner's pick {result['pick']!r}: {result['pick_over_best']:.2f} x the fastest measured")
    ratios = [("rank correlation, predicted vs measured step time", result["spearman"], 0.9, "higher"),
              ("planner's pick / fastest measured step time", result["pick_over_best"], 1.10, "lower"),
              ("median |predicted - measured| / measured", result["median_error"], None, "lower")]
    for what, ratio, target, better in ratios:
        goal = "" if target is None else f"target {'<=' if better == 'lower' else '>='} {target:g}"
        print(f"  {what:<52} {ratio:6.3f}   {goal:<14} "
              f"{shown_verdict({'ratio': ratio, 'target': target, 'better': better, 'spread': None})}")
        if not args.no_record:
            record("bench_planner", what, ratio, target=target, better=better)
    if args.store:
        load = os.getloadavg()
        data = {"config": dataclasses.asdict(config), "batch": BATCH, "seq": SEQ, "world_size": WORLD,
                "cluster": cluster_to_dict(cluster), "calibration": raw, "runs": runs,
                "produced_by": f"python benchmarks/bench_planner.py --store --steps {args.steps} --rounds {args.rounds}",
                "machine_load": f"load average {load[0]:.1f} on {os.cpu_count()} cores",
                "date": datetime.date.today().isoformat()}
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"stored {args.out}")


if __name__ == "__main__":
    main()
