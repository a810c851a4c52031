"""NCCL's device rule on gloo ranks (course_lib/observe/device_rule.py): every tensor handed to a
communication call must be on the rank's own device. On CPU ranks the CPU stands for the GPU and
the rule tracks tensors created without a device (CPU by default, also on a GPU rank)."""

import pytest
import torch
import torch.distributed as dist

from course_lib.observe.device_rule import DeviceRuleError, enforced, under_rule
from course_lib.runtime import RankError, run_on_ranks
from course_lib.runtime.device import rank_device


def _host_scalar():
    with enforced(rank_device()):
        dist.all_reduce(torch.tensor([1.0]))  # the pattern of issue 46, point 2: no device given


def test_a_tensor_made_without_a_device_is_refused_naming_call_and_devices():
    with pytest.raises(RankError) as e:
        run_on_ranks(_host_scalar, world_size=2, timeout_s=60)
    assert "DeviceRuleError" in str(e.value) and "all_reduce was handed tensor" in str(e.value)
    assert "device cpu" in str(e.value)


def _made_on_the_rank_device():
    with enforced(rank_device()):
        model = torch.nn.Linear(2, 2).to(rank_device())
        t = torch.tensor([float(dist.get_rank() + 1)], device=rank_device())
        dist.all_reduce(t)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # from parameters on the device
        dist.broadcast(flat, src=0)
        out = [None, None]
        dist.all_gather_object(out, {"rank": dist.get_rank()})  # object collectives: torch places them
        moved = torch.ones(1).to(rank_device())  # made on the host, then moved: fine
        dist.all_reduce(moved)
        return t.item(), moved.item(), out


def test_tensors_made_on_the_rank_device_pass_with_the_same_numbers():
    assert run_on_ranks(_made_on_the_rank_device, world_size=2, timeout_s=60) == [
        (3.0, 2.0, [{"rank": 0}, {"rank": 1}])] * 2


def _moved_to_host():
    with enforced(rank_device()):
        t = torch.zeros(2, device=rank_device()).cpu()
        dist.all_reduce(t * 2)  # computed from a host tensor only: still on the host


def test_a_tensor_moved_to_the_host_is_refused():
    with pytest.raises(RankError, match="all_reduce was handed tensor"):
        run_on_ranks(_moved_to_host, world_size=2, timeout_s=60)


def _stand_in_device():
    with enforced(torch.device("meta")):  # any device other than the CPU: compared directly
        dist.all_reduce(torch.zeros(1))


def test_a_non_cpu_rank_device_is_compared_directly():
    with pytest.raises(RankError) as e:
        run_on_ranks(_stand_in_device, world_size=2, timeout_s=60)
    assert "on device cpu, but the rank's device is meta" in str(e.value)


def _zero_demo():
    from course_lib.demos.zero import zero_demo

    return zero_demo(1, steps=2)["losses"]


def test_zero_demo_under_the_rule_gives_the_same_losses():
    plain = run_on_ranks(_zero_demo, world_size=2, timeout_s=300)
    ruled = run_on_ranks(under_rule(_zero_demo, rank_device), world_size=2, timeout_s=300)
    assert ruled == plain  # exact: the rule only watches


def _flat_run(save_dir):
    from course_lib.checkpoint.flat import train_zero3_flat
    from course_lib.data import CharDataset
    from course_lib.model import GPTConfig
    from course_lib.train import TrainConfig

    config = GPTConfig.tiny(CharDataset("train").vocab_size)
    return train_zero3_flat(config, TrainConfig(steps=2, batch_size=4, progress=False), save_dir=save_dir).train_losses


def test_flat_checkpoint_training_under_the_rule(tmp_path):
    assert run_on_ranks(under_rule(_flat_run, rank_device), str(tmp_path), world_size=2, timeout_s=300)


def _pipedream():
    from course_lib.data import CharDataset
    from course_lib.model import GPTConfig
    from course_lib.parallel.pp.pipedream import train_2bw
    from course_lib.train import TrainConfig

    config = GPTConfig.tiny(CharDataset("train").vocab_size, tie_weights=False)
    return train_2bw(config, TrainConfig(steps=2, batch_size=4, grad_clip=0, progress=False), 2).train_losses


def test_pipedream_2bw_end_of_run_losses_under_the_rule():
    plain = run_on_ranks(_pipedream, world_size=2, timeout_s=300)
    assert run_on_ranks(under_rule(_pipedream, rank_device), world_size=2, timeout_s=300) == plain


def _pipeline_demo(env_extra):
    import os
    import pathlib
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.pipeline", "--schedule", "1f1b", "--microbatches", "4", "--steps", "2"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=pathlib.Path(__file__).parents[1],
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env_extra})


