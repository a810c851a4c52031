"""`make gpu-check`: what a lent GPU machine can show that CPU ranks cannot, in one run, one report.

    python tools/gpu_check.py [--out build/gpu-check.json] [--plan-only] [--gpus N]

1. Every torchrun demo at the largest world size it allows on the GPUs present (world size 1 on
   one GPU), with its check against the single process (`--check`, or the check the demo always
   does), each under a time limit: NCCL, one rank per GPU (runtime.device: NCCL whenever the
   process has a GPU).
2. benchmarks/gpu_check.py: the NCCL path at world size 1 in fp32 and with recomputation, CUDA
   memory against the estimator's formulas, bf16 and FP8 matmul speed, a GPT step's MFU.

One JSON report: per demo the command, world size, exit status, seconds and the last lines it
printed; the benchmark's own JSON. The whole run stays within BUDGET_S (8 minutes on one GPU):
a demo that would start past the budget is reported as skipped, never left out silently.
Without a CUDA GPU it refuses before starting anything (multi-rank NCCL is checked on CPU ranks
with COURSE_NCCL_RULES=1: `make test-nccl-rules`; README, "Instructors").
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGET_S = 480.0  # the 8 minutes on one GPU, everything included
DEMO_LIMIT_S = 90.0  # one demo; NCCL start-up and a few steps of a tiny GPT take seconds
BENCH_LIMIT_S = 240.0


@dataclass
class Step:
    """One command of the check: a demo under torchrun at `world` ranks, or a reason it is skipped."""

    name: str
    world: int
    args: list[str] = field(default_factory=list)
    skip: str | None = None
    torchrun: list[str] = field(default_factory=list)  # torchrun's own flags (--max-restarts)

    def command(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.world),
                *self.torchrun, "-m", f"course_lib.demos.{self.name}", *self.args]


def _pow2_at_most(n: int, cap: int) -> int:
    """The largest power of two <= min(n, cap): the demos' models split in halves."""
    w = 1
    while w * 2 <= min(n, cap):
        w *= 2
    return w


