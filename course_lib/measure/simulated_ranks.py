"""Many ranks in one process: a dp x tp layout of the course GPT simulated with PyTorch's
LocalTensorMode, its per-rank shapes and collectives against the planner's (notebook 11).

    local_tensor_missing()                       None, or the one sentence why this torch cannot
    simulate_dp_tp(config, dp, tp, batch_size, data)   one step on dp * tp simulated ranks: a SimulatedStep
    planned(config, dims, batch_size, seq)       the estimator's parameters and collectives per rank
    side_by_side(step, plan)                     per axis: calls, bytes and bytes sent, both sides
    one_process(config, data, dp)                the loss and gradient norm the step must reproduce
    CollectiveLog                                records every collective's op, bytes and group size

`torch.distributed._local_tensor.LocalTensorMode(n)` (private, and younger than torch 2.9:
pytorch/pytorch#164537, October 2025; so this is the one place the course touches it) makes
every tensor op run once per simulated rank: a LocalTensor holds one local tensor per rank, and
a collective on a process group of the fake backend combines the ranks' tensors as the real one
would. DTensor code then runs unchanged:

    mesh    DeviceMesh (dp, tp), tp innermost as course_lib.dims lays ranks out
    tp      PyTorch's own plan (parallelize_module): qkv and fc ColwiseParallel, both proj
            RowwiseParallel (course_lib.parallel.tp.dtensor, with qkv's rows permuted to whole
            heads), the token embedding RowwiseParallel (vocabulary rows), the tied head
            ColwiseParallel and the loss under loss_parallel (logits split by vocabulary): the
            course's Megatron split, written in DTensor
    dp      each dp rank reads its own rows (LocalTensorMode.rank_map); the gradients are summed
            over the dp group in two flat all-reduces (weights, then norms and biases: the two
            AdamW groups, as the course's composed runtime reduces them) and divided by dp
    clip    the course's one weighted global-norm clip (course_lib.parallel.clip) over the world

Two recorders watch the same step: torch's CommDebugMode (the count per collective, forward and
backward) and CollectiveLog (below it, the bytes of each call and its group's size).
Parameters created outside the mode (the norms, the positions) stay plain tensors: one copy
serves every rank, as replicated values are the same everywhere. This module starts no process.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.dims import ParallelDims
from course_lib.estimate.per_gpu import rank_param_counts
from course_lib.estimate.step_time import memory_per_rank
from course_lib.estimate.traffic import WIRE, step_traffic, wire_bytes
from course_lib.model import GPT
from course_lib.parallel.clip import clip_grad_norm_
from course_lib.parallel.tp.dtensor import apply_dtensor_tensor_parallel

# the functional and c10d collectives DTensor and torch.distributed issue, by the course's names
OPS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "allreduce_": "all_reduce",
       "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
       "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
       "all_to_all_single": "all_to_all", "broadcast_": "broadcast"}


def local_tensor_missing() -> str | None:
    """None when this torch can simulate ranks in one process, else why not (one sentence)."""
    try:
        from torch.distributed._local_tensor import LocalTensorMode  # noqa: F401
        from torch.distributed.tensor.parallel import loss_parallel  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError as e:
        return (f"torch {torch.__version__} has no torch.distributed._local_tensor.LocalTensorMode "
                f"(newer than torch 2.9), so the 64 simulated ranks cannot run here ({e})")
    return None


def _group_size(args) -> int:
    for a in reversed(args):  # a functional collective names its group last; a c10d op passes the group
        if isinstance(a, str):
            return dist.distributed_c10d._resolve_process_group(a).size()
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a).size()
    raise ValueError(f"no process group among the collective's arguments {[type(a).__name__ for a in args]}")


def _on_rank(t, rank: int = 0):
    """rank's own tensor of a LocalTensor (a plain tensor is every rank's)."""
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[rank] if isinstance(t, LocalTensor) else t


def _bytes(x) -> int:
    """Rank 0's bytes (an uneven shard makes a rank's tensor differ in size from another's)."""
    t = _on_rank(x[0] if isinstance(x, (list, tuple)) else x)
    return t.numel() * t.element_size()


