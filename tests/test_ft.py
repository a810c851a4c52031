"""Fault-tolerant replica groups (course_lib.parallel.ft): a per-step quorum over the store, a real
SIGKILL mid-run, the survivors going on, a restarted replica healed from a healthy peer, and the
whole run equal to the one-process replay of the same data and quorum sequence."""

from __future__ import annotations

import multiprocessing
import re
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from course_lib.parallel.ft import FtConfig, check_ft, decide_quorum, replay, run_ft
from course_lib.parallel.diloco.simulate import param_rms_tolerance
from course_lib.platform import HARD_KILL
from course_lib.tolerances import adamw_loss_atol

# The replicas compute their gradients in their own processes at one thread, the replay in this
# process at its own thread count: a matmul's blocked sums may then differ in the last bits, and
# six AdamW steps at lr 1e-2 keep such a difference at float32 rounding (measured: 0 here).
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 120  # every run_ft call is bounded; a run takes seconds


def quorum_slots(result) -> dict[int, list[int]]:
    return {t: sorted(q) for t, q in result.quorums.items()}


def test_kill_mid_run_survivors_go_on_and_the_restarted_replica_is_healed():
    cfg = FtConfig(replicas=3, steps=6, kill_slot=1, kill_step=3, rejoin_step=5)
    run = run_ft(cfg, timeout_s=TIMEOUT_S)
    # The kill is real: slot 1's process ended by the signal and returned nothing.
    assert run.exitcodes == [0, -HARD_KILL, 0, 0]
    assert run.results[1] is None
    survivors, joiner = [run.results[0], run.results[2]], run.results[3]
    # (a) every step completed on the survivors, with the next step's quorum after the kill.
    want = {1: [0, 1, 2], 2: [0, 1, 2], 3: [0, 2], 4: [0, 2], 5: [0, 1, 2], 6: [0, 1, 2]}
    for r in survivors:
        assert quorum_slots(r) == want
        assert r.quorums[5][1] == 3  # slot 1 is now the spare's process
    assert quorum_slots(joiner) == {5: want[5], 6: want[6]}
    # (b) healing: slot 0 (the lowest that stayed) sent its state; the joiner's differed before
    # and equals it bit for bit after; from then on every replica holds the same parameters.
    assert list(run.results[0].sent) == [5] and not run.results[2].sent and list(joiner.received) == [5]
    assert not torch.equal(joiner.before_heal[5], joiner.received[5])
    assert torch.equal(joiner.received[5], run.results[0].sent[5])
    assert torch.equal(joiner.final_params, survivors[0].final_params)
    assert torch.equal(survivors[1].final_params, survivors[0].final_params)
    # (c) the run equals the replay of the same data and quorum sequence ...
    ref = replay(cfg, want)
    torch.testing.assert_close(joiner.final_params, ref["final_params"], rtol=RTOL, atol=ATOL)
    checked = 0
    for t, q in want.items():
        for s in q:
            owner = joiner if (s == 1 and t >= 5) else run.results[s]
            if owner is not None:  # the killed process's losses died with it
                assert owner.losses[t] == pytest.approx(ref["losses"][t][s], rel=RTOL)
                checked += 1
    assert checked == 14  # 2 survivors x 6 steps + the joiner's 2
    # ... and differs from a run that never failed only by the outage's smaller global batch:
    # the replay with every quorum full is measurably elsewhere (so the comparison above can fail).
    full = replay(cfg, {t: [0, 1, 2] for t in want})
    assert (full["final_params"] - ref["final_params"]).abs().max() > 100 * ATOL


def test_the_leader_killed_the_next_lowest_leads_and_heals():
    cfg = FtConfig(replicas=2, steps=5, kill_slot=0, kill_step=2, rejoin_step=4, seed=3)
    run = run_ft(cfg, timeout_s=TIMEOUT_S)
    assert run.exitcodes == [-HARD_KILL, 0, 0]
    want = {1: [0, 1], 2: [1], 3: [1], 4: [0, 1], 5: [0, 1]}
    assert quorum_slots(run.results[1]) == want
    assert list(run.results[1].sent) == [4]
    assert torch.equal(run.results[2].received[4], run.results[1].sent[4])
    ref = replay(cfg, want)
    for r in run.results[1:]:
        torch.testing.assert_close(r.final_params, ref["final_params"], rtol=RTOL, atol=ATOL)


