"""The catalogue of broken runs (course_lib.debugging) and loss parity (course_lib.observe.parity):
every hang becomes a timeout whose analysis names the right rank and call, every crash names
its rank, every silent bug shows its stated difference against the single process, every
mended twin matches it; bad input is refused before any rank starts; the torchrun demo dumps a
hang to files that the command line analyses."""

import math
import os
import pathlib
import subprocess
import sys

import pytest

from course_lib.debugging import BUG_NAMES, BUGS, catalogue_table, check_bug, run_bug
from course_lib.debugging import silent
from course_lib.observe import nccl_rules
from course_lib.observe.parity import UNIT_ROUNDOFF, loss_parity, parity_rtol
from course_lib.runtime.pool import live_pools
from course_lib.train import TrainResult

ROOT = pathlib.Path(__file__).resolve().parent.parent
HANG_S = 4.0  # each hang is given up after 4 s; the ranks dump after 2 s stuck (far above the entries' work)

ISSUE_NAMES = ("skip_collective", "reorder_collectives", "wrong_group", "microbatches_below_stages",
               "zero_token_expert", "sync_every_microbatch", "never_sync", "sum_not_avg", "unsynced_dropout",
               "overlapping_shards", "nan_on_one_rank", "uneven_oom")

# The analysis's first line for each hang at its default world size and rank (the culprit).
FIRST_LINES = {
    "skip_collective": "rank 1 never entered all_reduce #3 on group [0, 1] that rank 0 waits in "
                       "(its last call: all_reduce #2 on group [0, 1], completed)",
    "reorder_collectives": "rank 1 called broadcast [4] float32 #2 on group [0, 1] where rank 0 waits in "
                           "all_reduce [4] float32",
    "wrong_group": "rank 2 never entered all_gather #1 on group [2, 3] that rank 3 waits in "
                   "(it is in all_reduce #1 on group [0, 2])",
    "microbatches_below_stages": "rank 1 never entered send #3 to rank 0, the message rank 0 waits for "
                                 "(its last call: send #2 to rank 0, completed)",
    "zero_token_expert": "rank 1 never entered all_to_all_single #3 on group [0, 1] that rank 0 waits in "
                         "(its last call: all_to_all_single #2 on group [0, 1], completed)",
}


def test_the_catalogue_has_the_issues_names_and_prints_as_a_table():
    assert BUG_NAMES == ISSUE_NAMES
    assert {b.kind for b in BUGS.values()} == {"hang", "crash", "silent"}
    assert sorted(FIRST_LINES) == sorted(n for n, b in BUGS.items() if b.kind == "hang")
    table = catalogue_table().splitlines()
    assert table[0].split()[:2] == ["bug", "kind"] and len(table) == 2 + len(BUG_NAMES)
    for line, bug in zip(table[2:], BUGS.values()):
        assert line.startswith(bug.name) and bug.fix in line and all(bug.row())


@pytest.mark.parametrize("name", sorted(FIRST_LINES))
def test_each_hang_times_out_and_the_analysis_names_the_rank_and_call(name, tmp_path):
    broken = run_bug(name, timeout_s=HANG_S, dump_dir=tmp_path)
    assert broken.outcome == "timeout" and broken.timeout_s == HANG_S, str(broken)
    assert broken.first_line == FIRST_LINES[name], broken.analysis
    mended = run_bug(name, fixed=True, timeout_s=60)
    assert mended.outcome == "completed" and mended.evidence.matches, str(mended)


def test_the_rank_carrying_the_bug_can_be_chosen(tmp_path):
    run = run_bug("skip_collective", rank=2, world_size=3, timeout_s=HANG_S, dump_dir=tmp_path)
    assert run.first_line == ("rank 2 never entered all_reduce #3 on group [0, 1, 2] that ranks 0, 1 wait in "
                              "(its last call: all_reduce #2 on group [0, 1, 2], completed)"), run.analysis


def test_a_monitored_barrier_before_the_call_names_the_rank_that_skips_it():
    run = run_bug("skip_collective", timeout_s=60, probe_s=1.0)  # gloo's own barrier times out after 1 s
    if nccl_rules.enabled_in_env():  # gloo-only: refused, as NCCL has no such call
        assert run.outcome == "error" and "monitored_barrier is gloo-only" in run.error, str(run)
    else:
        assert run.outcome == "error" and "Ranks 1 failed to pass monitoredBarrier" in run.error, str(run)


