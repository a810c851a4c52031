"""run_on_ranks with a flight recorder on every rank: a hang comes back as the analysis of where
the ranks diverged, not only as the list of ranks that did not finish (course_lib.observe.flight_recorder).

    run_recorded(fn, *args, world_size=4, timeout_s=20)

Each rank runs fn inside FlightRecorder(dump_dir). When timeout_s has passed and some ranks
are still running, the parent asks every recorder for a dump (request_dumps) and waits until
the stuck ranks have written theirs; the ranks that finished wrote theirs on leaving. Then it
stops the ranks, reads the dumps and raises HangAnalysed, a RankTimeout whose message starts
with the analysis. The dumps show where the ranks were when the parent gave up, however long
they took to get there: the parent's timeout alone says when a run counts as hung.

stuck_after_s (optional) also has each rank dump by itself once a call has been pending that
long, as under torchrun, where no parent asks.
"""

from __future__ import annotations

import pathlib
import tempfile

from course_lib.observe.flight_recorder import DUMP_REQUEST, FlightRecorder, analyse, load_dumps, request_dumps
from course_lib.runtime.pool import RankTimeout, run_on_ranks

# How long the parent waits for a stuck rank's dump after asking: it ends as soon as every stuck
# rank has answered (a watchdog answers within its 0.1 s poll, seconds on a loaded machine); the
# bound only matters for a rank that cannot answer (not yet inside its recorder).
DUMP_WAIT_S = 30.0


class HangAnalysed(RankTimeout):
    """A RankTimeout with the flight recorder's analysis: `.analysis` (text), `.dump_dir`."""

    def __init__(self, timeout: RankTimeout, analysis: str, dump_dir: pathlib.Path):
        TimeoutError.__init__(self, f"{analysis}\n({timeout}; the ranks' dumps: {dump_dir})")
        self.stuck_ranks, self.analysis, self.dump_dir = timeout.stuck_ranks, analysis, dump_dir


def _recorded(fn, dump_dir, stuck_after_s, *args, **kwargs):
    with FlightRecorder(dump_dir, stuck_after_s):
        return fn(*args, **kwargs)


def run_recorded(fn, *args, world_size: int = 4, timeout_s: float = 60, dump_dir=None,
                 stuck_after_s: float | None = None, **kwargs) -> list:
    """run_on_ranks(fn, *args, ...) with a flight recorder on every rank (module docstring)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
    if stuck_after_s is not None and not 0 < stuck_after_s < timeout_s:
        raise ValueError(f"stuck_after_s={stuck_after_s!r} must be in (0, timeout_s={timeout_s:g}): a rank "
                         f"dumps by itself before the parent stops it, or not at all (None)")
    dump_dir = pathlib.Path(dump_dir) if dump_dir is not None else pathlib.Path(tempfile.mkdtemp(prefix="flight-"))
    dump_dir.mkdir(parents=True, exist_ok=True)
    for old in [*dump_dir.glob("rank_*.json"), dump_dir / DUMP_REQUEST]:  # a previous run's would mislead
        old.unlink(missing_ok=True)
    silent: list[int] = []

    def ask_for_dumps(stuck_ranks):
        silent.extend(request_dumps(dump_dir, stuck_ranks, wait_s=DUMP_WAIT_S))

    try:
        return run_on_ranks(_recorded, fn, str(dump_dir), stuck_after_s, *args, world_size=world_size,
                            timeout_s=timeout_s, on_timeout=ask_for_dumps, **kwargs)
    except RankTimeout as err:
        try:
            analysis = analyse(load_dumps(dump_dir), world_size)
        except ValueError:
            analysis = "no rank wrote a dump: none was stuck in a torch.distributed call"
        if silent:
            analysis += f"\nrank(s) {', '.join(map(str, silent))} did not answer the request for a dump in {DUMP_WAIT_S:g} s"
        raise HangAnalysed(err, analysis, dump_dir) from None
