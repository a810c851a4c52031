"""The MLP step of course_lib.sharding.layouts on gloo ranks: the course's hand-written strategy
and the same layout as DTensor placements, each with the collectives it made.

    course_step(name, data)    rank code: the course's own pieces, written out (notebooks 03, 05,
                               08): ColumnParallelLinear / RowParallelLinear (f and g, or the
                               sequence-parallel all-gather and reduce-scatter), a ZeRO-3 unit
                               gathered by course_lib.comm.autograd.gather_along_dim (its backward
                               is the gradient's reduce-scatter), gradients all-reduced over dp;
                               counted by CommTracer
    dtensor_step(name, data)   rank code: DTensor.from_local with the layout's placements, the
                               layout's annotations as redistribute() calls, the plain MLP's ops;
                               counted by CommDebugMode (SizedCommDebugMode adds the bytes)
    reference_step(data)       one process, full tensors

Each returns {"loss", "g_fc", "g_proj", "g_x", "fc", "proj"} (this rank's pieces, numpy) and,
on ranks, "collectives": [(op, full bytes, group size)] in the formula's convention.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from course_lib.comm.autograd import gather_along_dim
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.mesh import make_mesh
from course_lib.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from course_lib.sharding.layouts import LAYOUTS, Shapes

OUTPUTS = ("loss", "g_fc", "g_proj", "g_x", "fc", "proj")


def op_kind(name: str) -> str | None:
    """all_reduce / all_gather / reduce_scatter / all_to_all for a torch op name, else None."""
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        if kind in name or kind.replace("_", "") in name:
            return kind
    return None


class SizedCommDebugMode(CommDebugMode):
    """CommDebugMode that also keeps (op, full bytes, group size) for every functional collective
    DTensor issues: all_reduce(t, op, group), all_gather_into_tensor(t, n, group) (full = n * t),
    reduce_scatter_tensor(t, op, n, group) (full = t), all_to_all_single."""

    def __init__(self):
        super().__init__()
        self.sized: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = getattr(getattr(func, "_overloadpacket", None), "_qualified_op_name", "")
        kind = op_kind(name) if out is not NotImplemented and name.startswith("_c10d_functional::") else None
        if kind:
            t = args[0]
            nbytes = t.numel() * t.element_size()
            if kind == "all_gather":
                n = int(args[1])
                nbytes *= n
            elif kind == "reduce_scatter":
                n = int(args[2])
            else:
                n = dist.distributed_c10d._resolve_process_group(args[-1]).size()
            self.sized.append((kind, nbytes, n))
        return out


def _coords(layout) -> dict[str, int]:
    """This rank's coordinate along each mesh axis (row-major, the last axis fastest)."""
    rank, out = dist.get_rank(), {}
    for axis, size in reversed(layout.axes):
        out[axis], rank = rank % size, rank // size
    return out


def piece(full: np.ndarray, spec: tuple, layout, coords=None) -> torch.Tensor:
    """This rank's block of `full` under `spec` (equal chunks, as Shard and PartitionSpec cut)."""
    coords, sizes = coords or _coords(layout), dict(layout.axes)
    t = torch.from_numpy(np.ascontiguousarray(full))
    for dim, axis in enumerate(spec):
        if axis is not None:
            t = t.chunk(sizes[axis], dim=dim)[coords[axis]]
    return t.contiguous().clone()


def _loss_terms(y, t, count):
    return ((y - t) ** 2).sum() / count  # this rank's share of the mean over all count elements


def _pack(loss, pieces, lr, collectives):
    fc, proj, x = pieces
    out = {"loss": float(loss), "g_fc": fc.grad.numpy().copy(), "g_proj": proj.grad.numpy().copy(),
           "g_x": x.grad.numpy().copy(), "fc": (fc - lr * fc.grad).detach().numpy().copy(),
           "proj": (proj - lr * proj.grad).detach().numpy().copy()}
    return out | {"collectives": collectives}


