"""The rules that pick a backend and a device, for `run_on_ranks` and for torchrun.

    run_on_ranks (notebooks)   backend "gloo" by default: emulated CPU ranks, whatever the machine has.
                               "auto": NCCL when this machine shows one CUDA GPU per rank, else gloo
                               (`resolve_backend`: every rank is a child of one process and sees its GPUs).
    torchrun (init_from_env)   "auto": NCCL whenever this process sees a CUDA GPU, else gloo
                               (`launch_backend`); the device is `local_device(LOCAL_RANK, visible)`;
                               a local rank without a GPU of its own is an error, never a CPU run.
    device under NCCL          `local_device`: cuda:0 when the process sees one GPU (Slurm's
                               --gpus-per-task=1 gives each task its own CUDA_VISIBLE_DEVICES),
                               cuda:LOCAL_RANK when it sees several; under gloo, the CPU.

`local_device` is the one place that maps a rank to its GPU: `init_from_env` pins it and
`rank_device()` returns it. Emulated CPU ranks also get a fair share of the cores.
"""

from __future__ import annotations

import os

import torch

from course_lib.platform import usable_cores

BACKENDS = ("auto", "gloo", "nccl")


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use one of {', '.join(map(repr, BACKENDS))}")


def resolve_backend(backend: str, local_world_size: int) -> str:
    """run_on_ranks' rule, where every rank is a child of this process and sees the same GPUs:
    'auto' -> 'nccl' when there is one CUDA GPU per local rank, else 'gloo'. Validates the choice."""
    _check_backend(backend)
    n_gpus = visible_gpus()
    if backend == "auto":
        return "nccl" if n_gpus >= local_world_size else "gloo"
    if backend == "nccl" and n_gpus < local_world_size:
        raise ValueError(
            f"backend='nccl' needs one CUDA GPU per rank: {local_world_size} local rank(s) but "
            f"{n_gpus} GPU(s) are visible; use backend='gloo' to emulate ranks on the CPU"
        )
    return backend


def local_device(local_rank: int, visible: int) -> torch.device:
    """The GPU of the rank with this LOCAL_RANK, in a process that sees `visible` CUDA GPUs.

    One visible GPU is this process's own (a scheduler that gives each task one GPU sets
    CUDA_VISIBLE_DEVICES per task, so every task sees its GPU as cuda:0). With several, local rank
    i takes cuda:i, and a local rank beyond them has none: an error, never a silent CPU run. (Two
    processes that both see the same single GPU both get cuda:0; NCCL then stops with "Duplicate
    GPU detected".)"""
    if visible < 1:
        raise ValueError(f"local rank {local_rank} has no CUDA GPU: this process sees none; "
                         f"use backend='gloo' to run on the CPU")
    if visible == 1:
        return torch.device("cuda", 0)
    if not 0 <= local_rank < visible:
        raise ValueError(
            f"local rank {local_rank} has no GPU of its own: this process sees {visible} CUDA GPUs "
            f"(cuda:0 to cuda:{visible - 1}); start at most {visible} ranks per node "
            f"(torchrun --nproc-per-node={visible}), or give each process one GPU (CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


def launch_backend(backend: str, local_rank: int, local_world_size: int) -> tuple[str, torch.device]:
    """torchrun's rule: (backend, device) for this process. 'auto' -> NCCL on `local_device`
    whenever the process sees a CUDA GPU, gloo on the CPU when it sees none; 'nccl' without a
    GPU is an error. With several GPUs visible every local rank checks the highest one
    (LOCAL_WORLD_SIZE - 1), so a node with more ranks than GPUs stops on every rank with the same
    message before any rank waits. torchrun's workers see the GPUs torchrun sees (unless
    `--virtual-local-rank` gives each one GPU as cuda:0 and LOCAL_RANK 0), so under torchrun a local
    rank above 0 that sees one GPU would share it with local rank 0: an error too. A process
    started by another launcher (srun with --gpus-per-task=1) takes its one GPU, whatever its
    LOCAL_RANK."""
    _check_backend(backend)
    visible = visible_gpus()
    if backend == "gloo" or (backend == "auto" and visible == 0):
        return "gloo", torch.device("cpu")
    if visible == 0:
        raise ValueError(f"backend='nccl' needs a CUDA GPU: local rank {local_rank} sees none; "
                         f"use backend='gloo' (or 'auto') to run on the CPU")
    if visible == 1 and local_rank > 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        raise ValueError(
            f"local rank {local_rank} would share this process's 1 visible CUDA GPU with local rank 0: "
            f"torchrun's workers see the GPUs torchrun sees; start one rank per GPU (torchrun "
            f"--nproc-per-node=1 here, or --virtual-local-rank with one GPU per rank in CUDA_VISIBLE_DEVICES), "
            f"or hide the GPU (CUDA_VISIBLE_DEVICES=) to run the ranks with gloo on the CPU"
        )
    if visible > 1:
        local_device(max(local_rank, local_world_size - 1), visible)
    return "nccl", local_device(local_rank, visible)


def threads_per_rank(local_world_size: int) -> int:
    """A fair share of the cores for each rank, so that N ranks on few cores don't thrash."""
    return max(1, usable_cores() // local_world_size)


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL (`local_device` of its LOCAL_RANK,
    set by torchrun and by run_on_ranks' workers), else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return local_device(int(os.environ.get("LOCAL_RANK", 0)), visible_gpus())
    return torch.device("cpu")
