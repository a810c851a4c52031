"""The one rule that picks a backend and a device, shared by `run_on_ranks` and torchrun.

    backend "auto":  NCCL when every local rank can have a CUDA GPU of its own, else gloo
    device:          under NCCL, GPU number local_rank; under gloo, the CPU

On a laptop every rank is a CPU process talking gloo; on a GPU node the same code runs with
NCCL, each rank on its own GPU. Emulated CPU ranks also get a fair share of the cores.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "gloo", "nccl")


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, local_world_size: int) -> str:
    """'auto' -> 'nccl' when there is one CUDA GPU per local rank, else 'gloo'. Validates the choice."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use one of {', '.join(map(repr, BACKENDS))}")
    n_gpus = visible_gpus()
    if backend == "auto":
        return "nccl" if n_gpus >= local_world_size else "gloo"
    if backend == "nccl" and n_gpus < local_world_size:
        raise ValueError(
            f"backend='nccl' needs one CUDA GPU per rank: {local_world_size} local rank(s) but "
            f"{n_gpus} GPU(s) are visible; use backend='gloo' to emulate ranks on the CPU"
        )
    return backend


def threads_per_rank(local_world_size: int) -> int:
    """A fair share of the cores for each rank, so that N ranks on few cores don't thrash."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_world_size)


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
