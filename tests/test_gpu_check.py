"""`make gpu-check` (tools/gpu_check.py): its plan and its refusal, checked without a GPU.

The plan is what a lent GPU machine will run, once, with little time to spare: every planned demo
command is run here through its own parser and layout rules, up to the point where it would
join the process group, for 1, 2, 4 and 8 GPUs, so a command a demo would refuse is found here
and not on the lent machine."""

import importlib
import os
import pathlib
import subprocess
import sys
from unittest import mock

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


class Joined(Exception):
    """Raised where the demo would join the process group: every rule before it held."""


def _reaches_the_group(step):
    module = importlib.import_module(f"course_lib.demos.{step.name}")
    # a demo started by demos.verdict.run_demo joins the group there
    joins = module if hasattr(module, "init_from_env") else importlib.import_module("course_lib.demos.verdict")
    env = {"WORLD_SIZE": str(step.world), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(step.world)}
    with mock.patch.dict(os.environ, env), mock.patch.object(joins, "init_from_env", side_effect=Joined):
        try:
            module.main(step.args)
        except Joined:
            return True
        except SystemExit as e:  # argparse or a refused layout
            pytest.fail(f"{step.name} {' '.join(step.args)} at world {step.world} exits {e.code}")
    pytest.fail(f"{step.name} returned before joining the group at world {step.world}")


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_every_planned_demo_passes_its_own_rules(gpus, capsys):
    steps = gpu_check.plan(gpus)
    assert all(1 <= s.world <= gpus for s in steps if not s.skip)
    for step in steps:
        if not step.skip:
            assert _reaches_the_group(step), step
    out = capsys.readouterr()
    assert "bad layout" not in out.err, out.err


def test_the_plan_uses_every_gpu_and_says_why_it_skips():
    one, eight = gpu_check.plan(1), gpu_check.plan(8)
    assert {s.name for s in one} == {s.name for s in eight}  # every demo planned, run or skipped
    assert [s.skip for s in one if s.skip] == ["sequence parallelism splits the sequence over >= 2 tp ranks",
                                               "async TP decomposes sequence parallelism's collectives over >= 2 "
                                               "tp ranks",
                                               "zbv places two chunks per rank in a V over >= 2 ranks",
                                               "it kills rank 1 of >= 2 and restarts the group",
                                               "trainer and generator are two groups of ranks: >= 2 GPUs",
                                               "it fails on purpose: the debugging notebook runs it",
                                               "configs/capstone_tiny.toml lays out 8 ranks; 1 GPU(s) here"]
    assert [s.name for s in eight if s.skip] == ["broken_run"]
    demos = {p.stem for p in (ROOT / "course_lib" / "demos").glob("*.py")  # a helper module (verdict,
             if "\ndef main(" in p.read_text()}  # diloco_kill: the diloco demo's --kill-replica) is no demo
    assert {s.name for s in eight} == demos  # a new demo must be planned (or skipped with its reason)
    assert max(s.world for s in eight) == 8 and all(s.world == 1 for s in one if not s.skip)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_gpu_count_is_refused(bad):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        gpu_check.plan(bad)


def test_without_a_gpu_it_refuses_before_starting_anything(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "make test-nccl-rules" in proc.stderr
    assert not out.exists()
