"""The one engine that wraps torch.distributed's functions, for every observer of the course.

Two observers need to see each collective before or after it runs: the collective checks
(checks.py: compare op/dtype/shape across ranks first) and the tracer (tracer.py: record calls
and bytes). Each registers a *layer*; this module composes the active layers around the real
function and installs the composition in both namespaces (`torch.distributed.<op>` for user
code, `distributed_c10d.<op>` for torch's own helpers):

    dist.all_reduce(t)  ->  tracer.around  ->  checks.around  ->  the real all_reduce

The tracer is outermost so that its time span covers everything the call costs the rank,
including the wait for late peers, which the checks' fingerprint exchange absorbs.

A layer is an object with `ops` (the names it wants to see) and
`around(op, args, call) -> result`, where `args` are the call's bound arguments (defaults
applied) and `call()` runs the rest of the chain. Why one engine: two independent patchers
would each save "the original" and restore it in the wrong order, and each would need its own
guard against nested calls.

Nested calls: torch implements some ops with others (all_gather_into_tensor calls
all_gather_single on torch 2.13). Only the outermost patched call goes through the layers;
calls made while it runs reach the real functions directly.
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Every function an observer may wrap. Missing ones (e.g. all_gather_single before torch 2.13)
# are skipped.
PATCHABLE_OPS = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "gather", "scatter", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)

_real: dict[str, object] = {}  # op -> torch's own function, captured before any patching
_layers: list = []  # active layers, outermost first
_local = threading.local()


def real(op: str):
    """torch's unpatched function `op` (for an observer's own communication), None if this
    torch has no such function."""
    _capture()
    return _real.get(op)


def _capture() -> None:
    if _real:
        return
    for op in PATCHABLE_OPS:
        fn = getattr(c10d, op, None)
        if fn is not None:
            _real[op] = fn


def _dispatch(op: str, original, layers: list):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def patched(*args, **kwargs):
        if getattr(_local, "depth", 0):  # inside another patched call: straight through
            return original(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments

        def run(i: int):
            if i == len(layers):
                _local.depth = 1
                try:
                    return original(*args, **kwargs)
                finally:
                    _local.depth = 0
            return layers[i].around(op, arguments, lambda: run(i + 1))

        return run(0)

    return patched


_compositions: dict[tuple, object] = {}  # (op, layers...) -> its dispatch function, built once


def _reinstall() -> None:
    _capture()
    for op, original in _real.items():
        layers = tuple(layer for layer in _layers if op in layer.ops)
        key = (op,) + layers
        if layers and key not in _compositions:  # the same layers give back the same function
            _compositions[key] = _dispatch(op, original, list(layers))
        fn = _compositions[key] if layers else original
        setattr(c10d, op, fn)
        setattr(dist, op, fn)


def add_layer(layer, outermost: bool = False) -> None:
    """Activate `layer` innermost (closest to the real function), or outermost. Idempotent."""
    if layer not in _layers:
        _layers.insert(0, layer) if outermost else _layers.append(layer)
        _reinstall()


def remove_layer(layer) -> None:
    """Deactivate `layer`; with no layer left torch's own functions are back in place."""
    if layer in _layers:
        _layers.remove(layer)
        _reinstall()


def active_layers() -> list:
    return list(_layers)