def test_the_collective_checks_turn_a_reordering_into_an_error_naming_both_calls():
    run = run_bug("reorder_collectives", timeout_s=60, check_collectives=True)
    assert run.outcome == "error" and "CollectiveMismatch" in run.error, str(run)


def test_the_uneven_pipeline_runs_out_of_its_memory_cap_on_the_last_rank():
    run = run_bug("uneven_oom", timeout_s=60)
    assert run.outcome == "error" and run.error.startswith(
        "rank 3: MemoryError: out of memory on rank 3 (emulated cap): its 5 layers saved"), str(run)
    mended = run_bug("uneven_oom", fixed=True, timeout_s=60)
    assert mended.outcome == "completed" and mended.evidence.matches, str(mended)
    assert [r["layers"] for r in mended.results] == [3, 3, 3, 2]


def _both(name, **kw):
    broken, mended = run_bug(name, timeout_s=60, **kw), run_bug(name, fixed=True, timeout_s=60, **kw)
    assert broken.outcome == mended.outcome == "completed", (str(broken), str(mended))
    assert not broken.evidence.matches and mended.evidence.matches, (str(broken), str(mended))
    return broken, mended


def test_the_silent_bugs_show_their_stated_difference_and_their_twins_match():
    ref = silent.reference(2)
    # sum_not_avg: the gradient is N times the mean, N = 2 (a factor of 2 is exact in floating point;
    # the shards' sums in another order leave the fp32 parity bound)
    broken, _ = _both("sum_not_avg")
    assert broken.results[0]["grad_norms"][0] / ref["grad_norms"][0] == pytest.approx(2, rel=parity_rtol("fp32", 48))
    # never_sync: replicas differ from step 1, the norm departs at step 1
    broken, mended = _both("never_sync")
    assert broken.results[0]["checksums"][0] != broken.results[1]["checksums"][0]
    assert [r["checksums"] for r in mended.results][0] == [r["checksums"] for r in mended.results][1]
    # sync_every_microbatch: the same losses, 2 syncs of 4 gradients + the loss = 9 calls a step, not 5
    broken, mended = _both("sync_every_microbatch")
    assert loss_parity(broken.results[0], ref, terms=silent.B).ok
    assert (broken.results[0]["all_reduce_calls"], mended.results[0]["all_reduce_calls"]) == (3 * 9, 3 * 5)
    # unsynced_dropout: replicated gradients differ between ranks
    broken, mended = _both("unsynced_dropout")
    assert len({r["bias_grad_checksum"] for r in broken.results}) == 2
    assert len({r["bias_grad_checksum"] for r in mended.results}) == 1
    # overlapping_shards (4 ranks on 2 nodes): ranks 0 and 2 read the same rows; the loss departs at step 1
    broken, _ = _both("overlapping_shards")
    assert broken.results[0]["rows"] == broken.results[2]["rows"] == [0, 12]
    report = loss_parity(broken.results[0], silent.reference(4), terms=silent.B)
    assert (report.first_step, report.quantity) == (1, "loss")
    # nan_on_one_rank: only rank 1 is non-finite before the all-reduce; every loss is nan
    broken, _ = _both("nan_on_one_rank")
    assert [r["finite_before_sync"][0] for r in broken.results] == [True, False]
    assert all(math.isnan(v) for r in broken.results for v in r["losses"])


def test_bad_input_is_refused_before_any_rank_starts():
    before = live_pools()
    with pytest.raises(ValueError, match=r"bug='nope' must be one of \('skip_collective'"):
        run_bug("nope")
    with pytest.raises(ValueError, match=r"rank=2 must be an int in \[0, 2\)"):
        run_bug("skip_collective", rank=2)
    with pytest.raises(ValueError, match="sum_not_avg has no rank to choose"):
        run_bug("sum_not_avg", rank=0)
    with pytest.raises(ValueError, match="world_size=2 must be an int >= 4 for wrong_group"):
        run_bug("wrong_group", world_size=2)
    with pytest.raises(ValueError, match="world_size=5 must be even for wrong_group"):
        run_bug("wrong_group", world_size=5)
    with pytest.raises(ValueError, match="timeout_s=0 must be a positive number"):
        run_bug("skip_collective", timeout_s=0)
    with pytest.raises(ValueError, match=r"options \['probe_s'\] do not fit sum_not_avg's rank function"):
        run_bug("sum_not_avg", probe_s=1.0)
    assert check_bug("skip_collective")[1:] == (2, 1)
    assert live_pools() == before


