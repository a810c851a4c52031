"""The NVMe tier of offload (ZeRO-Infinity, Rajbhandari et al. 2021): optimizer state on disk.

Adam's m and v (8 bytes per local element in fp32) live in one memory-mapped file per unit and
rank under a directory the user names. Around the optimizer step, unit by unit:

    read    m, v of the unit's local elements    file -> a host buffer     8 * S_u bytes
    step    optimizer_class on the unit's shards (the step count stays in memory)
    write   m, v back                             host buffer -> file       8 * S_u bytes

so the host holds at most one unit's state at a time (the bounded buffer) and the disk moves
16 * S_u bytes per unit per step. The parameters and gradients stay on the rank's device; the
step runs on the host, so each crosses the link explicitly (offload.py's to_host / to_device,
counted in `link`): the gradient and the fp32 shard device -> host, the updated shard host ->
device (the device's shard stays the one source of truth: a checkpoint load or another
optimizer may write it, so the host keeps no copy of it between steps). Adam is element-wise, so stepping unit by unit equals one step
over all parameters exactly. Counted per step: bytes read and written (the NVMe tier), the
largest host buffer (the host tier). `disk_bandwidth(dir)` measures what the disk really does.
On a machine without NVMe any directory works; the page cache may serve reads from memory, which
is why the bandwidth measure syncs and reads a file larger than it keeps (say so beside it).
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import torch

from course_lib.parallel.zero.offload import OffloadCounter, to_device, to_host

STATE_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's m and v; SGD momentum would be one


def check_nvme_dir(path, need_bytes: int) -> None:
    """ValueError naming the directory and the rule: it must exist, be writable and have need_bytes free."""
    if not path or not os.path.isdir(path):
        raise ValueError(f"offload_dir={path!r} must be an existing directory")
    probe = os.path.join(path, f".nvme_probe_{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"offload_dir={path!r} is not writable ({e.strerror}): the optimizer state files go there")
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ValueError(f"offload_dir={path!r} has {free:,} bytes free; the optimizer state needs {need_bytes:,} "
                         f"bytes (m and v in fp32, 8 bytes per element, every rank's files)")


class NVMeStore:
    """Adam's state of every unit in files `dir/unit{u}_rank{r}.bin` (see the module docstring)."""

    @staticmethod
    def bytes_needed(local_elements: int) -> int:
        return len(STATE_KEYS) * 4 * local_elements

    def __init__(self, directory, rank: int):
        self.directory, self.rank = directory, rank
        self.files, self.steps = [], {}
        self.read_bytes = self.written_bytes = self.peak_host_bytes = 0
        self.link = OffloadCounter()  # bytes across the host-device link (the step's to_host / to_device)

    def attach(self, optimizer, units) -> None:
        """Create one zero-filled file per unit (the state before the first step is zeros)."""
        name = type(optimizer).__name__
        if name not in ("Adam", "AdamW"):
            raise ValueError(f"offload='nvme' stores Adam's m and v: optimizer_class={name} must be Adam or AdamW")
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ValueError("offload='nvme' does not store amsgrad's third state tensor: use amsgrad=False")
        for u, unit in enumerate(units):
            n = sum(e.local.numel() for e in unit.entries)
            path = os.path.join(self.directory, f"unit{u}_rank{self.rank}.bin")
            self.files.append(np.memmap(path, dtype=np.float32, mode="w+", shape=(len(STATE_KEYS) * max(n, 1),)))

    def reset(self) -> None:
        self.read_bytes = self.written_bytes = self.peak_host_bytes = 0
        self.link.reset()

    @torch.no_grad()
    def step(self, optimizer, units) -> None:
        for unit, mm in zip(units, self.files):
            params = [e.local for e in unit.entries if e.local.grad is not None]
            if not params:
                continue
            host = torch.as_tensor(np.array(mm))  # read: the whole unit's m and v into one host buffer
            self.read_bytes += host.numel() * 4
            self.peak_host_bytes = max(self.peak_host_bytes, host.numel() * 4)
            off, views = 0, {}
            for e in unit.entries:
                n = e.local.numel()
                views[id(e.local)] = [host[off + i * n: off + (i + 1) * n].view(e.local.shape)
                                      for i in range(len(STATE_KEYS))]
                off += len(STATE_KEYS) * n
            on_host = {}  # the optimizer steps host copies of the device's shards and gradients
            for p in params:
                h = to_host(p, counter=self.link)
                h.grad = to_host(p.grad, h.dtype, self.link)
                on_host[id(p)] = h
                step = self.steps.setdefault(id(p), torch.tensor(0.0))
                optimizer.state[h] = {"step": step, **dict(zip(STATE_KEYS, views[id(p)]))}
            saved = [(g, g["params"]) for g in optimizer.param_groups]
            try:  # step this unit's parameters only: the groups narrowed to their host copies
                for g, ps in saved:
                    g["params"] = [on_host[id(p)] for p in ps if id(p) in on_host]
                optimizer.step()
            finally:
                for g, ps in saved:
                    g["params"] = ps
            for p in params:  # m and v were updated in place in the host buffer
                h = on_host[id(p)]
                self.steps[id(p)] = optimizer.state[h]["step"]
                del optimizer.state[h]
                p.copy_(to_device(h, p.device, p.dtype, self.link))  # the updated shard back to the device
            mm[:] = host.numpy()
            mm.flush()
            self.written_bytes += host.numel() * 4

    def summary(self) -> dict[str, int]:
        """Bytes per tier: NVMe read / written since reset, the files' size, the largest host buffer."""
        return {"nvme_read": self.read_bytes, "nvme_written": self.written_bytes,
                "nvme_files": sum(mm.size * 4 for mm in self.files), "host_peak": self.peak_host_bytes}


def disk_bandwidth(directory, nbytes: int = 64 * 2**20) -> dict[str, float]:
    """{"write": bytes/s, "read": bytes/s} of one file of nbytes under directory (written then fsynced;
    read back right after, so the page cache may serve it: the read figure is an upper bound)."""
    path = os.path.join(directory, f".nvme_bandwidth_{os.getpid()}")
    data = np.ones(nbytes // 4, dtype=np.float32)
    try:
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data.tobytes())
            f.flush()
            os.fsync(f.fileno())
        write = nbytes / (time.perf_counter() - t)
        t = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        read = nbytes / (time.perf_counter() - t)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"write": write, "read": read}
