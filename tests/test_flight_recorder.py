"""The flight recorder (course_lib.observe.flight_recorder): real hangs on gloo ranks come back
as a timeout whose message names the rank and the call where the ranks diverge; the analysis
on hand-written dumps; the command line; bad input refused before any rank starts."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.observe.flight_recorder import DUMP_REQUEST, FlightRecorder, analyse, load_dumps, main, request_dumps
from course_lib.runtime import HangAnalysed, rank_device, run_on_ranks, run_recorded

# The parent's timeout is the only clock in a hang test: when it passes, the parent asks the ranks
# for their dumps, which show where they are then. 15 s is what the ranks have to reach the hang
# (a few new_groups and a collective: well under a second on a quiet machine, seconds at a load
# average of 20-27 on 2 cores, where an 8 s budget that also held a 2.5 s stuck_after_s ran out).
TIMEOUT_S = 15.0


def _wrong_group():
    """Rank 2 all-reduces over dp [0, 2] where the others all-gather over their tp pair."""
    rank = dist.get_rank()
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    x = torch.ones(4, device=rank_device())  # NCCL: on the rank's device
    dist.all_reduce(x)  # #1 on the world: every rank
    if rank == 2:
        dist.all_reduce(x, group=dp[0])  # the bug
    else:
        if rank == 3:
            time.sleep(0.5)  # so that rank 2's call is the oldest stuck one
        out = [torch.empty(4, device=rank_device()) for _ in range(2)]
        dist.all_gather(out, x, group=tp[rank // 2])
    return rank


def _skip_collective():
    """Rank 2 skips the second all-reduce (a data-dependent branch gone wrong); the other three wait in it."""
    x = torch.ones(3, device=rank_device())
    dist.all_reduce(x)
    if dist.get_rank() != 2:
        dist.all_reduce(x)
    return True


def test_a_rank_on_the_wrong_group_is_named(tmp_path):
    with pytest.raises(HangAnalysed) as info:
        run_recorded(_wrong_group, world_size=4, timeout_s=TIMEOUT_S, dump_dir=tmp_path)
    # Two culprits, one waiter each: rank 2, itself stuck in another call, comes before rank 0,
    # which left with all its calls matched.
    first, second = info.value.analysis.splitlines()
    assert first == ("rank 2 never entered all_gather #1 on group [2, 3] that rank 3 waits in "
                     "(it is in all_reduce #1 on group [0, 2])"), info.value.analysis
    assert second == ("rank 0 never entered all_reduce #1 on group [0, 2] that rank 2 waits in "
                      "(its last call: all_gather #1 on group [0, 1], completed)"), info.value.analysis
    assert sorted(info.value.stuck_ranks) == [2, 3] and str(info.value).startswith(first)
    assert sorted(load_dumps(tmp_path)) == [0, 1, 2, 3]  # the two that finished wrote theirs on leaving


def test_a_skipped_collective_is_named_and_the_command_line_prints_the_culprit_first(tmp_path):
    """One culprit, one line: the three waiters share it. The command line reads the same files;
    the package course_lib.observe is imported before the module runs, and had it imported the
    module already, runpy would print a RuntimeWarning on stderr before the analysis."""
    with pytest.raises(HangAnalysed) as info:
        run_recorded(_skip_collective, world_size=4, timeout_s=TIMEOUT_S, dump_dir=tmp_path)
    expected = ("rank 2 never entered all_reduce #2 on group [0, 1, 2, 3] that ranks 0, 1, 3 wait in "
                "(its last call: all_reduce #1 on group [0, 1, 2, 3], completed)")
    assert info.value.analysis == expected and sorted(info.value.stuck_ranks) == [0, 1, 3]
    cli = subprocess.run([sys.executable, "-m", "course_lib.observe.flight_recorder", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "RuntimeWarning" not in cli.stderr, cli.stderr
    assert cli.stdout.splitlines()[0] == expected, cli.stdout


def _slow_call_then_stuck(dump_dir):
    """Two calls through the recorder's layer whose waits end on events, not clocks: each returns
    only once the watchdog has dumped it as stuck. The first was only slow (it returns); the
    second must get a dump of its own, not stay behind the first one's."""
    x = torch.ones(2, device=rank_device())
    path = pathlib.Path(dump_dir) / f"rank_{dist.get_rank()}.json"

    def until_dumped_as_stuck(seq):
        deadline = time.monotonic() + 60  # bounds a broken watchdog; a working one ends the wait
        while time.monotonic() < deadline:
            try:
                entries = json.loads(path.read_text())["entries"]
            except (OSError, ValueError):  # not written yet
                entries = []
            if any(e["seq"] == seq and e["state"] == "issued" for e in entries):
                return [(e["seq"], e["state"]) for e in entries]
            time.sleep(0.01)
        raise AssertionError(f"no dump showed call #{seq} stuck within 60 s")

    with FlightRecorder(dump_dir, stuck_after_s=0.05, poll_s=0.01) as recorder:
        first = recorder.around("all_reduce", {"group": None, "tensor": x}, lambda: until_dumped_as_stuck(1))
        second = recorder.around("all_reduce", {"group": None, "tensor": x}, lambda: until_dumped_as_stuck(2))
    return first, second


