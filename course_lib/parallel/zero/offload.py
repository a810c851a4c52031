"""ZeRO-Offload (Ren et al. 2021): optimizer state and the optimizer step on the host.

The device keeps what forward and backward need (bf16 parameters, gradients while they are
produced); the host keeps the fp32 master weights and Adam's m and v and runs the step. Per
step and per rank, with S = ceil(Psi / N) elements in the rank's shard:

    device -> host   the gradient shard         S * grad bytes      (2 S in bf16)
    host -> device   the updated weight shard   S * param bytes     (2 S in bf16)

over a PCIe link of bandwidth B each way: t_offload = 2 S * 2 / B (the two directions of a
full-duplex link overlap, so max(to_host, to_device) / B is the optimistic bound). The step
itself runs at host memory bandwidth: Adam reads and writes master, m, v, and the gradient,
about 28 bytes per element in fp32 (4 reads of 4 B + 3 writes of 4 B).

Every crossing goes through one of two functions, so what crosses is explicit and counted:

    to_host(t, dtype, counter)           device -> host: a new host tensor (pinned when t is on a
                                         GPU), cast to dtype on the host after the move; waited for
                                         (the host reads it next)
    to_device(t, device, dtype, counter) host -> device: cast on the host first (the link carries
                                         dtype's bytes), then moved, non_blocking from pinned memory

Why the host->device copy may be asynchronous: it is queued on the device's stream before
anything that reads the parameter, and the host writes the source again only in the next
step's optimizer step, which comes after that step's to_host waited for the stream. On a GPU
rank the parameters and gradients stay on the device, Adam's state and its fp32 master on the
host: torch.optim never sees a device tensor beside a host one (stage 3 and the NVMe tier step
host tensors only). On CPU ranks the host and the device are one memory: to_host still makes a
copy (marked as host memory by the device rule's tracking under COURSE_NCCL_RULES=1, so a
host tensor handed to a collective raises there as it would on NCCL), the same values, so the
numbers are bit for bit those of a run without offload's copies; the counter records the bytes
that would cross the link and `pcie_seconds` turns them into time.
"""

from __future__ import annotations

import torch

PCIE_GEN4_X16 = 32e9  # bytes/s per direction, nominal (vendor GB/s)
PCIE_GEN5_X16 = 64e9


class OffloadCounter:
    """Bytes each way across the host-device link since construction (or `reset()`)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.to_host_bytes = 0
        self.to_device_bytes = 0

    def to_host(self, tensor: torch.Tensor, dtype=None) -> None:
        self.to_host_bytes += tensor.numel() * (tensor.element_size() if dtype is None else dtype.itemsize)

    def to_device(self, tensor: torch.Tensor, dtype=None) -> None:
        self.to_device_bytes += tensor.numel() * (tensor.element_size() if dtype is None else dtype.itemsize)

    def summary(self) -> dict[str, int]:
        return {"to_host": self.to_host_bytes, "to_device": self.to_device_bytes}


def to_host(t: torch.Tensor, dtype=None, counter: OffloadCounter | None = None) -> torch.Tensor:
    """A copy of t in host memory (see the module docstring), cast to dtype there; counted in
    t's own bytes (what crosses the link)."""
    src = t.detach()
    if counter is not None:
        counter.to_host(src)
    if src.device.type == "cpu":
        out = src.cpu().clone()  # CPU ranks: a copy in the same memory, tracked as host memory
    else:
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
        out.copy_(src, non_blocking=src.is_cuda)
        if src.is_cuda:
            torch.cuda.current_stream(src.device).synchronize()  # the host reads it next
    return out if dtype is None or dtype == out.dtype else out.to(dtype)


def to_device(t: torch.Tensor, device, dtype=None, counter: OffloadCounter | None = None) -> torch.Tensor:
    """t (a host tensor) on `device`, cast to dtype on the host first; counted in dtype's bytes.
    Asynchronous when t is pinned and device a GPU (why that is safe: the module docstring)."""
    src = t.detach() if dtype is None or dtype == t.dtype else t.detach().to(dtype)
    if counter is not None:
        counter.to_device(src)
    device = torch.device(device)
    return src.to(device, non_blocking=device.type == "cuda" and src.is_pinned())


def offload_bytes_per_step(n_params: int, world_size: int, grad_bytes: int = 2, param_bytes: int = 2) -> dict[str, int]:
    """The formula: {"to_host": S * grad_bytes, "to_device": S * param_bytes}, S = ceil(n_params / N)."""
    shard = -(-n_params // world_size)
    return {"to_host": shard * grad_bytes, "to_device": shard * param_bytes}


def pcie_seconds(to_host: int, to_device: int, bandwidth: float = PCIE_GEN4_X16, duplex: bool = True) -> float:
    """Time on the link: max of the two directions when they overlap (full duplex), else their sum."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth={bandwidth!r} must be > 0 bytes/s")
    return (max(to_host, to_device) if duplex else to_host + to_device) / bandwidth


def host_step_seconds(shard_numel: int, host_bandwidth: float = 100e9, bytes_per_element: int = 28) -> float:
    """Adam's step on the host is memory bound: bytes_per_element * S / host_bandwidth."""
    return shard_numel * bytes_per_element / host_bandwidth