def test_a_failure_without_restart_leaves_the_survivor_training_alone():
    cfg = FtConfig(replicas=2, steps=4, kill_slot=1, kill_step=2)
    run = run_ft(cfg, timeout_s=TIMEOUT_S)
    assert run.exitcodes == [0, -HARD_KILL]
    want = {1: [0, 1], 2: [0], 3: [0], 4: [0]}
    assert quorum_slots(run.results[0]) == want
    torch.testing.assert_close(run.results[0].final_params, replay(cfg, want)["final_params"], rtol=RTOL, atol=ATOL)


def test_no_failure_is_data_parallel_over_every_replica():
    cfg = FtConfig(replicas=3, steps=4)
    run = run_ft(cfg, timeout_s=TIMEOUT_S)
    assert run.exitcodes == [0, 0, 0]
    assert all(quorum_slots(r) == {t: [0, 1, 2] for t in range(1, 5)} for r in run.results)
    ref = replay(cfg, {t: [0, 1, 2] for t in range(1, 5)})
    for r in run.results:
        torch.testing.assert_close(r.final_params, ref["final_params"], rtol=RTOL, atol=ATOL)


def test_the_first_proposal_is_everyones_quorum():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set("alive/1/0", "0")
    # slot 1 is late: after the timeout the quorum is {0} ...
    assert decide_quorum(store, 1, {0: 0, 1: 1}, 2, timeout_s=0.05) == {0: 0}
    # ... and stays {0} for a replica that decides after slot 1 arrived: one quorum per step.
    store.set("alive/1/1", "1")
    assert decide_quorum(store, 1, {0: 0, 1: 1}, 2, timeout_s=0.05) == {0: 0}
    # a joiner announced for step 2 (slot 1 on process 2) is in step 2's quorum
    store.set("alive/2/0", "0")
    store.set("alive/2/1", "2")
    assert decide_quorum(store, 2, {0: 0}, 2, timeout_s=5) == {0: 0, 1: 2}