def test_a_call_that_was_only_slow_leaves_no_stale_dump(tmp_path):
    """The watchdog (stuck_after_s, as under torchrun) dumps once per stuck call: the slow first
    call, then the second. Dumping once per run would leave the first dump behind, and the
    analysis would see the rank stuck in a call its peers completed."""
    for first, second in run_on_ranks(_slow_call_then_stuck, str(tmp_path), world_size=2, timeout_s=120):
        assert first == [(1, "issued")] and second == [(1, "completed"), (2, "issued")]


def _answer_a_request(dump_dir):
    """A request left in the directory before the recorder started is not answered; one made
    while it runs is, by the watchdog, while the main thread waits."""
    directory = pathlib.Path(dump_dir)
    if dist.get_rank() == 0:
        stale = directory / DUMP_REQUEST
        stale.write_text("from an earlier run")
        os.utime(stale, (1.0, 1.0))  # written long before this recorder started
    dist.barrier()
    mine = directory / f"rank_{dist.get_rank()}.json"
    with FlightRecorder(dump_dir) as recorder:  # no stuck_after_s: it dumps only when asked, and on leaving
        pending = recorder._request()  # what its watchdog would answer: nothing yet
        dist.barrier()
        silent = request_dumps(dump_dir, [0, 1]) if dist.get_rank() == 0 else None
        dist.barrier()
        answered = json.loads(mine.read_text())["request"]
    return pending, silent, answered


def test_a_request_is_answered_and_a_stale_one_is_not(tmp_path):
    results = run_on_ranks(_answer_a_request, str(tmp_path), world_size=2, timeout_s=120, check_collectives=False)
    assert [pending for pending, _, _ in results] == [None, None] and results[0][1] == []
    request = (tmp_path / DUMP_REQUEST).read_text()
    assert [answered for _, _, answered in results] == [request, request]


def test_a_run_without_a_hang_returns_as_run_on_ranks_does(tmp_path):
    def fine():
        x = torch.ones(2, device=rank_device())
        dist.all_reduce(x)
        return float(x[0])
    assert run_recorded(fine, world_size=2, timeout_s=60, dump_dir=tmp_path) == [2.0, 2.0]
    dumps = load_dumps(tmp_path)
    assert [e["state"] for e in dumps[0]] == ["completed"] and analyse(dumps, 2) == "no rank is stuck in a call"


def _entry(op, seq, state="completed", t=0.0, **where):
    return {"op": op, "seq": seq, "shape": [4], "dtype": "float32", "state": state, "issued_at": t, **where}


