"""course_lib.demos.zero --optimizer muon: under torchrun on 2 gloo ranks, --check, bad flags."""

import os
import pathlib
import re
import subprocess
import sys

from _demo_cli import run_main
from course_lib.demos.zero import MUON_LOSS_ATOL, check_muon

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_muon_demo_under_torchrun_with_gloo():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.zero", "--stage", "1", "--steps", "3", "--optimizer", "muon",
           "--muon-method", "owner", "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Muon (owner) + AdamW on 2 ranks" in proc.stdout and "check passed" in proc.stdout
    rows = re.findall(r"^\s+(\d)\s+(\d+\.\d+)\s+(\d+\.\d+)$", proc.stdout, re.M)
    # printed to 5 decimals: within MUON_LOSS_ATOL (its reason in course_lib.demos.zero) + 1e-5
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(abs(float(a) - float(b)) <= MUON_LOSS_ATOL + 1e-5 for _, a, b in rows)
    for rank in (0, 1):  # traced bytes / formula, equal strings
        line = re.search(rf"^rank {rank}: (.*)$", proc.stdout, re.M).group(1)
        pairs = re.findall(r"([\d.]+ \w?i?B) / ([\d.]+ \w?i?B)", line)
        assert len(pairs) == 2 and all(a == b for a, b in pairs), line


def test_check_fails_on_a_loss_or_a_byte_mismatch():
    good = {"losses": [4.5, 4.2], "reference": [4.5, 4.2], "bytes": {"gather": {"calls": 1}},
            "formula": {"gather": {"calls": 1}}}
    assert check_muon([good, good])[0]
    far = {**good, "losses": [4.5, 4.2 + 2 * MUON_LOSS_ATOL]}
    assert not check_muon([far, good])[0]
    nan = {**good, "losses": [4.5, float("nan")]}
    assert not check_muon([nan, good])[0]
    extra = {**good, "bytes": {"gather": {"calls": 2}}}
    ok, verdict = check_muon([good, extra])
    assert not ok and "DIFFER" in verdict


def test_muon_demo_rejects_bad_flags():
    code, err = run_main("course_lib.demos.zero", ["--stage", "3", "--optimizer", "muon"])
    assert code == 2 and "--optimizer muon runs ZeRO-1 in fp32: --stage 1" in err
    code, err = run_main("course_lib.demos.zero", ["--stage", "1", "--optimizer", "muon", "--muon-method", "local"])
    assert code == 2 and "invalid choice: 'local'" in err
    code, err = run_main("course_lib.demos.zero", ["--stage", "1", "--optimizer", "muon", "--bf16"])
    assert code == 2 and "without --bf16" in err
