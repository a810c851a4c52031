"""Memory techniques on the course GPT: what they save, what they cost (single process, CPU).

    .venv/bin/python benchmarks/bench_memory.py [--reps 7] [--threads 1] [--quick]

1. Activation checkpointing every k blocks vs none: saved-activation bytes after forward and
   the backward peak (kept + one recomputed segment), against forward+backward time.
2. bf16 autocast vs fp32: forward+backward+AdamW step time and saved bytes. On a CPU without
   bf16 matrix units, bf16 can be slower than fp32: the number printed is what this machine does.

The configurations are timed round-robin (one repetition of each, then the next) so that load
changes on a shared machine hit all of them alike; each time is the median over repetitions.
Ratios are against the baseline measured in the same run. Nothing here asserts on speed.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from summary import add_quick, quick_mode, record  # noqa: E402  (benchmarks/ is not a package)

from course_lib.data import CharDataset  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.observe.memory import SavedActivations  # noqa: E402
from course_lib.techniques.activation_checkpointing import checkpointed_forward  # noqa: E402
from course_lib.train import TrainConfig, make_optimizer  # noqa: E402

CFG = GPTConfig(vocab_size=CharDataset("train").vocab_size, block_size=128, n_layer=8, n_head=4, d_model=128)
BATCH, SEQ = 8, 128


def fmt_mb(n: int) -> str:
    return f"{n / 2**20:7.2f} MiB"


def paired(times: dict, name: str, base: str) -> tuple[float, tuple[float, float]]:
    """Median and interquartile range of the per-repetition ratios name / base."""
    ratios = [a / b for a, b in zip(times[name], times[base])]
    if len(ratios) < 2:
        return ratios[0], (ratios[0], ratios[0])
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[1], (q[0], q[2])


def make_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g), torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(ap, argv, reps=1)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        raise ValueError(f"--reps={args.reps} and --threads={args.threads} must be >= 1")
    quick_mode(args)
    torch.set_num_threads(args.threads)
    x, y = make_batch()
    model = GPT(CFG)
    opt = make_optimizer(model, TrainConfig(lr=1e-4))
    print(f"course GPT: {model.num_params() / 1e6:.2f}M params, n_layer={CFG.n_layer}, d_model={CFG.d_model}, "
          f"batch {BATCH} x {SEQ} tokens; torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.reps} reps\n")

    # ---- activation checkpointing
    ks = [1, 2, 4, 8]
    fwds = {"none": lambda: model(x, y)}
    fwds.update({f"k={k}": (lambda k=k: checkpointed_forward(model, x, y, every_k=k)) for k in ks})

    saved = {}
    for name, fwd in fwds.items():
        with SavedActivations(model) as s:
            fwd()
        saved[name] = s.bytes
    boundary = BATCH * SEQ * CFG.d_model * 4
    recompute = {}
    for k in ks:  # what one segment's recomputation holds, beyond its (already kept) input
        h = torch.randn(BATCH, SEQ, CFG.d_model)
        with SavedActivations(model) as s:
            for blk in model.blocks[:k]:
                h = blk(h)
        recompute[f"k={k}"] = s.bytes - boundary
    peak = {name: saved[name] + recompute.get(name, 0) for name in fwds}

    times = {name: [] for name in fwds}
    for name, fwd in fwds.items():  # warm-up
        model.zero_grad(set_to_none=True)
        fwd()[1].backward()
    for _ in range(args.reps):
        for name, fwd in fwds.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fwd()[1].backward()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}

    print("activation checkpointing (forward + backward)")
    print(f"{'':6} {'saved after fwd':>16} {'backward peak':>15} {'memory saved':>14} {'peak ratio':>10} {'time':>9} {'time ratio':>10}")
    for name in fwds:
        print(f"{name:6} {fmt_mb(saved[name]):>16} {fmt_mb(peak[name]):>15} {fmt_mb(peak['none'] - peak[name]):>14} "
              f"{peak[name] / peak['none']:10.3f} {med[name] * 1e3:7.1f}ms {med[name] / med['none']:10.2f}")

    # ---- bf16 autocast vs fp32, full training step
    def step(autocast: bool):
        opt.zero_grad(set_to_none=True)
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)[1]
        else:
            loss = model(x, y)[1]
        loss.backward()
        opt.step()

    with SavedActivations(model) as s32:
        model(x, y)
    with SavedActivations(model) as s16, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, y)
    step(False)
    step(True)
    t = {"fp32": [], "bf16 autocast": []}
    for _ in range(args.reps):
        for name in t:
            t0 = time.perf_counter()
            step(name != "fp32")
            t[name].append(time.perf_counter() - t0)
    m32, m16 = statistics.median(t["fp32"]), statistics.median(t["bf16 autocast"])
    print("\nmixed precision (forward + backward + AdamW step)")
    print(f"fp32           {m32 * 1e3:7.1f} ms   saved {fmt_mb(s32.bytes)}")
    print(f"bf16 autocast  {m16 * 1e3:7.1f} ms   saved {fmt_mb(s16.bytes)}   "
          f"time ratio {m16 / m32:.2f}x, memory ratio {s16.bytes / s32.bytes:.2f}x")
    if not args.no_record:
        ratio, spread = paired(times, "k=1", "none")
        record("bench_memory", "checkpoint every block: step time / plain", ratio, target=None, spread=spread,
               note="about 4/3 expected for large layers")
        record("bench_memory", "checkpoint every block: backward peak / plain", peak["k=1"] / peak["none"], target=0.5)
        ratio, spread = paired(t, "bf16 autocast", "fp32")
        record("bench_memory", "bf16 autocast: step time / fp32 (CPU)", ratio, target=None, spread=spread,
               note="depends on the CPU's bf16 support")
        record("bench_memory", "bf16 autocast: saved activations / fp32", s16.bytes / s32.bytes, target=0.75)


if __name__ == "__main__":
    main()
