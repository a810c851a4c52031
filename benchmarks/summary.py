"""The ratios every benchmark reports, collected into one table at the end of `make bench`.

A benchmark calls `record(...)` for each ratio it measured; `python benchmarks/summary.py`
(the last step of `make bench`) prints them all against their targets. Ratios only: a
benchmark times the course's implementation and its baseline side by side in one run, so the
machine's speed cancels out. Nothing is asserted: a miss is reported, not raised.

    record("bench_data_parallel", "course DDP / torch DDP, 25 MB buckets", 1.04, target=1.10)
    record("bench_runtime", "tracer overhead per call", 0.002, target=0.05)
    record("bench_zero", "stage 1 memory / DDP", 0.45, target=0.5, better="lower")
"""

from __future__ import annotations

import json
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "ratios.jsonl"


def record(bench: str, what: str, ratio: float, target: float | None = None, better: str = "lower",
           spread: tuple[float, float] | None = None, note: str = "") -> None:
    """Append one ratio. better="lower": met when ratio <= target; "higher": when ratio >= target.
    spread: (low, high) of the ratio over repeated rounds, when measured."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r} must be 'lower' or 'higher'")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    row = {"bench": bench, "what": what, "ratio": float(ratio), "target": target, "better": better,
           "spread": list(spread) if spread else None, "note": note}
    with RESULTS.open("a") as f:
        f.write(json.dumps(row) + "\n")


def verdict(row: dict) -> str:
    if row["target"] is None:
        return "info"
    if row["spread"] and row["spread"][0] <= row["target"] <= row["spread"][1]:
        return "inconclusive"  # the target lies inside the measured spread
    met = row["ratio"] <= row["target"] if row["better"] == "lower" else row["ratio"] >= row["target"]
    return "met" if met else "MISSED"


def main() -> int:
    if not RESULTS.exists():
        print("no benchmark results recorded")
        return 0
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    print(f"\n{'benchmark':<22}{'ratio':<52}{'value':>8}  {'target':>10}  {'spread':>15}  verdict")
    for r in rows:
        target = "" if r["target"] is None else ("<= " if r["better"] == "lower" else ">= ") + f"{r['target']:g}"
        spread = "" if not r["spread"] else f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}"
        print(f"{r['bench']:<22}{r['what'][:50]:<52}{r['ratio']:>8.3f}  {target:>10}  {spread:>15}  {verdict(r)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--reset"]:
        RESULTS.unlink(missing_ok=True)
    else:
        sys.exit(main())
