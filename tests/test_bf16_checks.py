"""The bf16 `--check` of every demo that offers one (course_lib.demos.zero --bf16, course_lib.demos.capstone
with precision = "bf16") passes on a correct run and fails on a deliberately wrong reduction.

The bf16 losses used to be bf16 numbers (1/32 apart near 4), so the zero demo accepted 4.5e-2, and
a wrong reduction moves a bf16 run's loss by as little as 3e-3 in a few steps: a loss check alone
cannot fail on it. The checks now compare fp32 losses (the cross-entropy of fp32 logits) within
course_lib.tolerances.BF16_LOSS_ATOL and the first step's gradient norm, taken before AdamW has
amplified any rounding, within FIRST_GRAD_NORM_RTOL["bf16"] (their reasons are there).

The wrong reductions, each patched into the ranks for one run and removed after it (the ranks are
reused): one unit's reduce-scatter skipped (each rank keeps its own chunk of its local gradient),
and a sum where a mean belongs (the reduced gradient times N). The demos' rank code runs in-process
(run_on_ranks), their check functions on its results; one torchrun launch runs the zero demo's
command line with --bf16 --check.
"""

import contextlib
import dataclasses
import os
import subprocess
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.capstone import load_config
from course_lib.demos.capstone import check_run as capstone_check
from course_lib.demos.zero import check_run as zero_check, zero_demo
from course_lib.parallel.hybrid import train_single
from course_lib.train import TrainConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "capstone_tiny.toml")
BUGS = (None, "unreduced", "summed")


def _wrong(real, bug):
    """A reduce_scatter_single that skips the reduction (unreduced) or sums where a mean belongs."""
    def reduce_scatter(out, inp, group=None, async_op=False):
        n = dist.get_world_size(group)
        if bug == "unreduced":  # this rank's own chunk of its local gradient: nothing sent
            out.copy_(inp.view(n, -1)[dist.get_rank(group)])
            return None
        work = real(out, inp, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        out.mul_(n)  # the callers divided before the sum: n times the mean
        return None
    return reduce_scatter


@contextlib.contextmanager
def _per_param_bug(bug, unit_name="block0"):
    """Per-parameter ZeRO-3: unit `unit_name`'s gradient reduced wrongly (every other unit right)."""
    from course_lib.parallel.zero import per_param

    method, real = per_param.Unit.reduce_gradients, per_param.reduce_scatter_single

    def reduce_gradients(self, grads):
        if self.name != unit_name:
            return method(self, grads)
        per_param.reduce_scatter_single = _wrong(real, bug)
        try:
            return method(self, grads)
        finally:
            per_param.reduce_scatter_single = real

    per_param.Unit.reduce_gradients = reduce_gradients
    try:
        yield
    finally:
        per_param.Unit.reduce_gradients = method


@contextlib.contextmanager
def _sharded_bug(bug):
    """ZeRO-1's engine (ShardedOptimizer, also the capstone's over dp): its first unit's gradient
    reduced wrongly (every other unit right)."""
    from course_lib.parallel.zero import sharded_optimizer as so

    method, real = so.ShardedOptimizer.reduce_gradients, so.reduce_scatter_single

    def reduce_gradients(self):
        calls = [0]

        def first_wrong(out, inp, group=None, async_op=False):
            calls[0] += 1
            return (_wrong(real, bug) if calls[0] == 1 else real)(out, inp, group=group, async_op=async_op)

        so.reduce_scatter_single = first_wrong
        try:
            return method(self)
        finally:
            so.reduce_scatter_single = real

    so.ShardedOptimizer.reduce_gradients = reduce_gradients
    try:
        yield
    finally:
        so.ShardedOptimizer.reduce_gradients = method


def _zero_runs(stage, sharding, hsdp):
    out = {}
    for bug in BUGS:
        patch = contextlib.nullcontext() if bug is None else (
            _per_param_bug(bug) if sharding == "per_param" else _sharded_bug(bug))
        with patch:
            out[bug] = zero_demo(stage, steps=2, bf16=True, batch_size=8 * dist.get_world_size(), sharding=sharding,
                                 hsdp=hsdp)
    return out


@pytest.mark.parametrize("world_size, stage, sharding, hsdp", [
    (4, 3, "per_param", 2),  # HSDP 2 x 2: the layout whose bf16 check accepted 4.17e-2 (at 2 x 3)
    (2, 1, "flat", 1),  # ZeRO-1's flat shards
])
def test_zero_demo_bf16_check_fails_on_a_wrong_reduction(world_size, stage, sharding, hsdp):
    first = run_on_ranks(_zero_runs, stage, sharding, hsdp, world_size=world_size, timeout_s=300)[0]
    lr = TrainConfig().lr  # the demo's
    ok, verdict = zero_check(first[None], True, lr)
    assert ok, verdict
    ref = first[None]["reference"]  # fp32 losses: not all on bf16's grid (1/32 apart near 4)
    assert not all(float(torch.tensor(x, dtype=torch.bfloat16)) == x for x in ref), ref
    for bug in BUGS[1:]:
        ok, verdict = zero_check(first[bug], True, lr)
        assert not ok and "check FAILED" in verdict, (bug, verdict)


def _capstone_runs(dims, config, directory):
    from course_lib.capstone import train_segment

    out = {}
    for bug in BUGS:
        with contextlib.nullcontext() if bug is None else _sharded_bug(bug):
            res = train_segment(dims, config.model, config.train, os.path.join(directory, str(bug)), 1,
                                config.train.steps)
        out[bug] = {"losses": res.train_losses, "norms": res.grad_norms}
    return out


def test_capstone_bf16_check_fails_on_a_wrong_reduction(tmp_path):
    """The tiny capstone's model, training and bf16 precision at dp2 (two ranks, ZeRO-1 over dp)."""
    config = load_config(TINY)
    assert config.precision == "bf16"
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2))  # steps 1-2 suffice
    dims = dataclasses.replace(config.layout, tp=1, pp=1, dp=2, microbatches=1)
    runs = run_on_ranks(_capstone_runs, dims, config, str(tmp_path), world_size=2, timeout_s=300)[0]
    reference = train_single(config.model, config.train, config.precision, config.recompute)
    for bug in BUGS:
        res = dataclasses.replace(reference, train_losses=runs[bug]["losses"], grad_norms=runs[bug]["norms"])
        ok, lines = capstone_check(res, reference, config.precision, config.tolerance)
        assert ok == (bug is None), (bug, lines)
        assert len(lines) == config.train.steps + 2 and "not recorded" not in lines[-1], lines


def test_zero_demo_bf16_check_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.zero", "--stage", "2", "--steps", "2", "--bf16", "--check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "check passed: largest loss difference" in proc.stdout and "first gradient norm" in proc.stdout
