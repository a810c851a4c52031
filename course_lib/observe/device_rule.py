"""NCCL's device rule, enforced on gloo CPU ranks (part of COURSE_NCCL_RULES=1).

NCCL communicates CUDA tensors only: a collective or point-to-point call handed a CPU tensor on an
NCCL process group raises ("No backend type associated with device type cpu"). gloo takes CPU
tensors, so code that creates a tensor without a device and hands it to `all_reduce` passes on
CPU ranks and fails on the first GPU run. With this layer on, every tensor handed to a
communication call (collectives and point-to-point) must be on the rank's own device, which the
runtime hands in (`enforced(device)`: runtime/worker.py and runtime/launch.py pass
`runtime.device.rank_device()`; observe/ does not import runtime/). COURSE_NCCL_RULES=1 turns it on
beside the point-to-point rules of observe/nccl_rules.py: one strict mode, NCCL's rules.

Two ways to check, chosen by the device handed in:

- a device other than the CPU (a GPU rank; `meta` in a test): each tensor's device is compared
  with it, before the call runs.
- the CPU (gloo ranks): the CPU stands for "the rank's GPU", and the layer tracks where each
  tensor would live on a GPU rank. A torch function mode marks as *host* every tensor created
  without a `device=` (CPU by default, also on a GPU rank), or moved with `.cpu()`, and every
  result computed from host tensors only; a tensor created with a `device=` (rank_device(), a
  parameter's device) or moved with `.to(device)` is on the rank's device. A host tensor handed
  to a communication call raises DeviceRuleError naming the call, where the tensor would be
  (the CPU) and the rank's device. Why not run the ranks on a fake CUDA or meta device instead:
  tensors there carry no values (a fake tensor's `.item()` raises DataDependentOutputException
  on torch 2.13; meta has no data), so no demo could run past its first printed loss, and gloo
  cannot send them; the tracking keeps every number on the CPU, identical to a run without it.

Not checked: an explicit `device="cpu"` (a choice, not a default), tensors made inside torch's
C++ code unseen by the mode (a gradient read through `p.grad` takes its parameter's mark), the
results of code torch.compile traces (the mode steps aside there: marks would break its graph), and
the object collectives (all_gather_object,
broadcast_object_list, ...): torch moves their pickled bytes to `torch.cuda.current_device()`
itself under NCCL, so what the caller hands them is a Python object, never a tensor on a device.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

from course_lib.observe import patching
from course_lib.observe.nccl_rules import NcclRuleError

_HOST = "_course_host"  # attribute set on a tensor that would live in host memory on a GPU rank
_OBJECT_CALLS = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                 "send_object_list", "recv_object_list", "_object_to_tensor", "_tensor_to_object"}
_NO_TENSORS = {"barrier", "monitored_barrier"}  # torch makes their tensor itself, on the right device


class DeviceRuleError(NcclRuleError):
    """A tensor handed to a communication call that is not on the rank's own device."""


def is_host(t) -> bool:
    """Whether tensor t would be in host memory on a GPU rank (tracked while the rule is on)."""
    return bool(getattr(t, _HOST, False))


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _mark(out, host: bool):
    for t in _tensors(out):
        try:
            setattr(t, _HOST, host)
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: left unmarked
            pass


