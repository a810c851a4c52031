"""The elastic demo under torchrun (gloo, CPU): a rank killed on purpose, torchrun restarting the
group, the resumed losses equal to an uninterrupted run; then resuming at another world size;
a resume that forgets part of the state fails its check."""

import os
import pathlib
import subprocess
import sys

import pytest

from course_lib.checkpoint import complete_checkpoints
from course_lib.checkpoint.training import read_events
from course_lib.demos.elastic import compare_losses
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig
from _demo_cli import run_main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def torchrun(nproc, restarts, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--max-restarts", str(restarts), "-m", "course_lib.demos.elastic",
           "--block-size", "16", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_killed_rank_restart_resume_and_another_world_size(tmp_path):
    d = tmp_path / "ckpt"
    proc = torchrun(2, 1, "--steps", 8, "--checkpoint-every", 3, "--checkpoint-dir", d,
                    "--kill-rank", 1, "--kill-at-step", 6, "--check")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 1: killed at the start of step 6" in proc.stdout
    assert "resumed from step_00000003 (saved at 2 ranks) on 2 ranks" in proc.stdout
    assert "check: resumed vs uninterrupted losses equal bit for bit" in proc.stdout
    events = read_events(d)
    kinds = [(e["event"], e["step"]) for e in events if e["event"] != "step"]
    assert kinds == [("save", 3), ("kill", 6), ("resume", 3), ("save", 6)]
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]  # 4 and 5 recomputed: lost work, nothing skipped
    first, again = [e for e in events if e["event"] == "step" and e["step"] in (4, 5)][:2], \
        [e for e in events if e["event"] == "step" and e["step"] in (4, 5)][2:]
    assert [e["loss"] for e in first] == [e["loss"] for e in again]

    # the same directory at one rank: resharded from 2 ranks, checked within float rounding
    proc = torchrun(1, 0, "--steps", 9, "--checkpoint-every", 3, "--checkpoint-dir", d, "--check")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from step_00000006 (saved at 2 ranks) on 1 ranks" in proc.stdout
    # the demo's loss tolerance: 2 ranks sum the gradient in another order than 1, and AdamW
    # magnifies that rounding near g = 0 (course_lib.tolerances.adamw_loss_atol: 7e-5 at lr 3e-3)
    assert f"within {adamw_loss_atol(TrainConfig().lr):g} (the world size changed)" in proc.stdout
    assert [s for s, _ in complete_checkpoints(d)] == [3, 6, 9]


def test_a_resume_that_forgets_the_optimizer_state_fails_the_check(tmp_path):
    """One process launched the way torchrun would (its environment, no agent: faster)."""
    import socket

    from course_lib import run_on_ranks
    from course_lib.demos.elastic import configs, parse_args
    from course_lib.checkpoint.training import train_with_checkpoints

    d = tmp_path / "ckpt"
    args = parse_args(["--steps", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(d), "--block-size", "16"])
    run_on_ranks(train_with_checkpoints, *configs(args), str(d), 2, world_size=1, timeout_s=120)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-m", "course_lib.demos.elastic", "--steps", "4", "--checkpoint-every", "2",
                           "--checkpoint-dir", str(d), "--block-size", "16", "--forget", "optimizer", "--check"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from step_00000002" in proc.stdout and "losses DIFFERENT bit for bit" in proc.stdout


def test_compare_losses_and_bad_arguments():
    lr = 3e-3  # adamw_loss_atol(3e-3) = 7e-5
    assert compare_losses([1.0, 2.0], [1.0, 2.0], exact=True, lr=lr) == (True, 0.0)
    assert compare_losses([1.0, 2.0], [1.0, 2.00001], exact=True, lr=lr)[0] is False
    assert compare_losses([1.0, 2.0], [1.0, 2.00001], exact=False, lr=lr)[0] is True
    assert compare_losses([1.0, 2.0], [1.0, 2.0001], exact=False, lr=lr)[0] is False
    assert compare_losses([1.0], [1.0, 2.0], exact=False, lr=lr)[0] is False
    code, err = run_main("course_lib.demos.elastic", ["--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir",
                                                      "x", "--kill-rank", "1"])
    assert code != 0 and "--kill-rank and --kill-at-step go together" in err


@pytest.mark.parametrize("argv,message", [(["--steps", "0"], "--steps=0"), (["--checkpoint-every", "0"], "=0 must be")])
def test_demo_rejects_bad_counts(argv, message):
    base = {"--steps": "4", "--checkpoint-every": "2"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    args = [x for kv in base.items() for x in kv] + ["--checkpoint-dir", "x"]
    code, err = run_main("course_lib.demos.elastic", args)
    assert code != 0 and message in err


def test_llama3_job_mtbf_is_one_value_two_ways():
    """Notebook 12's section 9 prices every interval with one job MTBF: Llama 3's unexpected
    interruptions (Dubey et al. 2024: 419 in 54 days on 16,384 GPUs)."""
    from course_lib.checkpoint.interval import (LLAMA3_GPUS, job_mtbf_hours, llama3_job_mtbf_hours,
                                                llama3_per_gpu_mtbf_hours)
    m = llama3_job_mtbf_hours(unexpected_only=True)
    assert abs(m - job_mtbf_hours(llama3_per_gpu_mtbf_hours(), LLAMA3_GPUS)) < 1e-12 * m  # float64 rounding only
    assert round(m, 2) == 3.09 and round(llama3_job_mtbf_hours(), 2) == 2.78  # 54 * 24 / 419 and / 466
