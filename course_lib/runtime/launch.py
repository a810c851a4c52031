"""The instructor path: join the process group from torchrun's environment.

    torchrun --nproc-per-node=4 -m course_lib.demos.allreduce          # one machine
    torchrun --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29500 \\
             --nproc-per-node=8 -m course_lib.demos.allreduce          # two machines

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process.
`init_from_env()` reads them, picks NCCL when this process has a GPU of its own and
gloo otherwise, and pins the GPU. The demo functions are the same ones the notebooks
run through `run_on_ranks`, so both paths execute the same code.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.runtime.device import resolve_backend, threads_per_rank


def init_from_env(backend: str = "auto", timeout_s: float = 300) -> str:
    """Initialise the default process group from torchrun's environment; returns the backend."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"environment variable(s) {', '.join(missing)} not set: launch with "
                           f"`torchrun --nproc-per-node=N -m <module>`")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = resolve_backend(backend, local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(threads_per_rank(local_world))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return backend