class _Tracker(TorchFunctionMode):
    """Marks each result as host or not, from how it was made (see the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # traced by Dynamo: marking here would break the graph
            return func(*args, **kwargs)  # (a compiled module's results stay unmarked: on the device)
        name = getattr(func, "__name__", "")
        if name in patching.PATCHABLE_OPS and getattr(func, "__module__", "").startswith("torch.distributed"):
            # torch hands a collective to the mode by its module-level name, which is the patched
            # one: calling it would run the observers' layers a second time (a tracer would count
            # the collective checks' own exchange). The call already went through them, or was
            # made on torch's own function on purpose.
            return (patching.real(name) or func)(*args, **kwargs)
        out = func(*args, **kwargs)
        if name in ("__set__", "__setitem__") or not any(True for _ in _tensors(out)):
            return out  # in-place writes: the tensor keeps its own mark
        if name == "__get__":  # t.T, t.data, p.grad: where t is
            _mark(out, bool(args) and is_host(args[0]))
            return out
        inputs = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
        device_given = kwargs.get("device") is not None or (
            name == "to" and any(isinstance(a, (str, torch.device)) for a in args[1:]))
        if name.endswith("_") and not name.startswith("__"):
            return out  # in place: the tensor stays where it was
        if name == "cpu":
            host = True
        elif name in ("cuda", "pin_memory") or device_given:
            host = False
        elif name == "to" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            host = is_host(args[1])  # t.to(other): other's device
        else:  # made from nothing: CPU by default; computed: host only if every input is
            host = not inputs or all(is_host(t) for t in inputs)
        _mark(out, host)
        return out


def _arguments(op: str, a: dict):
    """(name, tensor) for every tensor the call is handed."""
    if op == "batch_isend_irecv":
        for i, p in enumerate(a["p2p_op_list"]):
            yield f"p2p_op_list[{i}].tensor", p.tensor
        return
    for name, value in a.items():
        for i, t in enumerate(_tensors(value)):
            yield (name if isinstance(value, torch.Tensor) else f"{name}[{i}]"), t


_OWN = {"course_lib.observe.patching", "course_lib.observe.device_rule", "course_lib.observe.nccl_rules"}


def _exempt() -> bool:
    """Inside an object collective, or an observer's own exchange (observe/checks.py moves its
    fingerprints to the GPU itself under NCCL): not the caller's tensors."""
    f = sys._getframe(2)
    while f is not None and not (f.f_code.co_name == "patched" and f.f_globals.get("__name__") == patching.__name__):
        f = f.f_back  # the other layers between this one and the patched function: not the caller
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if f.f_code.co_name in _OBJECT_CALLS or (module.startswith("course_lib.observe.") and module not in _OWN):
            return True
        f = f.f_back
    return False


class _DeviceRule:
    """The patching layer: every tensor argument checked against the rank's device."""

    ops = frozenset(patching.PATCHABLE_OPS) - _NO_TENSORS

    def __init__(self):
        self.device, self.emulated = torch.device("cpu"), True

    def around(self, op, a, call):
        if not _exempt():
            for name, t in _arguments(op, a):
                self.check(op, name, t)
        return call()

    def check(self, op, name, t):
        if self.emulated:
            if is_host(t):
                raise DeviceRuleError(
                    f"NCCL rules: {op} was handed {name} (shape {list(t.shape)}) in host memory (device cpu) "
                    f"but the rank's device is its GPU (stood in for by {self.device} on gloo ranks): NCCL "
                    f"communicates CUDA tensors only; create it with device=rank_device() or the device "
                    f"of the parameter at hand")
            return
        want = self.device
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise DeviceRuleError(
                f"NCCL rules: {op} was handed {name} (shape {list(t.shape)}) on device {t.device}, "
                f"but the rank's device is {want}: NCCL communicates tensors on the rank's own GPU only")


RULE = _DeviceRule()


@contextlib.contextmanager
def enforced(device, on: bool = True):
    """The device rule on (or off) for this rank while the block runs: every tensor handed to a
    communication call must be on `device` (the CPU: tracked as a stand-in for the rank's GPU)."""
    was, before = RULE in patching.active_layers(), (RULE.device, RULE.emulated)
    tracker = _Tracker() if on and torch.device(device).type == "cpu" else None
    if on:
        RULE.device = torch.device(device)
        RULE.emulated = RULE.device.type == "cpu"
    (patching.add_layer if on else patching.remove_layer)(RULE)
    try:
        with tracker if tracker is not None else contextlib.nullcontext():
            yield
    finally:
        RULE.device, RULE.emulated = before
        (patching.add_layer if was else patching.remove_layer)(RULE)


def install(device) -> None:
    """For torchrun processes (runtime/launch.py, when COURSE_NCCL_RULES=1): the rule on for the
    rest of the process."""
    if RULE not in patching.active_layers():
        RULE.device = torch.device(device)
        RULE.emulated = RULE.device.type == "cpu"
        patching.add_layer(RULE)
        if RULE.emulated:
            _Tracker().__enter__()  # for the rest of the process


class under_rule:  # noqa: N801 - used like a function: run_on_ranks(under_rule(fn), ...)
    """fn with the device rule on every rank, the rank's device from `device()` called there."""

    def __init__(self, fn, device):
        self.fn, self.device = fn, device

    def __call__(self, *args, **kwargs):
        with enforced(self.device()):
            return self.fn(*args, **kwargs)
