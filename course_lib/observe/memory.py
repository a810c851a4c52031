"""Measure memory the way the formulas of notebook 01 predict it.

* `measured_state_bytes(model, optimizer)`: parameters, gradients and optimizer state held
  by this process (each storage counted once, so tied weights are not double-counted).
* `SavedActivations`: bytes of the tensors autograd saves for backward during a forward
  pass, seen through saved-tensor hooks. Works on the CPU, where there is no allocator
  statistic to read. Parameters (and views of them) are excluded: they are model state.
* `cuda_peak_memory()`: the allocator's peak on a GPU, when there is one.
"""

from __future__ import annotations

import contextlib

import torch


def _storage_key(t: torch.Tensor):
    return t.untyped_storage().data_ptr()


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _optimizer_tensors(optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:  # skip scalar step counters: not per-parameter state
                yield v


def measured_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"} in bytes for what this process holds."""
    params = list(model.parameters())
    out = {
        "params": _unique_bytes(params),
        "grads": _unique_bytes(p.grad for p in params),
        "optimizer": _unique_bytes(_optimizer_tensors(optimizer)) if optimizer is not None else 0,
    }
    out["total"] = sum(out.values())
    return out


class SavedActivations(contextlib.AbstractContextManager):
    """Count the bytes autograd keeps for backward while the block runs.

        with SavedActivations(model) as saved:
            loss = model(x, y)[1]
        saved.bytes        # unique storages saved, parameters excluded
        saved.by_shape()   # what was saved, for reading the formula off the graph

    Each storage is counted once even when several saved tensors view it (e.g. q, k, v
    split from one qkv matmul output), which is what the memory really holds.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self._exclude = {_storage_key(p) for p in model.parameters()} if model is not None else set()
        self._seen: dict[int, torch.Tensor] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self._exclude and t.device.type != "meta":
            self._seen.setdefault(key, t)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False

    @property
    def bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._seen.values())

    def by_shape(self) -> dict[tuple, int]:
        """{(shape, dtype): count} of the saved storages."""
        out: dict[tuple, int] = {}
        for t in self._seen.values():
            key = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
            out[key] = out.get(key, 0) + 1
        return out


def cuda_peak_memory(device=None) -> int | None:
    """Peak bytes allocated on the GPU since the last reset, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device)


@contextlib.contextmanager
def cuda_peak_scope(device=None):
    """Reset the CUDA peak counter, run the block, and leave the peak in the yielded dict."""
    result = {"peak_bytes": None}
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield result
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
