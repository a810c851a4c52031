"""run_on_ranks with a flight recorder on every rank: a hang comes back as the analysis of where
the ranks diverged, not only as the list of ranks that did not finish (course_lib.observe.flight_recorder).

    run_recorded(fn, *args, world_size=4, timeout_s=20)

Each rank runs fn inside FlightRecorder(dump_dir, stuck_after_s); a rank whose oldest pending
call is older than stuck_after_s (default: half of timeout_s, so the dumps are written before
the parent gives up) writes its buffer. On RankTimeout the parent reads the dumps and raises
HangAnalysed, a RankTimeout whose message starts with the analysis.
"""

from __future__ import annotations

import pathlib
import tempfile

from course_lib.observe.flight_recorder import FlightRecorder, analyse, load_dumps
from course_lib.runtime.pool import RankTimeout, run_on_ranks


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
    stuck_after_s = timeout_s / 2 if stuck_after_s is None else stuck_after_s
    if not 0 < stuck_after_s < timeout_s:
        raise ValueError(f"stuck_after_s={stuck_after_s!r} must be in (0, timeout_s={timeout_s:g}): the ranks "
                         f"must write their dumps before the parent stops them")
    dump_dir = pathlib.Path(dump_dir) if dump_dir is not None else pathlib.Path(tempfile.mkdtemp(prefix="flight-"))
    for old in dump_dir.glob("rank_*.json"):  # a previous run's dumps would mislead the analysis
        old.unlink()
    try:
        return run_on_ranks(_recorded, fn, str(dump_dir), stuck_after_s, *args, world_size=world_size,
                            timeout_s=timeout_s, **kwargs)
    except RankTimeout as err:
        try:
            analysis = analyse(load_dumps(dump_dir), world_size)
        except ValueError:
            analysis = "no rank wrote a dump: none was stuck in a torch.distributed call"
        raise HangAnalysed(err, analysis, dump_dir) from None
