"""The backend rule (#46, point 6): under torchrun "auto" is NCCL whenever the process sees a GPU
(one visible GPU is cuda:0, as under Slurm's --gpus-per-task=1; several: cuda:LOCAL_RANK; a local
rank beyond them is an error, never a silent CPU run), and every rank's choice is printed;
run_on_ranks (the notebooks) uses gloo unless asked. GPUs are faked by patching torch.cuda's
is_available and device_count: no GPU is needed."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.runtime import launch
from course_lib.runtime.device import launch_backend, local_device, rank_device, resolve_backend

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this process now sees n CUDA GPUs (0: none)."""
    def see(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return see


@pytest.mark.parametrize("local_rank", [0, 3])
def test_without_a_gpu_auto_is_gloo_on_the_cpu(gpus, local_rank):
    gpus(0)
    assert launch_backend("auto", local_rank, 4) == ("gloo", CPU)
    assert resolve_backend("auto", 4) == "gloo"


@pytest.mark.parametrize("local_rank", [0, 3])
def test_one_visible_gpu_per_process_is_nccl_on_cuda_0(gpus, monkeypatch, local_rank):
    """Slurm's --gpus-per-task=1 (srun starts each rank): each task's CUDA_VISIBLE_DEVICES names
    its own GPU, which the task sees as cuda:0, whatever its LOCAL_RANK. The old rule (GPUs >=
    local ranks) chose gloo."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # not started by torchrun
    gpus(1)
    assert launch_backend("auto", local_rank, 4) == ("nccl", torch.device("cuda", 0))
    assert launch_backend("nccl", local_rank, 4) == ("nccl", torch.device("cuda", 0))


def test_under_torchrun_one_visible_gpu_is_local_rank_0_s_alone(gpus, monkeypatch):
    """torchrun's workers inherit the GPUs torchrun sees, so local rank 1 seeing one GPU would
    share it with local rank 0 (NCCL: "Duplicate GPU detected"): an error naming both numbers.
    Local rank 0 takes it: alone, or one GPU per worker under --virtual-local-rank (LOCAL_RANK 0)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    gpus(1)
    assert launch_backend("auto", 0, 2) == ("nccl", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="local rank 1 would share this process's 1 visible CUDA GPU with "
                                         "local rank 0"):
        launch_backend("auto", 1, 2)


def test_several_visible_gpus_give_local_rank_i_cuda_i(gpus):
    gpus(4)
    assert [launch_backend("auto", i, 4) for i in range(4)] == [("nccl", torch.device("cuda", i)) for i in range(4)]


@pytest.mark.parametrize("local_rank", [3, 0])
def test_more_local_ranks_than_visible_gpus_is_an_error_naming_both(gpus, local_rank):
    """Local rank 3 with 2 GPUs has none; local rank 0 of the same node stops with the same
    message, so no rank of the node waits in the rendezvous for one that has left."""
    gpus(2)
    with pytest.raises(ValueError, match=r"local rank 3 has no GPU of its own: this process sees 2 CUDA GPUs "
                                         r"\(cuda:0 to cuda:1\)"):
        launch_backend("auto", local_rank, 4)
    with pytest.raises(ValueError, match="local rank 3 has no GPU of its own"):
        local_device(3, 2)


def test_forced_backends(gpus):
    gpus(4)
    assert launch_backend("gloo", 2, 4) == ("gloo", CPU)
    assert launch_backend("nccl", 2, 4) == ("nccl", torch.device("cuda", 2))
    gpus(0)
    with pytest.raises(ValueError, match="backend='nccl' needs a CUDA GPU: local rank 1 sees none"):
        launch_backend("nccl", 1, 2)
    with pytest.raises(ValueError, match="backend='mpi' is unknown"):
        launch_backend("mpi", 0, 1)


def test_run_on_ranks_ranks_share_the_parents_gpus(gpus):
    """Inside run_on_ranks every rank is a child of one process and sees the same GPUs: 'auto'
    needs one per rank, and one GPU is not one per rank."""
    gpus(1)
    assert resolve_backend("auto", 2) == "gloo" and resolve_backend("auto", 1) == "nccl"
    with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank: 2 local rank"):
        resolve_backend("nccl", 2)
    gpus(8)
    assert resolve_backend("auto", 4) == "nccl"


def test_run_on_ranks_defaults_to_gloo_even_when_gpus_are_visible(gpus):
    """With 8 (faked) GPUs in the parent, the default would have started NCCL ranks (which fail on
    this CPU build): the notebooks' stored outputs come from gloo CPU ranks."""
    gpus(8)
    assert run_on_ranks(lambda: (dist.get_backend(), str(rank_device())), world_size=2, timeout_s=60) == \
        [("gloo", "cpu")] * 2


def test_rank_device_under_nccl_is_local_device_of_local_rank(gpus, monkeypatch):
    """rank_device() and init_from_env name the same GPU: both are local_device(LOCAL_RANK, visible)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    gpus(4)
    assert rank_device() == torch.device("cuda", 3) == launch_backend("auto", 3, 4)[1]
    gpus(1)
    assert rank_device() == torch.device("cuda", 0) == launch_backend("auto", 3, 4)[1]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert rank_device() == CPU


def test_init_from_env_refuses_a_local_rank_without_a_gpu_before_joining(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setattr(dist, "TCPStore", None)  # reaching the rendezvous would fail differently
    for key, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="local rank 3 has no GPU of its own: this process sees 2 CUDA GPUs"):
        launch.init_from_env()
    assert not dist.is_initialized()


def test_rank_0_prints_every_rank_s_line_in_rank_order(capsys):
    store = dist.HashStore()
    launch.announce(store, 2, 3, "rank 2/3: backend gloo, device cpu")
    launch.announce(store, 1, 3, "rank 1/3: backend gloo, device cpu")
    assert capsys.readouterr().out == ""
    launch.announce(store, 0, 3, "rank 0/3: backend gloo, device cpu")
    assert capsys.readouterr().out == "".join(f"rank {r}/3: backend gloo, device cpu\n" for r in range(3))


def test_a_torchrun_demo_prints_each_rank_s_backend_and_device():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # 2 CPU ranks on any machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.allreduce", "--sizes-mb", "0.25", "--iters", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    block = "rank 0/2: backend gloo, device cpu\nrank 1/2: backend gloo, device cpu\n"
    assert proc.stdout.count(block) == 1 and proc.stdout.count("backend gloo") == 2, proc.stdout