def plan(gpus: int, scratch: str = "/tmp/course-gpu-check") -> list[Step]:
    """The demos to run on `gpus` GPUs, each at the largest world size its model allows."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} must be an int >= 1 (the GPUs this machine has)")
    tp = _pow2_at_most(gpus, 4)  # demo_config: 4 heads
    pp = _pow2_at_most(gpus, 2)  # the pipeline demo's GPT: 4 blocks, one per stage of a V over 2 ranks
    ep = _pow2_at_most(gpus, 8)  # --n-experts 8
    cp = _pow2_at_most(gpus, 4)  # --seq-len 64: 16 tokens per rank, zig-zag halves of 8
    d3 = _pow2_at_most(gpus, 8)
    dp3, tp3, pp3 = {1: (1, 1, 1), 2: (2, 1, 1), 4: (1, 2, 2), 8: (2, 2, 2)}[d3]
    steps = [
        Step("allreduce", gpus, ["--sizes-mb", "1", "64", "256", "--iters", "5"]),
        Step("tensor_parallel", tp, ["--steps", "5", "--check"]),
        Step("tensor_parallel", tp, ["--steps", "5", "--sequence-parallel", "--check"],
             skip=None if tp >= 2 else "sequence parallelism splits the sequence over >= 2 tp ranks"),
        # async TP's send/recv ring on NCCL, with one KV head read by every tp rank (GQA at tp > n_kv_head)
        Step("tensor_parallel", tp, ["--steps", "5", "--sequence-parallel", "--async-tp", "--n-kv-head", "1",
                                     "--check"],
             skip=None if tp >= 2 else "async TP decomposes sequence parallelism's collectives over >= 2 tp ranks"),
        Step("pipeline", pp, ["--schedule", "1f1b", "--microbatches", "4", "--steps", "3", "--check"]),
        Step("pipeline", pp, ["--schedule", "pipedream_2bw", "--microbatches", "2", "--steps", "3", "--check"]),
        Step("expert_parallel", ep, ["--n-experts", "8", "--steps", "3", "--check"]),
        *[Step("zero", gpus, ["--stage", str(s), "--steps", "3", "--check"]) for s in (1, 2, 3)],
        Step("zero", gpus, ["--stage", "3", "--steps", "3", "--bf16", "--check"]),
        Step("context_parallel", cp, ["--method", "ring", "--seq-len", "64", "--load-balance", "--steps", "3",
                                      "--check"]),
        Step("diloco", gpus, ["--replicas", str(gpus), "--inner-steps", "2", "--steps", "6", "--check"]),
        Step("zero", gpus, ["--stage", "1", "--optimizer", "muon", "--muon-method", "owner", "--steps", "3",
                            "--check"]),
        Step("train_3d", d3, ["--dp", str(dp3), "--tp", str(tp3), "--pp", str(pp3), "--zero", "1",
                              "--microbatches", "2", "--steps", "3", "--check"]),
    ]
    if pp >= 2:  # a V needs two ranks to fold over
        steps.insert(5, Step("pipeline", pp, ["--schedule", "zbv", "--microbatches", "4", "--steps", "3", "--check"]))
    else:
        steps.insert(5, Step("pipeline", 1, skip="zbv places two chunks per rank in a V over >= 2 ranks"))
    if gpus >= 2:  # a rank killed at step 25, torchrun restarts the group, the run resumes from step 20
        steps.append(Step("elastic", _pow2_at_most(gpus, 4), ["--steps", "40", "--checkpoint-every", "10",
                          "--checkpoint-dir", f"{scratch}/elastic", "--kill-rank", "1", "--kill-at-step", "25",
                          "--check"], torchrun=["--max-restarts", "2"]))
    else:
        steps.append(Step("elastic", 2, skip="it kills rank 1 of >= 2 and restarts the group"))
    if gpus >= 2:  # ranks 0..A-1 train ZeRO-3, the last B generate with tensor parallelism
        gen = _pow2_at_most(gpus // 2, 4)
        steps.append(Step("weight_sync", gpus, ["--trainer", f"zero3:dp{gpus - gen}", "--generator", f"tp:{gen}",
                                                "--check"]))
    else:
        steps.append(Step("weight_sync", 2, skip="trainer and generator are two groups of ranks: >= 2 GPUs"))
    steps.append(Step("broken_run", gpus, skip="it fails on purpose: the debugging notebook runs it"))
    capstone = ["--config", "configs/capstone_tiny.toml", "--checkpoint-dir", f"{scratch}/capstone"]
    if gpus >= 8:  # configs/capstone_tiny.toml lays out 8 ranks, then resumes on 4
        steps += [Step("capstone", 8, [*capstone, "--kill-rank", "3"]),
                  Step("capstone", 4, [*capstone, "--resume", "--check"])]
    else:
        steps.append(Step("capstone", 8, skip=f"configs/capstone_tiny.toml lays out 8 ranks; {gpus} GPU(s) here"))
    return steps


def run_step(step: Step, limit_s: float) -> dict:
    out = {"demo": step.name, "world": step.world, "command": " ".join(step.command("python"))}
    if step.skip:
        return {**out, "status": "skipped", "why": step.skip}
    start = time.perf_counter()
    try:
        proc = subprocess.run(step.command(), cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        status, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        status, text = "timeout", f"no exit within {limit_s:.0f} s\n{err.stdout or ''}"
    tail = [line for line in str(text).splitlines() if line.strip()][-8:]
    return {**out, "status": "passed" if status == 0 else "failed", "exit": status,
            "seconds": round(time.perf_counter() - start, 1), "last_lines": tail}


def gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "gpu-check.json")
    ap.add_argument("--plan-only", action="store_true", help="print the commands for --gpus and exit")
    ap.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs (default: the ones here)")
    args = ap.parse_args(argv)
    gpus = gpus_here() if args.gpus is None else args.gpus
    if args.plan_only:
        for step in plan(max(gpus, 1)):
            print(f"skip {step.name}: {step.skip}" if step.skip else " ".join(step.command("python")))
        return 0
    if gpus_here() == 0:
        print("make gpu-check needs a CUDA GPU, and torch sees none on this machine "
              "(torch.cuda.is_available() is False). Multi-rank NCCL is checked on CPU ranks instead: "
              "make test-nccl-rules (COURSE_NCCL_RULES=1: NCCL's point-to-point and device rules).", file=sys.stderr)
        return 2
    report, start = {"gpus": gpus, "demos": []}, time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for step in plan(gpus, scratch):
            left = BUDGET_S - BENCH_LIMIT_S - (time.perf_counter() - start)
            if left < 10 and not step.skip:
                step = Step(step.name, step.world, step.args, skip=f"past the {BUDGET_S:.0f} s budget")
            result = run_step(step, min(DEMO_LIMIT_S, max(left, 1.0)))
            print(f"{result['status']:8s} {result['demo']} at {result['world']}: {result.get('seconds', '')}",
                  flush=True)
            report["demos"].append(result)
        bench = pathlib.Path(scratch) / "bench.json"
        try:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(bench)],
                           cwd=ROOT, timeout=BENCH_LIMIT_S, check=False, env={**os.environ})
            report["benchmark"] = json.loads(bench.read_text()) if bench.exists() else {"error": "no report written"}
        except subprocess.TimeoutExpired:
            report["benchmark"] = {"error": f"no exit within {BENCH_LIMIT_S:.0f} s"}
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    failed = [d for d in report["demos"] if d["status"] == "failed"]
    print(f"{len(report['demos']) - len(failed)} of {len(report['demos'])} demos passed or skipped with a reason; "
          f"report: {args.out}")
    return 1 if failed or "error" in report["benchmark"] else 0


if __name__ == "__main__":
    sys.exit(main())
