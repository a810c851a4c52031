"""Live resharding against a round trip through the filesystem: trainer ZeRO-3 flat shards ->
generator tensor-parallel pieces (2 + 2 gloo ranks).

    .venv/bin/python benchmarks/bench_live_reshard.py [--reps 5] [--sizes 64 128 256] [--quick]

For GPTs of growing width, on one world of A=2 trainer ranks (each holds its ZeRO-3 flat shards
of the parameters) and B=2 generator ranks (each wants its tensor-parallel pieces), side by side
in one run, repetitions round-robin after one untimed warm-up round:

    live       course_lib.checkpoint.live.transfer: the plan's boxes, one packed buffer per
               (trainer, generator) pair, one batch_isend_irecv per rank
    file       the checkpoint's way: trainers save_sharded their boxes (course format, into a
               temporary directory), then generators read theirs (CheckpointReader.fill, the same
               box intersection, hashes not verified)

Both fill the generators' buffers bit for bit alike (checked every repetition). Each time is
wall time from a barrier to a barrier; the median over repetitions is reported, and the ratio
live / file goes to benchmarks/summary.py. Nothing here asserts on speed: on a shared 2-core
machine the numbers are noisy.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from summary import add_quick, quick_mode, record, shown_verdict  # noqa: E402  (benchmarks/ is not a package)

from course_lib import run_on_ranks  # noqa: E402
from course_lib.checkpoint.live import (  # noqa: E402
    flat_holdings,
    gpt_tp_placements,
    gpt_zero3_units,
    plan_transfer,
    split_holdings,
)
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.units import fmt_bytes  # noqa: E402

A, B = 2, 2


def measure(plan, config, root, reps):
    """Rank code: `reps` rounds of (live, file), alternating which runs first."""
    import torch
    import torch.distributed as dist

    from course_lib.checkpoint import CheckpointReader, Piece, save_sharded
    from course_lib.checkpoint.live import new_buffers, transfer
    from course_lib.comm.process_groups import new_groups

    me = dist.get_rank()
    trainers, _ = new_groups([range(A), range(A, A + B)])
    layout, r = (plan.src, me) if me < A else (plan.dst, me - A)
    if me < A:  # this trainer's flat shards, cut from the full parameters through its own boxes
        full = {n: p.detach() for n, p in GPT(config, seed=0).named_parameters()}
        buffers = new_buffers(layout, r)
        for h in layout.held[r]:
            h.view(buffers).copy_(full[h.name][h.box.slices()])
    times = {"live": [], "file": []}

    def pieces(bufs):
        return [Piece(f"model.{h.name}", layout.shapes[h.name], h.box, h.view(bufs)) for h in layout.held[r]]

    def live():
        return transfer(plan, buffers if me < A else None)

    def file(k):
        path = pathlib.Path(root) / f"c{k}"
        if me < A:
            save_sharded(path, pieces(buffers), group=trainers)
        dist.barrier()
        if me < A:
            return None
        out = new_buffers(layout, r)
        CheckpointReader(path, verify_hashes=False).fill(pieces(out))
        return out

    for k in range(reps + 1):  # round 0 warms up (the pairs' first connections), untimed
        got = {}
        for name in (("live", "file") if k % 2 == 0 else ("file", "live")):
            dist.barrier()
            t0 = time.perf_counter()
            got[name] = live() if name == "live" else file(k)
            dist.barrier()
            if k:
                times[name].append(time.perf_counter() - t0)
        if me >= A and not all(torch.equal(x, y) for x, y in zip(got["live"], got["file"])):
            raise AssertionError(f"generator {r}: live and file buffers differ")
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(p, argv, reps=1, sizes=[64])
    args = p.parse_args(argv)
    if args.reps < 1 or not args.sizes or any(d < 8 or d % 4 for d in args.sizes):
        p.error(f"need --reps >= 1 and every --sizes a multiple of 4, >= 8 (got {args.reps}, {args.sizes})")
    quick_mode(args)
    print(f"{'d_model':>7} {'params':>10} {'moved':>10} {'live':>9} {'file':>9} {'live/file':>9}")
    last = None
    for d in args.sizes:
        config = GPTConfig(vocab_size=97, block_size=64, n_layer=4, n_head=4, d_model=d)
        model = GPT(config, seed=0)
        shapes = {n: tuple(t.shape) for n, t in model.named_parameters()}
        plan = plan_transfer(flat_holdings(shapes, A, gpt_zero3_units(model)),
                             split_holdings(shapes, gpt_tp_placements(model, B)))
        root = tempfile.mkdtemp(prefix="bench_live_")
        try:
            res = run_on_ranks(measure, plan, config, root, args.reps, world_size=A + B, timeout_s=600,
                               check_collectives=False)  # the check adds a gather per collective
        finally:
            shutil.rmtree(root, ignore_errors=True)
        slowest = {k: [max(rank[k][i] for rank in res) for i in range(args.reps)] for k in ("live", "file")}
        t = {k: statistics.median(v) for k, v in slowest.items()}
        ratios = [lv / fl for lv, fl in zip(slowest["live"], slowest["file"])]
        params = sum(4 * p.numel() for p in model.parameters())
        moved = sum(plan.pair_bytes().values())
        print(f"{d:>7} {fmt_bytes(params):>10} {fmt_bytes(moved):>10} {t['live'] * 1e3:>7.1f}ms "
              f"{t['file'] * 1e3:>7.1f}ms {statistics.median(ratios):>9.3f}")
        last = (d, ratios, moved, params)
    d, ratios, moved, params = last
    rows = {f"live reshard / file save+load, 2 -> 2 ranks (d={d})": (statistics.median(ratios), 1.0,
                                                                     (min(ratios), max(ratios))),
            f"bytes moved live / parameter bytes (d={d})": (moved / params, None, None)}
    print()
    for what, (ratio, target, spread) in rows.items():
        row = {"ratio": ratio, "target": target, "better": "lower", "spread": spread}
        goal = f"target <= {target:g}" if target is not None else ""
        print(f"{what:<52} {ratio:6.3f}   {goal:<14} {shown_verdict(row)}")
        if not args.no_record:
            record("bench_live_reshard", what, ratio, target=target, spread=spread)


if __name__ == "__main__":
    main()
