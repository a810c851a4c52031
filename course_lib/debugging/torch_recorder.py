"""PyTorch's own flight recorder beside the course's (notebook 14): one broken run, both recorders
on, both analyses in one comparable form.

    side = compare_recorders("skip_collective")     one hang of the catalogue, the parent's timeout its one clock
    side.course, side.torch                          Verdict(rank=2, op="all_reduce", seq=3, group=(0, 1, 2, 3))
    side.agree                                       both name the same ranks and calls
    torch_recorder_missing()                         None, or the sentence saying this torch lacks it

The course's recorder (course_lib.observe.flight_recorder) patches torch.distributed's Python
functions; PyTorch's is written in C++ inside the process group: ProcessGroupGloo records every
collective into the process's ring buffer (TORCH_FR_BUFFER_SIZE entries, on by default in the
torch pinned here), and torch._C._distributed_c10d._dump_fr_trace() returns it as a pickle, the
format its analyser reads: `python -m torch.distributed.flight_recorder.fr_trace DIR`.

How one run feeds both. Every rank runs the entry inside BothRecorders, the course's recorder whose
every dump first writes PyTorch's buffer to DIR/torch/rank_<r>, then the course's DIR/rank_<r>.json.
When the parent's timeout passes it asks for dumps (request_dumps) and waits for the course's files,
so PyTorch's are on disk too before the ranks are stopped: no timer in the rank, no second clock.
A rank that finished wrote both on leaving. Then the course's `analyse` reads its files and
fr_trace's own `main` (the command line's code, run in this process) reads PyTorch's.

One repair, said aloud: in torch 2.13 ProcessGroupGloo notes its group in the recorder before
torch.distributed has given it its name and ranks, so a gloo dump's group table holds one entry,
named '' (every group under that one empty name), while its entries name their groups '0', '1', ...;
fr_trace stops with a KeyError on the first entry's group.
The rank therefore fills that table from torch.distributed's own (each live group's name,
description and global ranks) when the dump's table lacks a group its entries name, and keeps the
dump as gloo wrote it in DIR/torch_raw/ (`side.raw_error`: what fr_trace says of that one).

Sequence numbers: PyTorch's count a group's collectives since the group was made, the course's
since its recorder started. The pool's ranks are started afresh (shutdown_pools) so that the
world group's count begins with the run.
(A few lines over 300: the rank side, the analyser's run and the two analyses' parsing read as
one comparison.)
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import pathlib
import pickle
import re
import tempfile
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.debugging.catalogue import BUGS, check_bug
from course_lib.debugging.run import WARM_TIMEOUT_S
from course_lib.observe.flight_recorder import DUMP_REQUEST, FlightRecorder, analyse, load_dumps, request_dumps
from course_lib.runtime import RankError, RankTimeout, run_on_ranks, shutdown_pools
from course_lib.runtime.groups import live_groups
from course_lib.runtime.recorded import DUMP_WAIT_S

TORCH_DIR, RAW_DIR = "torch", "torch_raw"  # under the run's dump directory: one file rank_<r> per rank
ANALYSER = "python -m torch.distributed.flight_recorder.fr_trace"


def torch_recorder_missing() -> str | None:
    """None when this torch has the dump call and the analyser; else one sentence saying what lacks."""
    import importlib.util

    from torch._C import _distributed_c10d as c10d

    if not hasattr(c10d, "_dump_fr_trace"):
        return (f"torch {torch.__version__} has no torch._C._distributed_c10d._dump_fr_trace: its gloo "
                f"process group has no flight recorder to dump")
    if importlib.util.find_spec("torch.distributed.flight_recorder.fr_trace") is None:
        return f"torch {torch.__version__} ships no torch.distributed.flight_recorder.fr_trace analyser"
    return None


# ------------------------------------------------------------------ rank side
def _group_table() -> dict:
    """torch.distributed's own table of this rank's groups, in the recorder's format."""
    table = {}
    for pg in [dist.group.WORLD, *live_groups()]:
        name = pg.group_name
        table[name] = {"name": name, "desc": pg.group_desc, "ranks": str(dist.get_process_group_ranks(pg))}
    return table


def _write(path: pathlib.Path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}")  # two dumps at once never share a file
    tmp.write_bytes(data)
    tmp.replace(path)  # the analyser never reads half a file


def write_torch_dump(directory) -> pathlib.Path:
    """Rank code: PyTorch's buffer to directory/torch/rank_<r> (its group table filled in where
    gloo left it empty, module docstring) and, as gloo wrote it, to directory/torch_raw/rank_<r>."""
    from torch._C import _distributed_c10d as c10d

    raw = c10d._dump_fr_trace()
    rank, directory = dist.get_rank(), pathlib.Path(directory)
    _write(directory / RAW_DIR / f"rank_{rank}", raw)
    dump = pickle.loads(raw)
    named = {e["process_group"][0] for e in dump.get("entries", [])}
    if not named <= set(dump.get("pg_config", {})):
        dump["pg_config"] = _group_table()
        dump["course_filled_pg_config"] = True  # a key fr_trace does not read: a note for the reader
    path = directory / TORCH_DIR / f"rank_{rank}"
    _write(path, pickle.dumps(dump))
    return path


