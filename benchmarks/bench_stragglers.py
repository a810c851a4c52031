"""Stragglers: one slow rank under DDP (a sync every step) and under DiLoCo (H = 4 inner steps
between syncs), measured wall time against the straggler model (course_lib.estimate.stragglers).

    .venv/bin/python benchmarks/bench_stragglers.py [--world-size 2] [--steps 13] [--delay-ms 50] [--rounds 7] [--quick]

N gloo ranks train the DiLoCo demo's GPT (d_model 32, 4 layers). DDP is LocalSGD with one
replica (course_lib.parallel.diloco: the gradients all-reduced every step); DiLoCo has N replicas
of one rank. The last rank sleeps --delay-ms in every step (training.slowed) in the "+D" runs.

Method: after a warm-up round that is not counted, one round runs the four variants (DDP and DiLoCo, each with and without the slow rank)
on the same warm ranks, in an order rotated from round to round. A run's wall time is the
slowest rank's loop time from step 2 on (in step 1 the ranks also wait for one another to
arrive). The prediction for a "+D" run is its own variant's measured wall without the delay plus
what the model adds: wall_seconds(c, delays, H) - wall_seconds(c, no delays, H), c the
undelayed mean step (for a constant delay on one rank the addition is (steps - 1) D for both
DDP and DiLoCo: the slow replica is slow in every round). Ratios are paired per round and
reported as the median and interquartile spread; they are information, not targets:
"measured / predicted" near 1 says the model explains the straggler's cost, and "DiLoCo / DDP"
what meeting every H steps saves (the syncs), not the slow rank's time.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rounds import quartiles  # noqa: E402  (benchmarks/ is not a package)
from summary import QUICK_ROUNDS, add_quick, quick_mode, record, shown_verdict  # noqa: E402

import torch.distributed as dist  # noqa: E402

from course_lib import run_on_ranks  # noqa: E402
from course_lib.data import CharDataset  # noqa: E402
from course_lib.estimate.stragglers import constant_delays, wall_seconds  # noqa: E402
from course_lib.model import GPTConfig  # noqa: E402
from course_lib.parallel.diloco import train_diloco, train_local_sgd  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

H = 4
VARIANTS = ("DDP", "DDP +D", f"DiLoCo H={H}", f"DiLoCo H={H} +D")


def one_round(config, cfg, delay_s, order):
    """Rank code: every variant of `order` in turn; per variant (loop seconds, step seconds)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in order:
        d = delay_s if name.endswith("+D") and rank == world - 1 else 0.0
        if name.startswith("DDP"):
            r = train_local_sgd(config, cfg, 1, 1, delay_s=d)
        else:
            r = train_diloco(config, cfg, world, H, delay_s=d)
        out[name] = (r.seconds, r.step_seconds)
    return out


def measure(per_rank: list[dict], name: str) -> tuple[float, float]:
    """(wall from step 2 on: the slowest rank's, mean step from step 2 on: the least over ranks)."""
    wall = max(sec - steps[0] for sec, steps in (r[name] for r in per_rank))
    step = min(sum(steps[1:]) / len(steps[1:]) for _, steps in (r[name] for r in per_rank))
    return wall, step


def predictions(per_rank: list[dict], world: int, steps: int, delay_s: float) -> dict:
    """{variant: (measured wall, predicted wall)} for the two "+D" variants."""
    out = {}
    for base, h, replicas in (("DDP", 1, 1), (f"DiLoCo H={H}", H, world)):
        wall0, c = measure(per_rank, base)
        late = constant_delays(replicas, replicas - 1, delay_s, steps - 1)
        added = wall_seconds(c, late, h) - wall_seconds(c, [[0.0] * (steps - 1)] * replicas, h)
        out[base + " +D"] = (measure(per_rank, base + " +D")[0], wall0 + added)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=13, help="steps per run (timed from step 2)")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="the slow rank's sleep per step")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, steps=3, rounds=QUICK_ROUNDS)
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.steps < 2 or args.rounds < 1 or not args.delay_ms >= 0:
        parser.error("need --world-size >= 2, --steps >= 2, --rounds >= 1, --delay-ms >= 0")
    quick_mode(args)
    config = GPTConfig.tiny(CharDataset("train").vocab_size, block_size=32, n_layer=4, d_model=32)
    cfg = TrainConfig(steps=args.steps, batch_size=4 * args.world_size, lr=3e-3, progress=False)
    d = args.delay_ms / 1000
    print(f"{args.world_size} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}); "
          f"rank {args.world_size - 1} sleeps {args.delay_ms:g} ms a step in the +D runs; {args.steps} steps "
          f"(timed from step 2), {args.rounds} rounds")
    start = time.perf_counter()
    common = dict(world_size=args.world_size, timeout_s=600, check_collectives=False)
    if not args.quick:  # a warm-up round, not counted: the first runs on fresh ranks pay one-off costs
        run_on_ranks(one_round, config, cfg, d, list(VARIANTS), **common)
    rows = []
    for r in range(args.rounds):
        order = list(VARIANTS[r % 4:] + VARIANTS[:r % 4])
        per_rank = run_on_ranks(one_round, config, cfg, d, order, **common)
        walls = {name: measure(per_rank, name)[0] for name in VARIANTS}
        rows.append((walls, predictions(per_rank, args.world_size, args.steps, d)))
    print(f"\n{'variant':<16}{'wall from step 2 (ms)':>24}{'quartiles':>20}{'predicted (ms)':>16}")
    for name in VARIANTS:
        lo, mid, hi = quartiles([w[name] for w, _ in rows])
        pred = quartiles([p[name][1] for _, p in rows])[1] * 1e3 if name in rows[0][1] else None
        print(f"{name:<16}{mid * 1e3:>24.1f}{f'{lo * 1e3:.1f}-{hi * 1e3:.1f}':>20}"
              + (f"{pred:>16.1f}" if pred is not None else ""))
    ratios = {f"DDP, 1 slow rank +{args.delay_ms:g} ms: measured / predicted wall":
              [p["DDP +D"][0] / p["DDP +D"][1] for _, p in rows],
              f"DiLoCo H={H}, 1 slow rank: measured / predicted wall":
              [p[f"DiLoCo H={H} +D"][0] / p[f"DiLoCo H={H} +D"][1] for _, p in rows],
              f"DiLoCo H={H} / DDP wall, 1 slow rank": [w[f"DiLoCo H={H} +D"] / w["DDP +D"] for w, _ in rows],
              f"DiLoCo H={H} / DDP wall, no slow rank": [w[f"DiLoCo H={H}"] / w["DDP"] for w, _ in rows]}
    print("\nratios, paired per round (median, interquartile spread):")
    width = max(len(label) for label in ratios) + 2
    for label, values in ratios.items():
        lo, mid, hi = quartiles(values)
        row = {"ratio": mid, "target": None, "better": "lower", "spread": [lo, hi]}
        print(f"  {label:<{width}} {mid:6.3f}x  ({lo:.3f}-{hi:.3f})  {shown_verdict(row)}")
        if not args.no_record:
            record("bench_stragglers", label, mid, spread=(lo, hi))
    print(f"(measured in {time.perf_counter() - start:.0f} s; load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
