"""PyTorch's flight recorder beside the course's (course_lib.debugging.torch_recorder): one hang,
both recorders on, both analyses name the same ranks and calls; what each sees that the other
does not (notebook 14 prints the same fields)."""

import gc
import logging

import pytest

from course_lib.debugging import torch_recorder as tr
from course_lib.debugging.torch_recorder import Verdict, compare_recorders, torch_recorder_missing

MISSING = torch_recorder_missing()
needs_recorder = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@needs_recorder
def test_skip_collective_both_name_the_rank_that_never_entered_and_the_call(tmp_path):
    side = compare_recorders("skip_collective", rank=1, world_size=3, timeout_s=5, dump_dir=tmp_path)
    expected = Verdict(rank=1, op="all_reduce", seq=3, group=(0, 1, 2))
    assert side.course_found == (expected,), side.course_analysis
    assert side.torch_found == (expected,), side.torch_report
    assert side.agree and side.torch == side.course
    # what only the course's analysis says: who waits, and the culprit's last call, completed
    assert side.waiting == (0, 2)
    assert "its last call: all_reduce #2 on group [0, 1, 2], completed" in side.course_analysis
    # gloo marks none of PyTorch's entries started or completed: fr_trace cannot tell who waits
    assert side.torch_states == ("scheduled",)
    assert "collective state: scheduled" in side.torch_report
    # what only PyTorch's says: the Python stack of the call, down to the catalogue's function
    assert side.call_site == "skip_collective in hangs.py"
    # the dump as gloo wrote it is unreadable exactly when its group table had to be filled in
    assert side.filled == side.raw_error.startswith("KeyError"), (side.filled, side.raw_error)
    assert {p.name for p in (tmp_path / tr.TORCH_DIR).iterdir()} == {"rank_0", "rank_1", "rank_2"}


@needs_recorder
def test_wrong_group_both_name_both_culprits_on_the_subgroups(tmp_path):
    """Two culprits on two groups made inside the run: the filled-in table must name them right."""
    side = compare_recorders("wrong_group", timeout_s=5, dump_dir=tmp_path)
    assert side.course_found == (Verdict(2, "all_gather", 1, (2, 3)), Verdict(0, "all_reduce", 1, (0, 2))), \
        side.course_analysis
    assert side.agree and side.torch == side.course, (side.torch_found, side.torch_report)
    assert side.call_site == "wrong_group in hangs.py"


def test_verdicts_parsed_from_each_analysis_and_a_disagreement_shows():
    course = ("rank 2 never entered all_reduce #3 on group [0, 1, 2, 3] that ranks 0, 1, 3 wait in "
              "(its last call: all_reduce #2 on group [0, 1, 2, 3], completed)")
    report = ("Not all ranks joining collective, sequence number: 3\ninternal record id: 2\ngroup info: 0:default_pg\n"
              "collective: gloo:all_reduce\nmissing ranks: {2}\ninput sizes: [[4]]\noutput sizes: [[4]]\n"
              "world size: 4\nexpected ranks: {0, 1, 2, 3}\ncollective state: scheduled\n")
    v = Verdict(2, "all_reduce", 3, (0, 1, 2, 3))
    assert tr.course_verdicts(course) == (v,) and tr.torch_verdicts(report) == (v,)
    other = tr.torch_verdicts(report.replace("missing ranks: {2}", "missing ranks: {1}"))
    side = tr.SideBySide("x", course, report, (v,), other, (0, 1, 3), ("scheduled",), "", "", False)
    assert not side.agree and side.torch is None
    with pytest.raises(ValueError, match="names no collective a rank never entered"):
        tr.course_verdicts("rank 1 called broadcast [4] float32 #2 on group [0, 1] where rank 0 waits in all_reduce")
    with pytest.raises(ValueError, match="no collective that a rank did not join"):
        tr.torch_verdicts("")


@needs_recorder
def test_run_fr_trace_leaves_the_garbage_collector_and_the_log_as_it_found_them(tmp_path):
    log = logging.getLogger("Flight Recorder")
    handlers = list(log.handlers)
    assert gc.isenabled()
    said = tr.run_fr_trace(tmp_path)  # an empty directory: the analyser refuses it
    assert gc.isenabled()
    assert said.startswith(("AssertionError", "ValueError")), said
    assert all(h in log.handlers for h in handlers)


def test_bad_input_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="only a hang"):
        compare_recorders("sum_not_avg")
    with pytest.raises(ValueError, match="timeout_s"):
        compare_recorders("skip_collective", timeout_s=0)
    with pytest.raises(ValueError, match="must be one of"):
        compare_recorders("no_such_bug")


def test_without_tabulate_the_analyser_writes_nothing_to_stderr(tmp_path):
    """fr_trace's first import warns on stderr when the optional `tabulate` is missing (a learner's
    install: only the website's extra brings it): in a notebook that is an output of its own, which
    differed from the stored one in CI. A fresh process, where the import is first."""
    import os
    import pathlib
    import subprocess
    import sys

    code = ("import sys; sys.modules['tabulate'] = None  # import tabulate -> ModuleNotFoundError\n"
            "from course_lib.debugging.torch_recorder import run_fr_trace\n"
            f"print(repr(run_fr_trace({str(tmp_path)!r})))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).parents[1], env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