class BothRecorders(FlightRecorder):
    """The course's flight recorder; each of its dumps to its directory writes PyTorch's buffer first."""

    def dump(self, path=None, request=None):
        if path is None and self.dump_dir is not None:
            write_torch_dump(self.dump_dir)  # before the course's file: whoever waits for that one finds both
        return super().dump(path, request)


def _recorded_entry(name: str, bad_rank, dump_dir: str):
    with BothRecorders(dump_dir):
        return BUGS[name].rank_fn(False, bad_rank)


def _warm() -> bool:
    return True  # unpickling it imports this module (the catalogue, the recorders) on the rank


# ------------------------------------------------------------------ the two analyses, one form
@dataclass(frozen=True)
class Verdict:
    """What an analysis names first: the culprit rank and the call (op, sequence number, group)."""
    rank: int
    op: str
    seq: int
    group: tuple

    def __str__(self) -> str:
        return f"rank {self.rank}, {self.op} #{self.seq} on group {list(self.group)}"


def course_verdicts(analysis: str) -> tuple:
    """Each line of the course's analysis that names a call a rank never entered ('rank 2 never
    entered all_reduce #3 on group [0, 1, 2, 3] ...') as a Verdict, in its order: culprit first."""
    found = tuple(Verdict(int(m[1]), m[2], int(m[3]), tuple(int(r) for r in m[4].split(", ")))
                  for m in re.finditer(r"^rank (\d+) never entered (\w+) #(\d+) on group \[([\d, ]+)\]", analysis, re.M))
    if not found:
        raise ValueError(f"the course's analysis names no collective a rank never entered: {analysis.splitlines()[0]!r}")
    return found


def _field(block: str, name: str) -> str:
    m = re.search(rf"^{name}: (.*)$", block, re.M)
    return m[1] if m else ""


def _ranks(text: str) -> tuple:
    return tuple(sorted(int(r) for r in re.findall(r"\d+", text)))


def torch_verdicts(report: str) -> tuple:
    """Each of fr_trace's findings 'Not all ranks joining collective, sequence number: 3' (with its
    'collective: gloo:all_reduce', 'missing ranks: {2}', 'expected ranks: {...}') as a Verdict, one
    per missing rank, sorted by number, group and rank: fr_trace's own order follows the order the
    directory lists its files in."""
    starts = [m for m in re.finditer(r"^Not all ranks joining collective, sequence number: (\d+)$", report, re.M)]
    found = []
    for m, nxt in zip(starts, [*starts[1:], None]):
        block = report[m.start():nxt.start() if nxt else len(report)]
        op = _field(block, "collective").split(":", 1)[-1]  # 'gloo:all_reduce' -> 'all_reduce'
        group = _ranks(_field(block, "expected ranks"))
        found += [Verdict(r, op, int(m[1]), group) for r in _ranks(_field(block, "missing ranks"))]
    if not found:
        raise ValueError(f"fr_trace reported no collective that a rank did not join:\n{report}")
    return tuple(sorted(found, key=lambda v: (v.seq, v.group, v.rank)))


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_fr_trace(directory) -> str:
    """fr_trace's report on `directory` (its command line's own main, in this process), the text it
    logs; an exception it raises comes back as its last line ('KeyError: ...')."""
    log = logging.getLogger("Flight Recorder")
    capture, saved, propagate = _Capture(), list(log.handlers), log.propagate
    was_enabled = gc.isenabled()  # fr_trace's reader turns the garbage collector off and leaves it so
    log.handlers, log.propagate = [capture], False
    log.setLevel(logging.INFO)
    try:
        # Its first import adds a stderr handler to this logger and, without the optional `tabulate`
        # package, warns through it: both bound to a throwaway stream, not the notebook's stderr.
        with contextlib.redirect_stderr(io.StringIO()):
            from torch.distributed.flight_recorder.fr_trace import main

        saved += [h for h in log.handlers if h is not capture]  # kept for later, not used for this report
        log.handlers = [capture]
        main([str(directory)])
    except Exception as e:  # noqa: BLE001 - what the analyser says of a dump it cannot read
        capture.lines.append(f"{type(e).__name__}: {e}")
    finally:
        log.handlers, log.propagate = saved, propagate
        if was_enabled:
            gc.enable()
    return "\n".join(line for line in capture.lines if "tabulate" not in line)  # an import-time notice, once


def _call_site(report: str) -> str:
    """The innermost frame of fr_trace's stack outside torch and the course's patching layer: 'fn in file.py'."""
    stack = report.split("collective stack trace:", 1)[-1]
    for name, path in re.findall(r"^\s*(\S+) at (\S+):\d+$", stack, re.M):
        if "/torch/" not in path and "/observe/" not in path:
            return f"{name} in {pathlib.Path(path).name}"
    return "no frame outside torch"


