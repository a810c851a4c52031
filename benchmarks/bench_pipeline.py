"""Pipeline step time: every course schedule against the course's GPipe, and the course's
1F1B against torch.distributed.pipelining's Schedule1F1B on the same stages, in one run; the
V schedules (ZB-V, DualPipeV) against torch's ScheduleZBVZeroBubble / ScheduleDualPipeV and
against the course's 1F1B, and PipeDream-2BW against 1F1B.

    .venv/bin/python benchmarks/bench_pipeline.py [--world-size 4] [--microbatches 8] [--rounds 5] [--quick]

p = 4 gloo ranks train the course GPT (d_model 128, 8 blocks, 2 per stage) with m = 8
micro-batches per step. Method as bench_data_parallel: a step's time is the slowest rank's,
a run's time the median of its steps after WARMUP; one round runs every variant once on the
same warm ranks in an order rotated per round; ratios are paired per round and reported as
median and interquartile spread.

What to expect. "course 1F1B / torch 1F1B" near 1 (target <= 1.2) means our runner costs what
torch's does. The schedule ratios against GPipe depend on the machine: with ranks that own
their device, 1F1B's step equals GPipe's (same bubble), interleaved and zero bubble are
shorter; when 4 ranks share 2 cores, a waiting rank hands its core to another one, so the
bubble costs less time than the formula says and the ratios sit closer to 1. --action-ms adds
a fixed time per F, B, W (the notebook's way to show schedules on a crowded CPU).

ZB-V and DualPipeV run 2 chunks per rank (stages r and 2p-1-r; n_layer = 2p is one block per
stage). DualPipeV's overlapped F&B pairs run F then B on our single-threaded CPU ranks, so it
cannot beat ZB-V here. PipeDream-2BW needs an untied head and no global clip (pipedream.py): it is
compared with 1F1B on that same untied model without clipping; its "step" is the time between
two weight updates of a stage (it has no flush to mark a step).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rounds import WARMUP, report, run_rounds  # noqa: E402  (benchmarks/ is not a package)
from summary import QUICK_ROUNDS, add_quick, quick_mode  # noqa: E402

from course_lib.data import CharDataset  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.parallel.pp.native import train_native  # noqa: E402
from course_lib.parallel.pp.pipedream import check_2bw, train_2bw  # noqa: E402
from course_lib.parallel.pp.training import check_pipeline, train_pipeline  # noqa: E402
from course_lib.train import TrainConfig  # noqa: E402

TARGET_TORCH = 1.2  # course 1F1B / torch 1F1B
RUNS = {  # name -> (implementation, schedule, virtual stages)
    "course GPipe": ("course", "gpipe", 1),
    "course 1F1B": ("course", "1f1b", 1),
    "course interleaved 1F1B (v=2)": ("course", "interleaved_1f1b", 2),
    "course zero bubble (ZB-H1)": ("course", "zero_bubble", 1),
    "torch 1F1B": ("torch", "1f1b", 1),
    "course ZB-V": ("course", "zbv", 2),
    "torch ZB-V": ("torch", "zbv", 2),
    "course DualPipeV": ("course", "dualpipev", 2),
    "torch DualPipeV": ("torch", "dualpipev", 2),
    "course 1F1B (untied, no clip)": ("untied", "1f1b", 1),
    "course PipeDream-2BW (untied, no clip)": ("untied", "pipedream_2bw", 1),
}
RATIOS = {  # label -> (numerator, denominator, target, better)
    "course 1F1B / torch 1F1B": ("course 1F1B", "torch 1F1B", TARGET_TORCH, "lower"),
    "course 1F1B / course GPipe": ("course 1F1B", "course GPipe", None, "lower"),
    "course interleaved (v=2) / course GPipe": ("course interleaved 1F1B (v=2)", "course GPipe", None, "lower"),
    "course zero bubble / course GPipe": ("course zero bubble (ZB-H1)", "course GPipe", None, "lower"),
    "course ZB-V / torch ZB-V": ("course ZB-V", "torch ZB-V", TARGET_TORCH, "lower"),
    "course DualPipeV / torch DualPipeV": ("course DualPipeV", "torch DualPipeV", TARGET_TORCH, "lower"),
    "course ZB-V / course 1F1B": ("course ZB-V", "course 1F1B", None, "lower"),
    "course DualPipeV / course 1F1B": ("course DualPipeV", "course 1F1B", None, "lower"),
    "course PipeDream-2BW / course 1F1B (untied, no clip)": ("course PipeDream-2BW (untied, no clip)",
                                                             "course 1F1B (untied, no clip)", None, "lower"),
}


def untied(config, cfg):
    """PipeDream-2BW's setting (and its 1F1B baseline): no tied head, no global clip."""
    return dataclasses.replace(config, tie_weights=False), dataclasses.replace(cfg, grad_clip=0.0)


def one_round(config, cfg, m, action_seconds, order):
    """Rank code: train with every variant of `order` in turn; step seconds per variant."""
    out = {}
    for name in order:
        impl, schedule, v = RUNS[name]
        if impl == "torch":
            out[name] = train_native(config, cfg, schedule, m, v).step_seconds
        elif impl == "untied" and schedule == "pipedream_2bw":
            out[name] = train_2bw(*untied(config, cfg), m).step_seconds
        elif impl == "untied":
            out[name] = train_pipeline(*untied(config, cfg), schedule, m, v, action_seconds=action_seconds).step_seconds
        else:
            out[name] = train_pipeline(config, cfg, schedule, m, v, action_seconds=action_seconds).step_seconds
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--action-ms", type=float, default=0.0)
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, world_size=2, microbatches=4, micro_batch=1, steps=WARMUP + 1, rounds=QUICK_ROUNDS)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1 or args.world_size < 2 or args.action_ms < 0:
        parser.error(f"need --steps > {WARMUP}, --rounds >= 1, --world-size >= 2, --action-ms >= 0")
    quick_mode(args)
    config = GPTConfig.tiny(CharDataset("train").vocab_size, d_model=128, n_layer=2 * args.world_size, n_head=4)
    m = args.microbatches
    cfg = TrainConfig(steps=args.steps, batch_size=m * args.micro_batch, progress=False)
    try:
        for _, schedule, v in RUNS.values():
            if schedule == "pipedream_2bw":
                check_2bw(*untied(config, cfg)[:1], args.world_size, m, untied(config, cfg)[1])
            else:
                check_pipeline(config, args.world_size, schedule, m, cfg.batch_size, v)
    except ValueError as err:
        parser.error(str(err))
    pad = {k: args.action_ms / 1e3 for k in "FBW"} if args.action_ms else None
    print(f"{args.world_size} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__}; GPT d_model={config.d_model} n_layer={config.n_layer}: "
          f"{GPT(config).num_params() / 1e6:.2f}M params; m={m} micro-batches of {args.micro_batch} x "
          f"{config.block_size} tokens; {args.rounds} rounds" + (f"; {args.action_ms:g} ms per action" if pad else ""))
    names = list(RUNS)
    # check_collectives off: torch's schedules pair their own send/recv (and it would distort timings).
    kw = dict(world_size=args.world_size, timeout_s=600, check_collectives=False)
    start = time.perf_counter()
    warm = TrainConfig(steps=1, batch_size=cfg.batch_size, progress=False)
    per_round = run_rounds(one_round, names, args.rounds, (config, cfg, m, pad),
                           None if args.quick else (config, warm, m, pad), **kw)  # --quick: no warm-up call
    report("bench_pipeline", per_round, RATIOS, save=not args.no_record, started=start)


if __name__ == "__main__":
    main()