def course_step(name: str, data: dict, shapes: Shapes = Shapes()) -> dict:
    """One step of layout `name` with the course's hand-written pieces (module docstring)."""
    layout, count = LAYOUTS[name], shapes.b * shapes.s * shapes.d
    specs = layout.specs
    if name == "dp_tp":
        mesh = make_mesh(dp=layout.axes[0][1], tp=layout.axes[1][1])
        tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    else:
        tp_group = dp_group = dist.group.WORLD
    x = piece(data["x"], specs["x"], layout).requires_grad_()
    t = piece(data["t"], specs["t"], layout)
    fc = nn.Linear(shapes.d, shapes.f, bias=False)
    proj = nn.Linear(shapes.f, shapes.d, bias=False)
    with torch.no_grad():
        fc.weight.copy_(torch.from_numpy(data["fc"]))
        proj.weight.copy_(torch.from_numpy(data["proj"]))
    if name in ("tp", "sp", "dp_tp"):
        sp = name == "sp"
        fc = ColumnParallelLinear.from_linear(fc, tp_group, sequence_parallel=sp)
        proj = RowParallelLinear.from_linear(proj, tp_group, sequence_parallel=sp)
    elif name == "fsdp":  # each rank keeps its rows only
        fc.weight = nn.Parameter(piece(data["fc"], specs["fc"], layout))
        proj.weight = nn.Parameter(piece(data["proj"], specs["proj"], layout))
    with CommTracer() as tracer:
        if name == "fsdp":  # ZeRO-3: gather the rows before use; the gather's backward reduce-scatters
            w_fc, w_proj = gather_along_dim(fc.weight, 0, dp_group), gather_along_dim(proj.weight, 0, dp_group)
            y = F.linear(F.gelu(F.linear(x, w_fc)), w_proj)
        else:
            y = proj(F.gelu(fc(x)))
        loss = _loss_terms(y, t, count)
        loss.backward()
        if name in ("dp", "dp_tp"):  # data parallel: sum the replicas' gradients (loss already / count)
            for p in (fc.weight, proj.weight):
                dist.all_reduce(p.grad, group=dp_group)
        value = loss.detach().clone()
        if name != "tp":  # the loss is a sum over split rows: add the ranks' shares (over dp or the sequence)
            dist.all_reduce(value, group=dp_group if name == "dp_tp" else tp_group)
    collectives = [(op_kind(r.op), r.bytes_recv if op_kind(r.op) == "all_gather" else r.bytes_sent,
                    len(r.group_ranks)) for r in tracer.records]
    return _pack(value, (fc.weight, proj.weight, x), shapes.lr, collectives)


def _placements(layout, tensor=None, spec=None):
    return [Shard(p[1]) if p[0] == "Shard" else Replicate() for p in layout.placements(tensor, spec)]


def dtensor_step(name: str, data: dict, shapes: Shapes = Shapes()) -> dict:
    """One step of layout `name` as DTensor placements (module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = LAYOUTS[name]
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=tuple(a for a, _ in layout.axes))

    def leaf(tensor, grad=True):
        local = piece(data[tensor], layout.specs[tensor], layout)
        dt = DTensor.from_local(local, mesh, _placements(layout, tensor), run_check=False)
        return dt.requires_grad_() if grad else dt

    def use(what, value):  # the layout's annotation on an intermediate, if it has one
        spec = layout.use.get(what)
        return value if spec is None else value.redistribute(mesh, _placements(layout, spec=spec))

    fc, proj, x, t = leaf("fc"), leaf("proj"), leaf("x"), leaf("t", grad=False)
    with SizedCommDebugMode() as comm:
        y_raw = F.linear(F.gelu(F.linear(use("x", x), use("fc", fc))), use("proj", proj))
        y = use("y", y_raw)
        loss = ((y - t) ** 2).mean()
        loss.backward()
        grads = {}
        for tensor, leaf_ in (("fc", fc), ("proj", proj), ("x", x)):  # each gradient in its tensor's layout
            grads[tensor] = leaf_.grad.redistribute(mesh, leaf_.placements)
        value = loss.full_tensor()
    out = {"loss": float(value.detach())}
    for tensor in ("fc", "proj", "x"):
        out[f"g_{tensor}"] = grads[tensor].to_local().numpy().copy()
    for tensor, leaf_ in (("fc", fc), ("proj", proj)):
        out[tensor] = (leaf_.to_local() - shapes.lr * grads[tensor].to_local()).detach().numpy().copy()
    counts = {getattr(op, "__name__", str(op)): n for op, n in comm.get_comm_counts().items()}
    return out | {"collectives": comm.sized, "comm_counts": counts, "y_placements": str(tuple(y_raw.placements))}


def reference_step(data: dict, shapes: Shapes = Shapes()) -> dict:
    """The step in one process, on full tensors (what every layout must reproduce)."""
    fc, proj, x = (torch.from_numpy(data[k]).clone().requires_grad_() for k in ("fc", "proj", "x"))
    y = F.linear(F.gelu(F.linear(x, fc)), proj)
    loss = ((y - torch.from_numpy(data["t"])) ** 2).mean()
    loss.backward()
    return {"loss": float(loss.detach()), "g_fc": fc.grad.numpy(), "g_proj": proj.grad.numpy(), "g_x": x.grad.numpy(),
            "fc": (fc - shapes.lr * fc.grad).detach().numpy(), "proj": (proj - shapes.lr * proj.grad).detach().numpy()}
