"""The instructor path: join the process group from torchrun's environment.

    torchrun --nproc-per-node=4 -m course_lib.demos.allreduce          # one machine
    torchrun --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29500 \\
             --nproc-per-node=8 -m course_lib.demos.allreduce          # two machines

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process.
`init_from_env()` reads them, picks NCCL whenever this process sees a CUDA GPU and gloo
otherwise, pins the GPU (`course_lib.runtime.device.launch_backend`: cuda:0 when the process sees
one GPU, as under Slurm's --gpus-per-task=1; cuda:LOCAL_RANK when it sees several), and rank 0
prints one line per rank, in rank order: "rank 1/4: backend nccl, device cuda:1". The demo
functions are the same ones the notebooks run through `run_on_ranks`, so both paths execute the
same code.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.observe.nccl_rules import install_from_env as install_nccl_rules
from course_lib.observe.device_rule import install as install_device_rule
from course_lib.runtime.device import launch_backend, rank_device, threads_per_rank


def init_from_env(backend: str = "auto", timeout_s: float = 300) -> str:
    """Initialise the default process group from torchrun's environment; returns the backend.

    The rendezvous keys live under a prefix of this attempt (TORCHELASTIC_RESTART_COUNT): when
    torchrun restarts a failed group, every attempt joins through the same TCP store, and
    without the prefix a restarted rank could read the address a dead rank of the previous
    attempt published (gloo then fails with "Connection refused")."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"environment variable(s) {', '.join(missing)} not set: launch with "
                           f"`torchrun --nproc-per-node=N -m <module>`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend, device = launch_backend(backend, local_rank, local_world)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # binds NCCL's communicator to this GPU and sets it up now
    else:
        torch.set_num_threads(threads_per_rank(local_world))
    timeout = timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_store), timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"course/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    where = f" (host {socket.gethostname()})" if local_world != world else ""  # several nodes: say which
    announce(store, rank, world, f"rank {rank}/{world}: backend {backend}, device {device}{where}")
    if install_nccl_rules():  # COURSE_NCCL_RULES=1: NCCL's point-to-point rules (observe/nccl_rules.py)
        install_device_rule(rank_device())  # and every communicated tensor on the rank's device
    return backend


def announce(store, rank: int, world: int, line: str) -> None:
    """Rank 0 prints every rank's line, in rank order, one print: lines from several processes
    never interleave. Through the store, not a collective, so nothing is added to what a flight
    recorder or NCCL's communicator sees."""
    store.set(f"backend_line/{rank}", line)
    if rank == 0:
        print("\n".join(store.get(f"backend_line/{r}").decode() for r in range(world)), flush=True)


def leave_process_group() -> None:
    """End a torchrun demo's process group; call it in the `finally:` around the demo's work.

    After a clean run the ranks first meet at a barrier: a rank that tears its gloo connections
    down while a peer still uses them can make that peer abort ("terminate called without an
    active exception"). After an error there is no barrier: a peer may be dead, so waiting for it
    would hang.

    Then the groups' own threads end here, while the interpreter is whole: destroy_process_group
    drops c10d's references, but a model or optimizer that kept a sub-group (HSDP's shard and
    replica groups, a mesh) in a reference cycle keeps it, and its backend threads, until the
    interpreter's final collection. A backend thread that needs the GIL then (to free a tensor
    Python made, to run a callback) is ended by Python 3.11 in the middle of C++ code: the
    process aborts ("terminate called without an active exception") or hangs at exit.
    gc.collect() frees those groups now; a group's destructor joins its threads."""
    if dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
