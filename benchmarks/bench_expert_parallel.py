"""Expert-parallel step time against the same MoE with every expert on every rank (data
parallel only), and the all-to-all's share of the expert-parallel step, in one run.

    .venv/bin/python benchmarks/bench_expert_parallel.py [--world-size 4] [--steps 5] [--rounds 5] [--quick]

4 gloo ranks train an MoE GPT (d_model 256, 2 layers, 8 experts, top-2, capacity factor 1.25)
on the same data both ways; the two give the same parameters (tests/test_expert_parallel.py).

    sharded     each rank holds 8/4 experts per layer; tokens go to them and back by
                all-to-all; only the dense gradients are all-reduced
    replicated  each rank holds all 8 experts and computes its own tokens; every gradient,
                the experts' included, is all-reduced

Same forward/backward FLOPs per rank either way; what differs is the communication (the
replicated run all-reduces every expert's gradient each step, the sharded one moves only the
routed token rows: 4 all-to-alls per layer and step) and the optimizer (replicated: every rank
updates all experts' weights; sharded: only its own). "sharded / replicated" below 1 is what expert
parallelism buys on top of the memory it saves (1/ep of the expert weights, gradients and
Adam state). The all-to-all share is the time inside all_to_all_single calls over the step time.

Method (as bench_data_parallel.py): a step's time is the slowest rank's, a run's the median of
its steps after WARMUP; each round runs both layouts on the same warm ranks in alternating
order; the ratio is paired per round and reported as the median over rounds with its
interquartile range. Ratios are recorded with benchmarks/summary.py.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rounds import quartiles  # noqa: E402
from summary import QUICK_ROUNDS, add_quick, quick_mode, record, shown_verdict  # noqa: E402  (benchmarks/ is not a package)

from course_lib import run_on_ranks  # noqa: E402
from course_lib.data import CharDataset  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.parallel.ep import train_expert_parallel  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

WARMUP = 1
LAYOUTS = ("sharded", "replicated")


def one_round(config, cfg, order):
    """Rank code: both layouts in turn. {layout: (step seconds, all-to-all seconds per step)}."""
    out = {}
    for layout in order:
        res = train_expert_parallel(config, cfg, experts=layout, record_timeline=True)
        a2a = sum(end - start for name, start, end, _ in res.timeline_events if name == "all_to_all_single")
        out[layout] = (res.step_seconds, a2a / cfg.steps)
    return out



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, world_size=2, steps=WARMUP + 1, rounds=QUICK_ROUNDS, micro_batch=1)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1 or args.world_size < 2 or 8 % args.world_size:
        parser.error(f"need --steps > {WARMUP}, --rounds >= 1, and --world-size in (2, 4, 8) to divide 8 experts")
    quick_mode(args)

    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=256, n_layer=2, n_head=8,
                            n_experts=8, top_k=2, capacity_factor=1.25)
    n_params = GPT(config).num_params()
    cfg = TrainConfig(steps=args.steps, batch_size=args.micro_batch * args.world_size, progress=False)
    print(f"{args.world_size} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__}; MoE GPT d_model={config.d_model} n_layer={config.n_layer} "
          f"{config.n_experts} experts top-{config.top_k}: {n_params / 1e6:.2f}M params; "
          f"{args.micro_batch} x {config.block_size} tokens per rank per step; {args.rounds} rounds")
    kw = dict(world_size=args.world_size, timeout_s=600, check_collectives=False)
    if not args.quick:  # warm-up
        run_on_ranks(one_round, config, TrainConfig(steps=1, batch_size=cfg.batch_size, progress=False), LAYOUTS, **kw)
    per_round = []
    start = time.perf_counter()
    for r in range(args.rounds):
        order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
        res = run_on_ranks(one_round, config, cfg, order, **kw)
        row = {}
        for layout in LAYOUTS:
            steps = [max(rank[layout][0][s] for rank in res) for s in range(WARMUP, cfg.steps)]
            row[layout] = statistics.median(steps)
        row["a2a share"] = max(rank["sharded"][1] for rank in res) / statistics.mean(
            max(rank["sharded"][0][s] for rank in res) for s in range(cfg.steps))
        per_round.append(row)

    print(f"\n{'experts':<14}{'median step (ms)':>18}{'quartiles (ms)':>20}")
    for layout in LAYOUTS:
        lo, mid, hi = quartiles([r[layout] for r in per_round])
        print(f"{layout:<14}{mid * 1e3:>18.1f}{f'{lo * 1e3:.1f}-{hi * 1e3:.1f}':>20}")
    print("\nratios, paired per round (median, interquartile spread):")
    ratios = {"expert parallel / experts replicated (step time)": ([r["sharded"] / r["replicated"] for r in per_round],
                                                                   1.0, "lower"),
              "all-to-all share of the expert-parallel step": ([r["a2a share"] for r in per_round], None, "lower")}
    for label, (values, target, better) in ratios.items():
        lo, mid, hi = quartiles(values)
        goal = "" if target is None else f"target <= {target:g}"
        row = {"ratio": mid, "target": target, "better": better, "spread": [lo, hi]}
        print(f"  {label:<50} {mid:6.3f}   ({lo:.3f}-{hi:.3f})  {goal:<14} {shown_verdict(row)}")
        if not args.no_record:
            record("bench_expert_parallel", label, mid, target=target, better=better, spread=(lo, hi))
    print(f"(measured in {time.perf_counter() - start:.0f} s; load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
