"""The DiLoCo demo (course_lib/demos/diloco.py): under torchrun on 2 gloo ranks with --check, its
refusals of bad flags before any rank waits, and its verdict failing on a wrong result; the same
for --kill-replica (course_lib/demos/diloco_kill.py)."""

import os
import pathlib
import subprocess
import sys
from dataclasses import replace

import pytest

from course_lib.demos import diloco as demo
from course_lib.demos import diloco_kill
from course_lib.estimate.traffic.diloco import diloco_sync_bytes
from course_lib.parallel.diloco import DilocoResult, simulate_diloco
from course_lib.parallel.ft import run_ft
from _demo_cli import run_main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_streaming_bf16_under_torchrun_matches_the_simulation():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "course_lib.demos.diloco", "--replicas", "2", "--inner-steps", "2", "--streaming", "2", "--bf16-outer",
           "--steps", "6", "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Streaming DiLoCo on 2 ranks: 2 replicas of 1 rank(s), H = 2" in proc.stdout
    assert proc.stdout.count("): OK") == 3  # both replicas' losses and the parameters
    assert "bytes across replicas, every rank and step, equal to the formula: OK" in proc.stdout


def test_fsdp_sharded_replicas_under_torchrun_match_the_simulation():
    """Two replicas of two ranks, each FSDP-sharded: 4 ranks (2 replicas need 2 ranks each to shard)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
           "course_lib.demos.diloco", "--replicas", "2", "--inner-steps", "2", "--shard", "--steps", "4", "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DiLoCo on 4 ranks: 2 replicas of 2 rank(s) (each FSDP-sharded" in proc.stdout
    assert proc.stdout.count("): OK") == 3  # both replicas' losses and the parameters
    assert "bytes across replicas, every rank and step, equal to the formula: OK" in proc.stdout


@pytest.mark.parametrize("argv, words", [
    (["--replicas", "2", "--inner-steps", "2", "--shard"], "shard=True needs replicas of >= 2 ranks"),
    (["--replicas", "3", "--inner-steps", "2"], "world size 2 must be divisible by replicas=3"),
    (["--replicas", "2", "--inner-steps", "0"], "inner_steps=0 must be an int >= 1"),
    (["--replicas", "2", "--inner-steps", "4", "--streaming", "3"], "fragments=3 must divide n_layer=4"),
    (["--replicas", "2", "--inner-steps", "2", "--outer-momentum", "1"], "outer_momentum=1.0 must be in [0, 1)"),
    (["--replicas", "2", "--inner-steps", "2", "--local-sgd", "--streaming", "2"], "--local-sgd averages"),
])
def test_bad_flags_are_refused_before_any_rank_waits(argv, words):
    code, err = run_main("course_lib.demos.diloco", argv, env={"WORLD_SIZE": "2", "RANK": "0"})
    assert code == 2 and words in err, err


def _results(options, config, train, replicas, inner_steps):
    """What the ranks would send back, made from the simulation itself (one rank per replica)."""
    e = 2 if "outer_dtype" in options and options["outer_dtype"].itemsize == 2 else 4
    want = diloco_sync_bytes(config, replicas, inner_steps, train.steps, options.get("fragments", 1), e)
    sim = simulate_diloco(config, train, replicas, inner_steps, **options)
    return [DilocoResult(train_losses=list(r.train_losses), final_params=r.final_params.clone(), replica=i,
                         sync_bytes=list(want)) for i, r in enumerate(sim)]


def test_the_verdict_fails_on_wrong_parameters_or_bytes(capsys):
    args = demo.parse(["--replicas", "2", "--inner-steps", "2", "--steps", "4", "--check"])
    options, config, train = demo.build(args, 2)
    train = replace(train, steps=4)
    good = _results(options, config, train, 2, 2)
    assert demo.report(good, args, options, config, train) == 0
    moved = _results(options, config, train, 2, 2)
    moved[1].final_params += 1e-2 * train.lr  # above the tolerance (param_rms_tolerance: 7e-3 lr)
    assert demo.report(moved, args, options, config, train) == 1
    lost = _results(options, config, train, 2, 2)
    lost[0].sync_bytes[1] += 4
    assert demo.report(lost, args, options, config, train) == 1
    assert "bytes across replicas, every rank and step, equal to the formula: MISMATCH" in capsys.readouterr().out


def test_kill_replica_under_torchrun_survivors_go_on_and_the_replay_agrees():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "course_lib.demos.diloco", "--replicas", "3", "--inner-steps", "2", "--kill-replica", "1", "--at-step", "3",
           "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "replica 1 killed at the start of step 3, restarted and joining at step 6" in out
    assert "replica 1's process: exit status -9 (SIGKILL): killed for real" in out
    assert "   4 " in out and out.split("   4 ")[1].splitlines()[0].endswith("[0, 2]")  # the next sync excludes 1
    assert "step 6: replica 1 (a new process) received" in out and "equal to what was sent, bit for bit" in out
    assert out.count(": OK") == 3  # losses, parameters, the survivors' quorums


@pytest.mark.parametrize("argv, words", [
    (["--kill-replica", "3", "--at-step", "2"], "--kill-replica=3 is not a replica: replicas are 0..1"),
    (["--kill-replica", "1", "--at-step", "0"], "--at-step=0 must be in 1..--steps=8"),
    (["--kill-replica", "1", "--at-step", "9"], "--at-step=9 must be in 1..--steps=8"),
    (["--kill-replica", "1"], "--kill-replica=1 needs --at-step S"),
    (["--at-step", "3"], "need --kill-replica K"),
    (["--kill-replica", "1", "--at-step", "3", "--rejoin-step", "5"], "rejoin_step=5 must be a multiple of inner_steps=2"),
    (["--kill-replica", "1", "--at-step", "3", "--local-sgd"], "not with --local-sgd"),
    (["--kill-replica", "1", "--at-step", "3", "--streaming", "2"], "not with --streaming"),
    (["--kill-replica", "1", "--at-step", "3", "--shard"], "not with --shard"),
])
def test_bad_kill_flags_are_refused_before_any_rank_waits(argv, words):
    code, err = run_main("course_lib.demos.diloco", ["--replicas", "2", "--inner-steps", "2", *argv],
                         env={"WORLD_SIZE": "2", "RANK": "0"})
    assert code == 2 and words in err, err


def test_the_kill_verdict_fails_on_a_wrong_replica_or_a_wrong_heal(capsys):
    args = demo.parse(["--replicas", "2", "--inner-steps", "2", "--steps", "6", "--kill-replica", "0",
                       "--at-step", "2", "--check"])
    cfg = demo.build(args, 1)[0]["ft"]
    assert (cfg.kill_slot, cfg.kill_step, cfg.rejoin_step) == (0, 2, 4)  # the second sync after the kill
    run = run_ft(cfg, timeout_s=120)
    assert diloco_kill.report(run, cfg, 1, check=True) == 0
    survivor = run.results[1]
    saved = survivor.final_params.clone()
    survivor.final_params += 1e-2 * cfg.lr  # RMS 1e-4 above param_rms_tolerance (7e-3 lr)
    assert diloco_kill.report(run, cfg, 1, check=True) == 1
    survivor.final_params = saved
    run.results[2].received[4][0] += 1.0  # the joiner's state not what was sent
    assert diloco_kill.report(run, cfg, 1, check=True) == 1
    assert "NOT what was sent" in capsys.readouterr().out