def test_the_analysis_of_hand_written_dumps():
    # a mismatched op: both ranks reached call #2 on the world, with different ops
    dumps = {0: [_entry("all_reduce", 1, group=[0, 1]), _entry("broadcast", 2, "issued", 1.0, group=[0, 1])],
             1: [_entry("all_reduce", 1, group=[0, 1]), _entry("all_reduce", 2, "issued", 2.0, group=[0, 1])]}
    assert analyse(dumps).splitlines() == [
        "rank 1 called all_reduce [4] float32 #2 on group [0, 1] where rank 0 waits in broadcast [4] float32",
        "rank 0 called broadcast [4] float32 #2 on group [0, 1] where rank 1 waits in all_reduce [4] float32"]
    # a message never received: rank 0's second send to rank 1; rank 1 received one
    dumps = {0: [_entry("send", 1, src=0, dst=1), _entry("send", 2, "issued", 1.0, src=0, dst=1)],
             1: [_entry("recv", 1, src=0, dst=1)]}
    assert analyse(dumps) == ("rank 1 never entered recv #2 from rank 0, the message rank 0 waits for "
                              "(its last call: recv #1 from rank 0, completed)")
    # a rank without a file
    dumps = {0: [_entry("barrier", 1, "issued", 1.0, group=[0, 1, 2])], 1: [_entry("barrier", 1, "issued", 1.0, group=[0, 1, 2])]}
    text = analyse(dumps, world_size=3)
    assert text.splitlines()[0] == ("rank 2 wrote no dump (it finished, died, or never recorded); ranks 0, 1 "
                                    "wait for it in barrier #1 on group [0, 1, 2]")
    assert text.splitlines()[-1] == "no dump from rank(s) 2"


def test_bad_input_is_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match="stuck_after_s=0 must be > 0"):
        FlightRecorder(tmp_path, stuck_after_s=0)
    with pytest.raises(ValueError, match="stuck_after_s needs a dump_dir"):
        FlightRecorder(None, stuck_after_s=1)
    with pytest.raises(ValueError, match=r"stuck_after_s=9 must be in \(0, timeout_s=8\)"):
        run_recorded(_skip_collective, world_size=2, timeout_s=8, stuck_after_s=9)
    with pytest.raises(ValueError, match="poll_s=0 must be > 0"):
        FlightRecorder(tmp_path, poll_s=0)
    with pytest.raises(TypeError, match="on_timeout=3 must be callable"):
        run_on_ranks(_skip_collective, world_size=2, on_timeout=3)
    with pytest.raises(ValueError, match="holds no rank_<r>.json dump"):
        load_dumps(tmp_path)
    assert main([]) == 2
    (tmp_path / "rank_0.json").write_text(json.dumps({"rank": 0, "world_size": 1, "entries": []}))
    assert analyse(load_dumps(tmp_path), 1) == "no rank is stuck in a call"


def test_the_patching_engines_fast_binding_equals_inspects():
    """The engine binds a plain call's arguments without inspect (patching._binder): the same
    dict, or the same TypeError, for every patchable op and every count of positional
    arguments, with and without a keyword."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    from course_lib.observe.patching import PATCHABLE_OPS, _binder

    checked = 0
    for op in PATCHABLE_OPS:
        fn = getattr(c10d, op, None)
        if fn is None:
            continue
        sig, bind = inspect.signature(fn), _binder(fn)
        names = list(sig.parameters)
        for k in range(len(names) + 2):
            args = tuple(object() for _ in range(k))
            for kwargs in ({}, {names[-1]: 1}, {"not_a_parameter": 1}):
                def outcome(f):
                    try:
                        return f()
                    except TypeError:
                        return TypeError
                ref = outcome(lambda: (lambda b: (b.apply_defaults(), dict(b.arguments))[1])(sig.bind(*args, **kwargs)))
                assert outcome(lambda: bind(args, kwargs)) == ref, (op, k, kwargs)
                checked += 1
    assert checked > 100


def test_the_command_line_refuses_a_directory_without_dumps_in_one_line(tmp_path, capsys):
    from course_lib.observe.flight_recorder import main

    assert main([str(tmp_path)]) == 2 and main([]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"flight_recorder: {tmp_path} holds no rank_<r>.json dump",
                   "usage: python -m course_lib.observe.flight_recorder DIR"]
