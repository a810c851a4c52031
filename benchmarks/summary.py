"""The ratios every benchmark reports, collected into one table at the end of `make bench`.

A benchmark calls `record(...)` for each ratio it measured; `python benchmarks/summary.py`
(the last step of `make bench`) prints them all against their targets. Ratios only: a
benchmark times the course's implementation and its baseline side by side in one run, so the
machine's speed cancels out. Nothing is asserted: a miss is reported, not raised (exit 0).

    python benchmarks/summary.py [bench_x.py ...]   the table; then every expected benchmark
                                                    that recorded nothing; then one count line
    python benchmarks/summary.py --reset            forget every recorded ratio

The expected benchmarks are the files named on the command line, by default every
benchmarks/bench_*.py. A benchmark's rows carry its file's stem as `bench`.
A benchmark's --quick run calls `dry_run()` first: `record` then checks and returns each row
but writes nothing, so a smoke test exercises the recording without touching the results.

    record("bench_data_parallel", "course DDP / torch DDP, 25 MB buckets", 1.04, target=1.10)
    record("bench_runtime", "tracer overhead per call", 0.002, target=0.05)
    record("bench_zero", "stage 1 memory / DDP", 0.45, target=0.5, better="lower")
"""

from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "ratios.jsonl"
VERDICTS = ("met", "MISSED", "inconclusive", "info")
_dry_run = False


def dry_run(on: bool = True) -> None:
    """From now on `record` checks its row and returns it without writing (a --quick run)."""
    global _dry_run
    _dry_run = on


def record(bench: str, what: str, ratio: float, target: float | None = None, better: str = "lower",
           spread: tuple[float, float] | None = None, note: str = "") -> dict:
    """Append one ratio (and return its row). better="lower": met when ratio <= target;
    "higher": when ratio >= target. spread: (low, high) of the ratio over repeated rounds, when
    measured. After dry_run(), nothing is written."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r} must be 'lower' or 'higher'")
    row = {"bench": bench, "what": what, "ratio": float(ratio), "target": None if target is None else float(target),
           "better": better, "spread": [float(x) for x in spread] if spread else None, "note": note}
    line = json.dumps(row)
    verdict(row)
    if _dry_run:
        return row
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(line + "\n")
    return row


def verdict(row: dict) -> str:
    if row["target"] is None:
        return "info"
    if row["spread"] and row["spread"][0] <= row["target"] <= row["spread"][1]:
        return "inconclusive"  # the target lies inside the measured spread
    met = row["ratio"] <= row["target"] if row["better"] == "lower" else row["ratio"] >= row["target"]
    return "met" if met else "MISSED"


def shown_verdict(row: dict) -> str:
    """What a benchmark prints beside a ratio: its verdict, or nothing judged in a --quick run."""
    judged = verdict(row)  # computed either way: a --quick run exercises it too
    return "(quick: not judged)" if _dry_run else judged


# --quick runs two rounds of a multi-round benchmark, not one: the second round reuses the
# first's rank processes, which a one-round smoke run never does (bench_composed's second round
# once failed on state the first left in the ranks, while the one-round smoke run passed).
QUICK_ROUNDS = 2


def add_quick(parser, argv=None, **quick_defaults) -> None:
    """Give a benchmark's parser --quick: a smoke test at its smallest size, in seconds. With
    --quick in argv, quick_defaults replace the parser's defaults (flags given still win);
    call quick_mode(args) after parsing."""
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: smallest size, {QUICK_ROUNDS} rounds, a few steps; no targets, nothing recorded")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**quick_defaults)


def wait_for_idle(max_wait_s: float) -> dict:
    """Before measuring: wait at most max_wait_s for the 1-minute load average to fall below the
    cores (course_lib.measure.validation.wait_until_idle), then say so, or warn that other work
    shares the cores. Returns wait_until_idle's {"idle", "load", "waited_s"}."""
    from course_lib.measure.validation import wait_until_idle
    from course_lib.platform import usable_cores

    cores = usable_cores()
    idle = wait_until_idle(cores, max_wait_s)
    if idle["idle"]:
        print(f"machine idle: load average {idle['load']:.1f} < {cores} cores (waited {idle['waited_s']:.0f} s)")
    else:
        print(f"WARNING: load average {idle['load']:.1f} >= {cores} cores after waiting {idle['waited_s']:.0f} s: "
              "other work shares the cores, and the figures below move with it")
    return idle


def quick_mode(args) -> bool:
    """After parsing: in a --quick run, switch record() to dry_run and say so. Returns args.quick."""
    if args.quick:
        dry_run()
        print("--quick: a smoke test at the smallest size; the numbers mean nothing and nothing is recorded")
    return args.quick


def expected_benches(files=None) -> list[str]:
    """The stems of the benchmark files named (default: every benchmarks/bench_*.py)."""
    paths = [pathlib.Path(f) for f in files] if files else sorted(HERE.glob("bench_*.py"))
    return [p.stem for p in paths]


def main(files=None) -> int:
    expected = expected_benches(files)
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()] if RESULTS.exists() else []
    counts = dict.fromkeys(VERDICTS, 0)
    if rows:
        print(f"\n{'benchmark':<22}{'ratio':<52}{'value':>8}  {'target':>10}  {'spread':>15}  verdict")
    else:
        print("\nno benchmark results recorded")
    for r in rows:
        target = "" if r["target"] is None else ("<= " if r["better"] == "lower" else ">= ") + f"{r['target']:g}"
        spread = "" if not r["spread"] else f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}"
        v = verdict(r)
        counts[v] += 1
        print(f"{r['bench']:<22}{r['what'][:50]:<52}{r['ratio']:>8.3f}  {target:>10}  {spread:>15}  {v}")
    recorded = {r["bench"] for r in rows}
    silent = [b for b in expected if b not in recorded]
    for b in silent:
        print(f"{b:<22}{'(recorded nothing: did it run to the end?)':<52}{'':>8}  {'':>10}  {'':>15}  NO RESULTS")
    print(f"\n{len(rows)} ratios from {len(recorded)} benchmarks: "
          + ", ".join(f"{counts[v]} {v}" for v in VERDICTS)
          + f"; {len(silent)} of {len(expected)} expected benchmarks recorded nothing"
          + (f" ({', '.join(silent)})" if silent else ""))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--reset"]:
        RESULTS.unlink(missing_ok=True)
    else:
        sys.exit(main(sys.argv[1:]))
