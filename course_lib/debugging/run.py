"""Run one catalogue entry on real gloo ranks from a notebook or a test: `run_bug(name)`.

    run = run_bug("skip_collective")                 the broken run: a timeout, analysed
    run.outcome, run.analysis.splitlines()[0]        "timeout", "rank 1 never entered all_reduce #3 ..."
    run = run_bug("skip_collective", fixed=True)     the mended twin
    run.outcome, run.evidence.matches                "completed", True

Every rank runs under the flight recorder (course_lib.runtime.run_recorded), without the course's
collective checks (as under a plain torchrun: the hang is the symptom; check_collectives=True
shows what the checks make of it). A hang becomes a timeout after `timeout_s` seconds; the ranks
still running then dump their recorders, and the analysis of the dumps comes back in
`run.analysis`. A crash comes back as `run.error` (the failing rank's last line). A finished run
is compared with the single process: `run.evidence`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from course_lib.debugging.catalogue import BUGS, Bug, Evidence, check_bug
from course_lib.runtime import HangAnalysed, RankError, run_on_ranks, run_recorded

OUTCOMES = ("timeout", "error", "completed")
WARM_TIMEOUT_S = 120.0  # starting ranks and importing the catalogue on a loaded 2-core machine


@dataclass(frozen=True)
class BugRun:
    bug: Bug
    fixed: bool
    world_size: int
    bad_rank: int | None
    outcome: str  # one of OUTCOMES
    timeout_s: float
    analysis: str | None = None  # the flight recorder's analysis (timeouts)
    error: str | None = None  # the failing rank(s) and the error's last line (errors)
    results: list | None = None  # each rank's returned dict (completed runs)
    evidence: Evidence | None = None  # against the single process (completed runs)

    @property
    def first_line(self) -> str:
        """What to look at first: the analysis's first line, the error, or the evidence."""
        if self.outcome == "timeout":
            return self.analysis.splitlines()[0]
        if self.outcome == "error":
            return self.error
        return self.evidence.text

    def __str__(self) -> str:
        which = "mended twin" if self.fixed else "bug"
        head = f"{self.bug.name} ({which}) on {self.world_size} ranks: "
        if self.outcome == "timeout":
            return head + f"no result within {self.timeout_s:g} s; the flight recorder says:\n{self.analysis}"
        if self.outcome == "error":
            return head + f"a rank failed: {self.error}"
        verdict = "matches the single process" if self.evidence.matches else "differs from the single process"
        return head + f"finished, {verdict}: {self.evidence.text}"


def _entry_on_rank(name: str, fixed: bool, bad_rank, options: dict):
    return BUGS[name].rank_fn(fixed, bad_rank, **options)  # travels by name: the rank imports this module


def _warm() -> bool:
    return True  # unpickling it imports this module, and so the catalogue, on the rank


def _exception(traceback_text: str) -> str:
    """The exception a traceback ends with, its continuation lines joined: 'MemoryError: ...'."""
    lines = traceback_text.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line[:1] not in (" ", "\t", ""))
    head = lines[start].split(": ", 1)
    head[0] = head[0].rpartition(".")[2]  # course_lib.observe.checks.CollectiveMismatch -> CollectiveMismatch
    return " ".join([": ".join(head)] + [line.strip() for line in lines[start + 1:]])


def _last_line(err: RankError) -> str:
    return "; ".join(f"rank {r}: {_exception(tb)}" for r, tb in err.failures.items())


def run_bug(name: str, fixed: bool = False, rank: int | None = None, world_size: int | None = None,
            timeout_s: float = 5.0, dump_dir=None, check_collectives: bool = False, **options) -> BugRun:
    """Run catalogue entry `name` (its mended twin with fixed=True) on gloo ranks and return a
    BugRun. rank: the rank carrying the bug (entries that have one); world_size: default the
    entry's; options: keywords of the entry's rank function (skip_collective's probe_s: a
    monitored_barrier before the call). Bad input raises ValueError before any rank starts."""
    bug, world, bad_rank = check_bug(name, rank, world_size)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    try:
        inspect.signature(bug.rank_fn).bind(fixed, bad_rank, **options)
    except TypeError as e:
        raise ValueError(f"options {sorted(options)} do not fit {name}'s rank function: {e}") from None
    # Start the ranks and import the catalogue there first, so that timeout_s measures the entry alone.
    run_on_ranks(_warm, world_size=world, timeout_s=WARM_TIMEOUT_S, check_collectives=check_collectives)
    common = dict(bug=bug, fixed=fixed, world_size=world, bad_rank=bad_rank, timeout_s=float(timeout_s))
    try:
        results = run_recorded(_entry_on_rank, name, fixed, bad_rank, options, world_size=world,
                               timeout_s=timeout_s, dump_dir=dump_dir, check_collectives=check_collectives)
    except HangAnalysed as hang:
        return BugRun(**common, outcome="timeout", analysis=hang.analysis)
    except RankError as err:
        return BugRun(**common, outcome="error", error=_last_line(err))
    expected = bug.expected(world, bad_rank)
    return BugRun(**common, outcome="completed", results=results,
                  evidence=bug.evidence(results, expected, world, bad_rank))
