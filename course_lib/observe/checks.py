"""Catch collectives that do not match across ranks, instead of returning wrong numbers.

gloo happily all-reduces a 3-element tensor on one rank with a 4-element tensor on
another and hands back garbage (or hangs). With the check installed (run_on_ranks does so
unless check_collectives=False), each collective first all-gathers a small fingerprint

    [op, dtype, ndim, d0, d1, d2, d3, root]      (root = src/dst where the op has one)

from every rank of its group and raises `CollectiveMismatch` on every rank if they differ.
Ops whose sizes may legitimately differ between ranks (all_to_all with uneven splits, the
root-only lists of gather/scatter) compare only what must agree.

Why not TORCH_DISTRIBUTED_DEBUG=DETAIL: it numbers point-to-point calls in the same
sequence as collectives, so a pipeline where only ranks 0 and 1 exchange a send/recv
makes the next, perfectly matched, collective fail its check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.observe import patching

MAX_DIMS = 4
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]

# op name -> (argument holding the tensor to fingerprint, compare its shape?, argument naming the root)
_CHECKED = {
    "all_reduce": ("tensor", True, None),
    "reduce": ("tensor", True, "dst"),
    "broadcast": ("tensor", True, "src"),
    "all_gather": ("tensor", True, None),
    "all_gather_into_tensor": ("input_tensor", True, None),
    "all_gather_single": ("input_tensor", True, None),
    "reduce_scatter": ("output", True, None),
    "reduce_scatter_tensor": ("input", True, None),
    "reduce_scatter_single": ("input", True, None),
    "all_to_all": ("input_tensor_list", False, None),
    "all_to_all_single": ("input", False, None),
    "gather": ("tensor", True, "dst"),
    "scatter": ("tensor", True, "src"),
    "barrier": (None, False, None),
}
_OPS = sorted(_CHECKED)


class CollectiveMismatch(RuntimeError):
    """Ranks of one group called collectives that do not match."""


def _fingerprint(name, a, tensor_arg, compare_shape, root_arg) -> list[int]:
    t = a.get(tensor_arg) if tensor_arg else None
    while isinstance(t, (list, tuple)):
        t = t[0] if t else None
    fp = [_OPS.index(name), -1, -1] + [-1] * MAX_DIMS + [-1]
    if isinstance(t, torch.Tensor):
        fp[1] = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
        if compare_shape:
            fp[2] = t.dim()
            for i, d in enumerate(t.shape[:MAX_DIMS]):
                fp[3 + i] = d
    if root_arg and a.get(root_arg) is not None:
        fp[-1] = a[root_arg]
    return fp


def _describe(fp) -> str:
    op = _OPS[fp[0]]
    dtype = str(_DTYPES[fp[1]]).replace("torch.", "") if 0 <= fp[1] < len(_DTYPES) else "?"
    shape = [d for d in fp[3:3 + max(fp[2], 0)]]
    root = f", root={fp[-1]}" if fp[-1] >= 0 else ""
    return f"{op}(dtype={dtype}, shape={shape if fp[2] >= 0 else 'any'}{root})"


class _CheckLayer:
    """The patching layer that compares fingerprints before every checked collective."""

    ops = frozenset(_CHECKED)

    def around(self, name, a, call):
        tensor_arg, compare_shape, root_arg = _CHECKED[name]
        group = a.get("group")
        mine = torch.tensor(_fingerprint(name, a, tensor_arg, compare_shape, root_arg), dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            mine = mine.cuda()
        n = dist.get_world_size(group)
        everyone = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
        gather = patching.real("all_gather_single") or patching.real("all_gather_into_tensor")
        gather(everyone, mine, group=group)  # the real function: not traced, not checked
        rows = everyone.view(n, -1).cpu().tolist()
        if any(row != rows[0] for row in rows):
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
            calls = "\n".join(f"  rank {r}: {_describe(row)}" for r, row in zip(ranks, rows))
            raise CollectiveMismatch(
                f"ranks called mismatched collectives on a group of {n} rank(s); every rank of a group must "
                f"call the same collective with the same dtype and shape:\n{calls}")
        return call()


CHECK_LAYER = _CheckLayer()


def install_collective_checks():
    """Check every collective of this process from now on (idempotent). The fingerprint
    exchange uses torch's own function, so a tracer never counts it as a call."""
    patching.add_layer(CHECK_LAYER)