def test_pipeline_demo_under_torchrun_with_the_rule():
    import re

    proc = _pipeline_demo({"COURSE_NCCL_RULES": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [s for s in re.findall(r"step (\d): pipeline loss", proc.stdout)] == ["1", "2"], proc.stdout


def _mended(name, bad_rank):
    from course_lib.debugging import BUGS

    return BUGS[name].rank_fn(True, bad_rank)


def _bugs():
    from course_lib.debugging import BUGS

    return sorted(BUGS)


@pytest.mark.parametrize("name", _bugs())
def test_broken_run_entries_mended_twin_under_the_rule(name):
    from course_lib.debugging import BUGS

    bug = BUGS[name]
    plain = run_on_ranks(_mended, name, bug.bad_rank, world_size=bug.world_size, timeout_s=120)
    ruled = run_on_ranks(under_rule(_mended, rank_device), name, bug.bad_rank, world_size=bug.world_size,
                         timeout_s=120)
    assert ruled == plain  # exact: the rule only watches, and the tensors' device is the CPU's here


def _fp8_gather():
    from course_lib.techniques.fp8 import all_gather_fp8

    shard = torch.linspace(-1, 1, 64, device=rank_device()) * (dist.get_rank() + 1)
    full, sizes = all_gather_fp8(shard)
    return full.tolist(), sizes


def test_fp8_all_gather_under_the_rule():
    plain = run_on_ranks(_fp8_gather, world_size=2, timeout_s=60)
    assert run_on_ranks(under_rule(_fp8_gather, rank_device), world_size=2, timeout_s=60) == plain


def _hello():  # README's first example, as written there
    from course_lib import CommTracer

    t = torch.tensor([dist.get_rank() + 1.0], device=rank_device())
    with CommTracer() as tracer:
        dist.all_reduce(t)
    return t.item(), tracer.summary()["all_reduce"]["calls"]


def test_readme_hello_under_the_rule():
    import pathlib

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    line = "    t = torch.tensor([dist.get_rank() + 1.0], device=rank_device())  # the rank's GPU under NCCL"
    assert line in readme  # the line _hello runs
    assert run_on_ranks(under_rule(_hello, rank_device), world_size=4, timeout_s=60) == [(10.0, 1)] * 4


def _paced():
    from course_lib.measure.calibrate import paced_seconds

    return isinstance(paced_seconds(lambda: None, 0.005), float)


def test_calibration_pacing_under_the_rule():
    assert run_on_ranks(under_rule(_paced, rank_device), world_size=2, timeout_s=60) == [True, True]


def _timers(device):
    from course_lib.comm import costmodel
    from course_lib.comm.measured import measure_table

    dev = None if device is None else rank_device()
    pp = costmodel.ping_pong((8, 1024), rounds=1, iters=1, device=dev)
    t = costmodel.time_collective(dist.all_reduce, 1024, iters=1, device=dev)
    table = measure_table([1024], [2], ops=("all_reduce", "send"), iters=1, rounds=1, device=dev)
    return (pp is None) == (dist.get_rank() != 0), t > 0, sorted(table)


def test_cost_model_timers_take_the_rank_device():
    """The timers of notebook 02 and the calibration table: buffers on the device handed in."""
    assert run_on_ranks(under_rule(_timers, rank_device), "rank", world_size=2, timeout_s=60) == [
        (True, True, ["all_reduce", "send"])] * 2


def test_cost_model_timers_without_a_device_are_refused_under_the_rule():
    with pytest.raises(RankError, match="DeviceRuleError"):
        run_on_ranks(under_rule(_timers, rank_device), None, world_size=2, timeout_s=60)


def test_the_environment_variable_turns_the_rule_on_for_every_rank_call():
    import os
    import pathlib
    import subprocess
    import sys

    script = ("import torch, torch.distributed as dist\n"
              "from course_lib.runtime import run_on_ranks\n"
              "def f():\n"
              "    dist.all_reduce(torch.ones(1))\n"
              "run_on_ranks(f, world_size=2, timeout_s=60)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).parents[1], env={**os.environ, "COURSE_NCCL_RULES": "1"})
    assert proc.returncode != 0 and "DeviceRuleError" in proc.stderr and "all_reduce was handed tensor" in proc.stderr


def _traced():
    from course_lib.observe.tracer import CommTracer

    t = torch.ones(4, device=rank_device())
    with CommTracer() as tracer:
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(8, device=rank_device()), t)
    return tracer.summary()


def test_the_rule_leaves_the_tracers_counts_alone():
    """torch hands a collective to the rule's tensor tracker by its patched module-level name; the
    collective checks' own fingerprint exchange was counted as two all_gather_single calls so."""
    plain = run_on_ranks(_traced, world_size=2, timeout_s=60)
    assert run_on_ranks(under_rule(_traced, rank_device), world_size=2, timeout_s=60) == plain
    assert set(plain[0]) == {"all_reduce", "all_gather_into_tensor"}