def test_a_process_known_to_have_ended_is_not_waited_for():
    """The parent writes ended/<rank> when it sees a replica's process exit (wait_processes): the
    quorum closes at once instead of after quorum_timeout_s (600 s here; the join's 60 s bound only
    keeps a wrong implementation from holding the suite for ten minutes)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.set("alive/3/0", "0")
    store.set("alive/3/2", "2")
    store.set("ended/1", "-9")  # slot 1's process, SIGKILLed
    got = []
    waiter = threading.Thread(target=lambda: got.append(decide_quorum(store, 3, {0: 0, 1: 1, 2: 2}, 3, 600.0)),
                              daemon=True)
    waiter.start()
    waiter.join(60)
    assert got == [{0: 0, 2: 2}]
    # a slot whose process is alive is still waited for (until it announces itself)
    store.set("alive/4/0", "0")
    waiter = threading.Thread(target=lambda: got.append(decide_quorum(store, 4, {0: 0, 2: 2}, 3, 600.0)),
                              daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and len(got) == 1
    store.set("alive/4/2", "2")
    waiter.join(60)
    assert got[1] == {0: 0, 2: 2}


@pytest.mark.parametrize("kwargs, message", [
    (dict(kill_slot=1, kill_step=7), "kill_step=7 must be in 1..steps=6"),
    (dict(kill_slot=2, kill_step=3), "kill_slot=2 is out of range: replicas are 0..1"),
    (dict(kill_slot=1, kill_step=3, rejoin_step=3), "rejoin_step=3 must be in kill_step + 1..steps = 4..6"),
    (dict(kill_slot=1, kill_step=3, rejoin_step=2), "rejoin_step=2 must be in"),
    (dict(kill_slot=1, kill_step=3, rejoin_step=7), "rejoin_step=7 must be in"),
    (dict(rejoin_step=3), "rejoin_step=3 without a failure"),
    (dict(kill_slot=1), "give both or neither"),
    (dict(replicas=1), "replicas=1 must be an int >= 2"),
])
def test_bad_input_is_refused_before_any_process_starts(kwargs, message, monkeypatch):
    cfg = FtConfig(**{"replicas": 2, "steps": 6, **kwargs})
    with pytest.raises(ValueError, match=re.escape(message)):
        check_ft(cfg)
    started = []  # run_ft refuses it before it makes a process context, let alone a process
    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: started.append(method))
    with pytest.raises(ValueError, match=re.escape(message)):
        run_ft(cfg, timeout_s=TIMEOUT_S)
    assert started == []


# DiLoCo on fault-tolerant replicas (course_lib.parallel.ft.local): the quorum at the syncs only.
# The outer step is written by hand on the processes and is torch's SGD(nesterov=True) in the
# replay: the same arithmetic up to the order of a multiply-add, then AdamW (measured: 1.3e-8 in
# RMS at lr 1e-2), so the parameters are held to param_rms_tolerance (its reasons: 1e-3 a lr,
# a = lr_out / (1 - mu)) and the losses to adamw_loss_atol.
def _diloco_close(run, cfg, quorums):
    ref = replay(cfg, quorums)
    tol = param_rms_tolerance(cfg.lr, cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum)
    checked = 0
    for r in run.results:
        if r is None:
            continue
        for t, loss in r.losses.items():
            assert abs(loss - ref["losses"][t][r.slot]) <= adamw_loss_atol(cfg.lr)
            checked += 1
        rms = float((r.final_params - ref["replica_params"][r.slot]).double().pow(2).mean().sqrt())
        assert rms <= tol, (r.slot, rms, tol)
    return ref, checked


def test_diloco_replica_killed_between_syncs_the_next_sync_excludes_it_and_the_spare_rejoins():
    cfg = FtConfig(replicas=3, steps=8, algorithm="diloco", inner_steps=2, kill_slot=1, kill_step=3,
                   rejoin_step=6)
    run = run_ft(cfg, timeout_s=TIMEOUT_S)
    assert run.exitcodes == [0, -HARD_KILL, 0, 0] and run.results[1] is None
    want = {2: [0, 1, 2], 4: [0, 2], 6: [0, 1, 2], 8: [0, 1, 2]}  # quorums at the syncs only
    survivors, joiner = [run.results[0], run.results[2]], run.results[3]
    for r in survivors:
        assert quorum_slots(r) == want
        assert sorted(r.losses) == list(range(1, 9))  # never stopped: a loss every step
    assert quorum_slots(joiner) == {6: want[6], 8: want[8]} and sorted(joiner.losses) == [7, 8]
    # healing after the outer step of sync 6: the state (parameters, AdamW, theta_0, b) bit for bit
    assert list(run.results[0].sent) == [6] and list(joiner.received) == [6]
    assert not torch.equal(joiner.before_heal[6], joiner.received[6])
    assert torch.equal(joiner.received[6], run.results[0].sent[6])
    # the last step is a sync: every replica holds theta_0
    assert torch.equal(joiner.final_params, survivors[0].final_params)
    assert torch.equal(survivors[1].final_params, survivors[0].final_params)
    ref, checked = _diloco_close(run, cfg, want)
    assert checked == 8 + 8 + 2
    # a run that never failed is measurably elsewhere, so the comparison above can fail
    full = replay(FtConfig(replicas=3, steps=8, algorithm="diloco", inner_steps=2), {t: [0, 1, 2] for t in want})
    tol = 1e-3 * cfg.outer_lr / (1 - cfg.outer_momentum) * cfg.lr
    assert (full["final_params"] - ref["final_params"]).abs().max() > 10 * tol


def test_diloco_leader_killed_at_a_sync_step_without_restart():
    cfg = FtConfig(replicas=2, steps=6, algorithm="diloco", inner_steps=2, kill_slot=0, kill_step=2, seed=3)
    run = run_ft(cfg, timeout_s=TIMEOUT_S)
    assert run.exitcodes == [-HARD_KILL, 0]
    want = {2: [1], 4: [1], 6: [1]}
    assert quorum_slots(run.results[1]) == want
    _, checked = _diloco_close(run, cfg, want)
    assert checked == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(algorithm="zero"), "algorithm='zero' must be one of ('ddp', 'diloco')"),
    (dict(inner_steps=2), "inner_steps=2 with algorithm='ddp'"),
    (dict(algorithm="diloco", inner_steps=0), "inner_steps=0 must be an int >= 1"),
    (dict(algorithm="diloco", outer_momentum=1.0), "outer_momentum=1.0 must be in [0, 1)"),
    (dict(algorithm="diloco", inner_steps=2, kill_slot=1, kill_step=2, rejoin_step=3),
     "rejoin_step=3 must be a multiple of inner_steps=2"),
])
def test_bad_diloco_input_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_ft(FtConfig(**{"replicas": 2, "steps": 6, **kwargs}))
