"""The loop each rank process runs (kept tiny: the forkserver imports it before forking).

A rank joins the process group once, then serves calls until the parent sends an empty
message:  receive (shared modules, cloudpickled (fn, args, kwargs)): install the modules
(course_lib/runtime/modules.py) -> run with stdout/stderr captured ->
send back ("ok", pickled result, out, err) or ("error", traceback, out, err).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import traceback
from datetime import timedelta

from course_lib.observe import device_rule, nccl_rules
from course_lib.observe.checks import install_collective_checks
from course_lib.runtime.device import rank_device
from course_lib.runtime.groups import destroy_groups, live_groups
from course_lib.runtime.modules import install as install_shared_modules

INSIDE_RANK_ENV = "COURSE_LIB_INSIDE_RANK"
# The process group's own timeout only matters if the parent dies: the parent kills stuck
# ranks itself after the caller's timeout_s.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)


def init_process_group(rank: int, world_size: int, backend: str, port: int, check_collectives: bool):
    """Join the default process group the way torchrun's environment would describe it."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT, **kwargs)
    if check_collectives:
        # Each collective first compares (op, dtype, shape) across ranks and raises on a
        # mismatch instead of returning wrong numbers (see course_lib/observe/checks.py).
        install_collective_checks()


def _seed_everything(rank: int):
    import torch

    torch.manual_seed(rank)
    random.seed(rank)
    try:
        import numpy as np

        np.random.seed(rank)
    except ImportError:  # numpy is optional here
        pass


def worker_main(rank, world_size, backend, port, conn, n_threads, check_collectives):
    import pickle

    import cloudpickle
    import torch

    # Ctrl-C / "interrupt kernel" reaches the whole process group; the parent handles it by
    # killing the pool, so ranks ignore it rather than each printing a KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ[INSIDE_RANK_ENV] = "1"
    os.environ["OMP_NUM_THREADS"] = str(n_threads)
    torch.set_num_threads(n_threads)
    try:
        init_process_group(rank, world_size, backend, port, check_collectives)
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc(), "", ""))
        return
    conn.send(("ready", rank, "", ""))
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):  # parent gone
            break
        if not payload:
            break
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                shared, call = pickle.loads(payload)
                install_shared_modules(shared)
                fn, args, kwargs = cloudpickle.loads(call)
                _seed_everything(rank)
                destroy_groups(live_groups())  # what earlier calls left (course_lib.runtime.groups)
                # COURSE_NCCL_RULES=1 in the environment the pool started with: NCCL's rules for
                # every call, point-to-point (observe/nccl_rules.py) and every communicated
                # tensor on the rank's device (observe/device_rule.py).
                strict = nccl_rules.enabled_in_env()
                rules = nccl_rules.enforced() if strict else contextlib.nullcontext()
                devices = device_rule.enforced(rank_device()) if strict else contextlib.nullcontext()
                with rules, devices:
                    result = fn(*args, **kwargs)
                reply = ("ok", cloudpickle.dumps(result))
            except BaseException:  # noqa: BLE001 - every failure goes back to the parent
                reply = ("error", traceback.format_exc())
        conn.send(reply + (out.getvalue(), err.getvalue()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
