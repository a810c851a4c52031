"""The flight recorder (course_lib.observe.flight_recorder): real hangs on gloo ranks come back
as a timeout whose message names the rank and the call where the ranks diverge; the analysis
on hand-written dumps; the command line; bad input refused before any rank starts."""

import json
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.observe.flight_recorder import FlightRecorder, analyse, load_dumps, main
from course_lib.runtime import HangAnalysed, run_recorded

TIMEOUT_S, STUCK_S = 8.0, 2.5  # the ranks dump after 2.5 s stuck; the parent gives up at 8 s


def _wrong_group():
    """Rank 2 all-reduces over dp [0, 2] where the others all-gather over their tp pair."""
    rank = dist.get_rank()
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    x = torch.ones(4)
    dist.all_reduce(x)  # #1 on the world: every rank
    if rank == 2:
        dist.all_reduce(x, group=dp[0])  # the bug
    else:
        if rank == 3:
            time.sleep(0.5)  # so that rank 2's call is the oldest stuck one
        out = [torch.empty(4) for _ in range(2)]
        dist.all_gather(out, x, group=tp[rank // 2])
    return rank


def _skip_collective():
    """Rank 2 skips the second all-reduce (a data-dependent branch gone wrong); the other three wait in it."""
    x = torch.ones(3)
    dist.all_reduce(x)
    if dist.get_rank() != 2:
        dist.all_reduce(x)
    return True


def test_a_rank_on_the_wrong_group_is_named(tmp_path):
    with pytest.raises(HangAnalysed) as info:
        run_recorded(_wrong_group, world_size=4, timeout_s=TIMEOUT_S, stuck_after_s=STUCK_S, dump_dir=tmp_path)
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
        run_recorded(_skip_collective, world_size=4, timeout_s=TIMEOUT_S, stuck_after_s=STUCK_S, dump_dir=tmp_path)
    expected = ("rank 2 never entered all_reduce #2 on group [0, 1, 2, 3] that ranks 0, 1, 3 wait in "
                "(its last call: all_reduce #1 on group [0, 1, 2, 3], completed)")
    assert info.value.analysis == expected and sorted(info.value.stuck_ranks) == [0, 1, 3]
    cli = subprocess.run([sys.executable, "-m", "course_lib.observe.flight_recorder", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "RuntimeWarning" not in cli.stderr, cli.stderr
    assert cli.stdout.splitlines()[0] == expected, cli.stdout


def _slow_then_skip():
    """Rank 0's first all-reduce waits past STUCK_S for a slow rank 1, then returns; rank 1 then
    skips the second one."""
    x = torch.ones(2)
    if dist.get_rank() == 1:
        time.sleep(STUCK_S + 1.0)
    dist.all_reduce(x)
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    return True


def test_a_call_that_was_only_slow_leaves_no_stale_dump(tmp_path):
    """Rank 0 dumps while its first all-reduce waits for the slow rank 1; once that returns and
    rank 0 is stuck in the second, it dumps again. With one dump per rank the analysis would see
    rank 0 stuck in a call rank 1 completed and find no divergence."""
    with pytest.raises(HangAnalysed) as info:
        run_recorded(_slow_then_skip, world_size=2, timeout_s=STUCK_S * 2 + 1.0 + TIMEOUT_S / 2, stuck_after_s=STUCK_S,
                     dump_dir=tmp_path)
    assert info.value.analysis == ("rank 1 never entered all_reduce #2 on group [0, 1] that rank 0 waits in "
                                   "(its last call: all_reduce #1 on group [0, 1], completed)"), info.value.analysis


def test_a_run_without_a_hang_returns_as_run_on_ranks_does(tmp_path):
    def fine():
        x = torch.ones(2)
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
