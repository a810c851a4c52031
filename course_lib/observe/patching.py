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
applied) and `call()` runs the rest of the chain; `call(name=value, ...)` runs it with those
arguments changed (nccl_rules.py renumbers point-to-point tags so). Why one engine: two independent patchers
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
    "monitored_barrier",
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


def _binder(original):
    """A function (args, kwargs) -> {name: value} with defaults applied, as inspect's
    Signature.bind + apply_defaults, but without their cost (about 40 us a call, more than a
    small collective's own overhead) when the call is plain: no more positional arguments than
    parameters, every keyword a parameter. Anything else goes through inspect, which also raises
    the TypeError the real function would."""
    sig = inspect.signature(original)
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    plain = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    required = {p.name for p in params if p.default is p.empty}

    def slow(args, kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def bind(args, kwargs):
        if not plain or len(args) > positional or not kwargs.keys() <= defaults.keys() | required:
            return slow(args, kwargs)
        arguments = dict(zip(names, args))
        if kwargs.keys() & arguments.keys():
            return slow(args, kwargs)  # a parameter given twice: inspect raises
        arguments.update(kwargs)
        if not required <= arguments.keys():
            return slow(args, kwargs)  # a missing argument: inspect raises
        return {n: arguments[n] if n in arguments else defaults[n] for n in names}

    return bind


def _dispatch(op: str, original, layers: list):
    bind = _binder(original)

    @functools.wraps(original)
    def patched(*args, **kwargs):
        if getattr(_local, "depth", 0):  # inside another patched call: straight through
            return original(*args, **kwargs)
        def run(i: int, arguments: dict, changed: bool):
            if i == len(layers):
                _local.depth = 1
                try:
                    return original(**arguments) if changed else original(*args, **kwargs)
                finally:
                    _local.depth = 0

            def call(**changes):
                return run(i + 1, {**arguments, **changes}, True) if changes else run(i + 1, arguments, changed)

            return layers[i].around(op, arguments, call)

        return run(0, bind(args, kwargs), False)

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