def _rankless(line: str) -> str:
    """fr_trace's KeyError names (group, the rank it began with); which rank that is follows the
    order the directory lists its files in, so it is left out: "KeyError: ('0', <rank>)"."""
    return re.sub(r", \d+\)$", ", <rank>)", line)


def short_report(report: str) -> str:
    """fr_trace's first finding up to its stack trace (whose paths and line numbers belong to one checkout)."""
    return report.split("\ncollective stack trace:", 1)[0]


@dataclass(frozen=True)
class SideBySide:
    """One broken run seen by both recorders (compare_recorders)."""
    bug: str
    course_analysis: str  # the course's analysis, culprit first
    torch_report: str  # fr_trace's report on the filled-in dumps, its first finding up to its stack trace
    course_found: tuple  # Verdicts, the course's order (likeliest culprit first)
    torch_found: tuple  # Verdicts, sorted (torch_verdicts)
    waiting: tuple  # the ranks the course's first line says wait in the call
    torch_states: tuple  # the states PyTorch's entries carry (gloo never marks one started or completed)
    call_site: str  # fr_trace's stack, innermost frame outside torch: 'skip_collective in hangs.py'
    raw_error: str  # fr_trace on the dumps as gloo wrote them ('' when it read them)
    filled: bool  # whether the group table had to be filled in (module docstring)

    @property
    def course(self) -> Verdict:
        return self.course_found[0]

    @property
    def torch(self) -> Verdict | None:
        """fr_trace's finding of the course's first culprit and call; None when it has none."""
        return next((v for v in self.torch_found if v == self.course), None)

    @property
    def agree(self) -> bool:
        """Both name the same ranks and calls (each culprit once per call it never entered)."""
        return set(self.course_found) == set(self.torch_found)


def compare_recorders(name: str = "skip_collective", rank: int | None = None, world_size: int | None = None,
                      timeout_s: float = 5.0, dump_dir=None) -> SideBySide:
    """Run hang `name` of the catalogue once with both recorders on every rank; after `timeout_s`
    the parent asks for the dumps, and both analyses come back side by side. Raises RuntimeError
    (torch_recorder_missing's sentence) on a torch without the recorder, ValueError on bad input
    or an entry that does not hang."""
    bug, world, bad_rank = check_bug(name, rank, world_size)
    if bug.kind != "hang":
        raise ValueError(f"bug={name!r} is {bug.kind!r}: only a hang leaves ranks waiting in a call to compare")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    missing = torch_recorder_missing()
    if missing is not None:
        raise RuntimeError(missing)
    dump_dir = pathlib.Path(dump_dir) if dump_dir is not None else pathlib.Path(tempfile.mkdtemp(prefix="flight-both-"))
    for old in [*dump_dir.glob("rank_*.json"), *dump_dir.glob("torch*/rank_*"), dump_dir / DUMP_REQUEST]:
        old.unlink(missing_ok=True)  # a previous run's files would mislead both analysers
    dump_dir.mkdir(parents=True, exist_ok=True)
    shutdown_pools()  # fresh ranks: PyTorch numbers the world group's calls from its creation (docstring)
    run_on_ranks(_warm, world_size=world, timeout_s=WARM_TIMEOUT_S, check_collectives=False)
    try:
        run_on_ranks(_recorded_entry, name, bad_rank, str(dump_dir), world_size=world, timeout_s=timeout_s,
                     check_collectives=False,
                     on_timeout=lambda stuck: request_dumps(dump_dir, stuck, wait_s=DUMP_WAIT_S))
    except RankTimeout:
        pass
    except RankError as err:
        raise ValueError(f"{name} failed instead of hanging: {err}") from None
    else:
        raise ValueError(f"{name} finished within timeout_s={timeout_s:g}: nothing hung to compare")
    course_analysis = analyse(load_dumps(dump_dir), world)
    report = run_fr_trace(dump_dir / TORCH_DIR)
    raw = run_fr_trace(dump_dir / RAW_DIR)
    dumps = {int(p.name.split("_")[1]): pickle.loads(p.read_bytes()) for p in (dump_dir / TORCH_DIR).glob("rank_*")}
    if not any(d.get("entries") for d in dumps.values()):
        raise RuntimeError(f"torch {torch.__version__}'s gloo wrote empty flight-recorder buffers "
                           f"(TORCH_FR_BUFFER_SIZE=0 in the environment?)")
    waiting = _ranks(re.match(r".*? that (.*?) waits? in", course_analysis.splitlines()[0])[1])
    states = tuple(sorted({e["state"] for d in dumps.values() for e in d["entries"]}))
    raw_lines = [line for line in raw.splitlines() if re.match(r"^\w+Error: ", line)]
    return SideBySide(bug=name, course_analysis=course_analysis, torch_report=short_report(report),
                      course_found=course_verdicts(course_analysis), torch_found=torch_verdicts(report),
                      waiting=waiting, torch_states=states, call_site=_call_site(report),
                      raw_error=_rankless(raw_lines[0]) if raw_lines else "",
                      filled=any(d.get("course_filled_pg_config") for d in dumps.values()))