def test_loss_parity_tolerance_first_departing_step_and_inputs():
    assert parity_rtol("fp32", 48) == 2 * 47 * 2.0 ** -24 and UNIT_ROUNDOFF["bf16"] == 2.0 ** -8
    ref = {"losses": [1.0, 0.9, 0.8], "grad_norms": [2.0, 1.5, 1.0]}
    rtol = parity_rtol("fp32", 100)
    near = {"losses": [1.0 + 0.5 * rtol, 0.9, 0.8 * (1 + 2.5 * rtol)], "grad_norms": [2.0, 1.5, 1.0]}
    assert loss_parity(near, ref, terms=100).ok  # step 3 may move by 3 x rtol
    far = {"losses": [1.0, 0.9, 0.8 * (1 + 3.5 * rtol)], "grad_norms": [2.0, 1.5, 1.0]}
    report = loss_parity(far, ref, terms=100)
    assert (report.first_step, report.quantity) == (3, "loss") and "departs at step 3" in str(report)
    norm_off = loss_parity({"losses": ref["losses"], "grad_norms": [2.0, 3.0, 1.0]}, ref, terms=100)
    assert (norm_off.first_step, norm_off.quantity, norm_off.got, norm_off.expected) == (2, "grad_norm", 3.0, 1.5)
    result = TrainResult(train_losses=[1.0, 0.9, 0.8], grad_norms=[2.0, 1.5, 1.0])
    assert loss_parity(result, ref).ok and loss_parity([1.0, 0.9, float("nan")], ref).first_step == 3
    assert loss_parity([1.005, 0.9, 0.8], ref, precision="bf16", terms=2).ok  # 2 x 2^-8 = 7.8e-3 relative
    with pytest.raises(ValueError, match="precision='fp8' must be one of"):
        loss_parity(ref, ref, precision="fp8")
    with pytest.raises(ValueError, match="the run has 2 losses and the reference 3"):
        loss_parity([1.0, 0.9], ref)
    with pytest.raises(ValueError, match="terms=0 must be an int >= 1"):
        parity_rtol("fp32", 0)


def test_the_torchrun_demo_dumps_a_hang_that_the_command_line_analyses(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "course_lib.demos.broken_run", "--bug", "skip_collective", "--timeout", "5",
           "--flight-recorder", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode != 0 and "no result within --timeout 5 s" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank_*.json")) == ["rank_0.json", "rank_1.json"]
    cli = subprocess.run([sys.executable, "-m", "course_lib.observe.flight_recorder", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 0 and cli.stdout.splitlines()[0] == FIRST_LINES["skip_collective"], cli.stdout


def test_torch_distributed_debug_detail_names_both_calls_of_a_reordering():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "course_lib.demos.broken_run", "--bug", "reorder_collectives", "--timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Detected mismatch between collectives on ranks" in proc.stderr, proc.stderr[-3000:]
    assert "Op type: ALLREDUCEvs BROADCAST" in proc.stderr, proc.stderr[-3000:]


def test_the_torchrun_demo_refuses_bad_arguments_before_joining(monkeypatch, capsys):
    from course_lib.demos import broken_run

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; no group is joined
    for args, message in ((["--bug", "nope"], "bug='nope' must be one of"),
                          (["--bug", "skip_collective", "--rank", "5"], "rank=5 must be an int in [0, 2)"),
                          (["--bug", "skip_collective", "--timeout", "0"], "--timeout=0 must be > 0")):
        with pytest.raises(SystemExit) as info:
            broken_run.main(args)
        assert info.value.code == 2 and message in capsys.readouterr().err