class CollectiveLog(TorchDispatchMode):
    """Every collective that reaches the dispatcher, in order: (op, bytes of the tensor handed in,
    group size). A functional collective is logged where it is issued; the waits are not calls.
    An op on DTensors is handed back (NotImplemented) so that its collectives reach this mode."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if DTensor in types:  # let DTensor turn the op into local ops and collectives first (as CommDebugMode)
            return NotImplemented
        name = getattr(func, "__name__", "").split(".")[0]
        if func.namespace in ("_c10d_functional", "c10d") and name in OPS:
            self.calls.append((OPS[name], _bytes(args[0]), _group_size(args)))
        return func(*args, **(kwargs or {}))


@dataclass
class SimulatedStep:
    dims: ParallelDims
    batch_size: int  # global batch of sequences
    seq: int
    param_shapes: dict[str, list[tuple]]  # name -> its local shape on each rank
    params_per_rank: list[int]  # elements each rank holds
    groups: dict[str, list[list[int]]]  # the mesh's dp and tp groups
    calls: dict[str, list[tuple[str, int, int]]]  # phase ("tp", "dp", "norm") -> CollectiveLog calls
    torch_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # CommDebugMode's {fwd/bwd/step: {op: n}}
    loss: float = float("nan")  # rank 0's (each dp rank's own rows)
    grad_norm: float = float("nan")  # the global norm of the averaged gradient


def _local_shapes(t, ranks: int) -> list[tuple]:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return [tuple(_on_rank(t, r).shape) for r in range(ranks)]


def _counts(comm) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


def simulate_dp_tp(config, dp: int, tp: int, batch_size: int, data, seed: int = 0) -> SimulatedStep:
    """One step of `config` on dp * tp simulated ranks: forward and backward on the global batch
    `data` = (idx, targets), each (batch_size, T), split by rows over dp; the gradients averaged
    over dp and clipped to norm 1.0 over the world. Nothing is updated."""
    reason = local_tensor_missing()
    if reason:
        raise RuntimeError(reason)
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    idx, targets = data
    if idx.shape[0] != batch_size:
        raise ValueError(f"batch_size={batch_size} must be the rows of data ({idx.shape[0]})")
    dims = ParallelDims(dp=dp, tp=tp).check_model(config, batch_size, idx.shape[1])
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process: simulate_dp_tp makes its own fake one")
    world, rows = dp * tp, batch_size // dp
    model = GPT(config, seed)  # plain, outside the mode: replicated tensors stay one copy
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with LocalTensorMode(world) as mode:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            apply_dtensor_tensor_parallel(model, mesh["tp"])
            parallelize_module(model, mesh["tp"], {
                "tok_emb": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
            if config.tie_weights:  # the head's plan made its own copy: tie it to the sharded embedding again
                model.head.weight = model.tok_emb.weight
            groups = {"dp": [list(c) for c in zip(*_mesh_rows(mesh))], "tp": _mesh_rows(mesh)}
            shapes = {n: _local_shapes(p, world) for n, p in model.named_parameters()}
            per_rank = [sum(math.prod(s[r]) for s in shapes.values()) for r in range(world)]
            x = mode.rank_map(lambda r: idx[(r // tp) * rows:(r // tp + 1) * rows])
            y = mode.rank_map(lambda r: targets[(r // tp) * rows:(r // tp + 1) * rows])
            calls, counts = {}, {}
            with CommDebugMode() as comm, CollectiveLog() as log, warnings.catch_warnings():
                # CommDebugMode's module hooks fire on outputs only (the token ids need no gradient)
                warnings.filterwarnings("ignore", "Full backward hook is firing")
                with loss_parallel():
                    _, loss = model(x, y)
                    loss.backward()
            calls["tp"], counts["tp"] = log.calls, _counts(comm)
            params = list(model.parameters())
            local = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params]
            with CommDebugMode() as comm, CollectiveLog() as log, torch.no_grad():
                for group in ([g for g, p in zip(local, params) if p.dim() >= 2],
                              [g for g, p in zip(local, params) if p.dim() < 2]):
                    flat = torch.cat([g.reshape(-1) for g in group])
                    dist.all_reduce(flat, group=mesh.get_group("dp"))
                    flat /= dp
                    offset = 0
                    for g in group:
                        g.copy_(flat[offset:offset + g.numel()].view_as(g))
                        offset += g.numel()
            calls["dp"], counts["dp"] = log.calls, _counts(comm)
            copies = [math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_replicate())
                      if isinstance(p, DTensor) else tp for p in params]
            with CommDebugMode() as comm, CollectiveLog() as log:
                norm = clip_grad_norm_([(g, 1 / (c * dp)) for g, c in zip(local, copies)], 1.0, dist.group.WORLD)
            calls["norm"], counts["norm"] = log.calls, _counts(comm)
            return SimulatedStep(dims, batch_size, idx.shape[1], shapes, per_rank, groups, calls, counts,
                                 float(_on_rank(loss.to_local() if isinstance(loss, DTensor) else loss)),
                                 float(_on_rank(norm)))
    finally:
        dist.destroy_process_group()


def _mesh_rows(mesh) -> list[list[int]]:
    return [[int(r) for r in row] for row in mesh.mesh.tolist()]


def planned(config, dims: ParallelDims, batch_size: int, seq: int | None = None) -> dict:
    """The estimator's view of the same layout, per rank, in fp32: the busiest rank's parameters
    (rank_param_counts; memory_per_rank's parameter bytes) and each axis's collectives of one
    step (step_traffic's records: rank 0's calls; the loss log, which the trainer adds, left out)."""
    counts = rank_param_counts(config, tp=dims.tp)
    params = counts["dense"] + counts["expert"]
    memory = memory_per_rank(config, dims, batch_size, seq, recipe="fp32")
    traffic = step_traffic(config, dims, batch_size, seq, act_bytes=4, local_params=params)
    return {"params": params, "param_bytes": memory["params"],
            "records": {axis: [c for c in recs if not c.report] for axis, recs in traffic.items() if recs}}


def one_process(config, data, dp: int, seed: int = 0) -> tuple[float, float]:
    """The same step in one plain process: (the loss of dp rank 0's rows, the global norm of the
    gradient of the whole batch's mean loss, which is what the dp average of equal shares gives)."""
    idx, targets = data
    model = GPT(config, seed)
    with torch.no_grad():
        first = float(model(idx[:idx.shape[0] // dp], targets[:idx.shape[0] // dp])[1])
    model(idx, targets)[1].backward()
    return first, float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))


def side_by_side(step: SimulatedStep, plan: dict) -> list[dict]:
    """One row per axis: calls, bytes handed to the collectives and bytes rank 0 sends (a ring's
    2(n-1)/n per all-reduce, records.WIRE), simulated (rank 0's calls) and planned."""
    rows = []
    for axis, recs in plan["records"].items():
        made = step.calls.get(axis, [])
        rows.append({"axis": axis, "ops": sorted({c.op for c in recs} | {op for op, _, _ in made}),
                     "calls": (len(made), sum(c.calls for c in recs)),
                     "bytes": (sum(b for _, b, _ in made), sum(c.calls * c.nbytes for c in recs)),
                     "sent": (sum(WIRE[op](n) * b for op, b, n in made), sum(wire_bytes(c) for c in recs))})
    return rows
