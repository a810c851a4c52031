"""The course's layouts as sharding types: one table read by the torch side, the JAX side and the formula.

A layout says, for every tensor of one MLP step, which mesh axis splits which of its dims: a
PartitionSpec in JAX's words (one entry per tensor dim: a mesh axis name or None), from which
DTensor's placements follow (one entry per MESH dim: Shard(tensor dim) where that axis appears,
else Replicate). The program is an MLP on the residual stream, weights in nn.Linear's (out, in):

    h = gelu(x fc^T),  y = h proj^T,  loss = mean((y - t)^2)      x, t: (b, s, d); fc: (f, d); proj: (d, f)

and one SGD step: the gradients of fc, proj and x (x stands for the activation a previous layer
would need), then W <- W - lr g.

`formula(layout)` is what the course's traffic model (course_lib.estimate.traffic) says this
step sends, restricted to one MLP: M = b s d e bytes of activations, P_fc = P_proj = f d e bytes
of weights, e = 4 (fp32), n the size of the axis:

    dp      all-reduce of each gradient (P_fc, P_proj) over dp                (dp_traffic, zero=0)
    tp      all-reduce of M after proj (g) and of dL/dx before fc (f)         (tp_traffic: 1 of its 2 per block)
    sp      all-gather of x and reduce-scatter of y in forward; in backward the reduce-scatter's
            gradient (an all-gather of dL/dy) and the all-gather's (a reduce-scatter of dL/dx);
            the course's gathered_linear gathers x once more in backward (Megatron's memory trick)
    fsdp    all-gather of each weight in forward, reduce-scatter of each gradient; ZeRO-3 that
            frees the gathered weights after forward gathers them again in backward
    dp_tp   tp's two all-reduces on the local batch (M / dp) over tp, the tp shards' gradients
            (P / tp) all-reduced over dp
and, where the loss is a sum over sharded rows (every layout but tp), one 4-byte all-reduce of
the loss over the axes that split the batch or the sequence.

Byte convention (collective_time's and traffic.Collective.nbytes'): the FULL tensor of a call:
an all-reduce's tensor, an all-gather's output, a reduce-scatter's input. Pure Python: no torch,
no jax, so both processes and the tests read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
TENSORS = ("x", "fc", "proj", "t")  # the step's inputs; gradients and new weights keep their tensor's spec


@dataclass(frozen=True)
class Shapes:
    """One MLP step's sizes: batch b, sequence s, model width d, hidden width f (4d in a GPT)."""

    b: int = 4
    s: int = 8
    d: int = 16
    f: int = 64
    lr: float = 0.1
    e: int = 4  # fp32

    def shape(self, tensor: str) -> tuple[int, ...]:
        return {"x": (self.b, self.s, self.d), "t": (self.b, self.s, self.d),
                "fc": (self.f, self.d), "proj": (self.d, self.f)}[tensor]


@dataclass(frozen=True)
class ShardingPlan:
    """A mesh (axis names and sizes, in order) and a PartitionSpec per tensor."""

    name: str
    what: str
    axes: tuple[tuple[str, int], ...]
    specs: dict
    # annotations on intermediates: the layout a value must have where it is used (x and the
    # weights as the matmuls see them, y as the loss sees it); what each strategy fixes by hand
    use: dict = field(default_factory=dict)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def world(self) -> int:
        return prod(self.mesh_shape)

    def placements(self, tensor: str, spec: tuple | None = None) -> tuple[tuple, ...]:
        """DTensor's placements of `tensor` (or of a given spec), one per mesh dim: ("Shard", dim)
        or ("Replicate",)."""
        spec = self.specs[tensor] if spec is None else spec
        return tuple(("Shard", spec.index(axis)) if axis in spec else ("Replicate",) for axis, _ in self.axes)


def _layouts(n: int = 4) -> dict[str, ShardingPlan]:
    half = n // 2
    megatron = {"fc": ("tp", None), "proj": (None, "tp")}
    rows = [
        ShardingPlan("dp", "data parallel (DDP)", (("dp", n),),
               {"x": ("dp", None, None), "t": ("dp", None, None), "fc": (None, None), "proj": (None, None)}),
        ShardingPlan("tp", "Megatron: fc column-parallel, proj row-parallel", (("tp", n),),
               {"x": (None, None, None), "t": (None, None, None), **megatron}, use={"y": (None, None, None)}),
        ShardingPlan("sp", "Megatron with sequence parallelism", (("tp", n),),
               {"x": (None, "tp", None), "t": (None, "tp", None), **megatron},
               use={"x": (None, None, None), "y": (None, "tp", None)}),
        ShardingPlan("fsdp", "ZeRO-3 / FSDP: weights split by rows, batch split", (("dp", n),),
               {"x": ("dp", None, None), "t": ("dp", None, None), "fc": ("dp", None), "proj": ("dp", None)},
               use={"fc": (None, None), "proj": (None, None)}),
        ShardingPlan("dp_tp", "2D mesh: data parallel x Megatron", (("dp", half), ("tp", n // half)),
               {"x": ("dp", None, None), "t": ("dp", None, None), **megatron}, use={"y": ("dp", None, None)}),
    ]
    return {r.name: r for r in rows}


LAYOUTS = _layouts()

# The hidden activation h = gelu(x fc^T) as each hand-written strategy holds it, a pin the
# compiler may be given (jax.lax.with_sharding_constraint): Megatron's column-parallel fc leaves h
# split by hidden features; FSDP computes h on its own slice of the batch. Left out, the
# partitioner chooses h's sharding itself, and its choice depends on the shapes (appendix A1, 5).
HIDDEN = {"sp": (None, None, "tp"), "fsdp": ("dp", None, None)}


def check_layout(name: str, shapes: Shapes = Shapes()) -> ShardingPlan:
    """The layout called `name`, after checking every split divides its dim."""
    if name not in LAYOUTS:
        raise ValueError(f"layout={name!r} must be one of {sorted(LAYOUTS)}")
    layout = LAYOUTS[name]
    sizes = dict(layout.axes)
    for tensor in TENSORS:
        for dim, (axis, length) in enumerate(zip(layout.specs[tensor], shapes.shape(tensor))):
            if axis is not None and length % sizes[axis]:
                raise ValueError(f"{tensor} dim {dim} = {length} must be divisible by {axis} = {sizes[axis]}")
    return layout


@dataclass(frozen=True)
class Record:
    """One collective call of the formula: op on a full tensor of nbytes over group ranks.
    regather: the all-gather a strategy makes only if it freed what it gathered in forward."""

    op: str
    nbytes: int
    group: int
    what: str
    regather: bool = False


def formula(name: str, shapes: Shapes = Shapes()) -> list[Record]:
    """The collectives of one step of layout `name` on one rank (module docstring)."""
    layout = check_layout(name, shapes)
    sizes = dict(layout.axes)
    M, P = shapes.b * shapes.s * shapes.d * shapes.e, shapes.f * shapes.d * shapes.e
    loss = [Record("all_reduce", shapes.e, sizes.get("dp", sizes.get("tp", 1)), "the loss (a sum over split rows)")]
    if name == "dp":
        return [Record("all_reduce", P, sizes["dp"], "gradient of fc"),
                Record("all_reduce", P, sizes["dp"], "gradient of proj")] + loss
    if name == "tp":
        return [Record("all_reduce", M, sizes["tp"], "g: the partial sums of proj (forward)"),
                Record("all_reduce", M, sizes["tp"], "f: dL/dx from every rank's columns (backward)")]
    if name == "sp":
        n = sizes["tp"]
        return [Record("all_gather", M, n, "x's sequence shards into fc (forward)"),
                Record("reduce_scatter", M, n, "proj's partial sums to sequence shards (forward)"),
                Record("all_gather", M, n, "dL/dy: the reduce-scatter's gradient (backward)"),
                Record("reduce_scatter", M, n, "dL/dx: the all-gather's gradient (backward)"),
                Record("all_gather", M, n, "x gathered again for fc's weight gradient", regather=True)] + loss
    if name == "fsdp":
        n = sizes["dp"]
        return [Record("all_gather", P, n, "fc's rows (forward)"), Record("all_gather", P, n, "proj's rows (forward)"),
                Record("all_gather", P, n, "fc again (backward)", regather=True),
                Record("all_gather", P, n, "proj again (backward)", regather=True),
                Record("reduce_scatter", P, n, "gradient of fc"), Record("reduce_scatter", P, n, "gradient of proj")] + loss
    dp, tp = sizes["dp"], sizes["tp"]
    return [Record("all_reduce", M // dp, tp, "g on the local batch (forward)"),
            Record("all_reduce", M // dp, tp, "f on the local batch (backward)"),
            Record("all_reduce", P // tp, dp, "gradient of this rank's fc rows over dp"),
            Record("all_reduce", P // tp, dp, "gradient of this rank's proj columns over dp"),
            Record("all_reduce", shapes.e, dp, "the loss (a sum over the dp-split batch)")]


def totals(records, regather: bool = False, rs_as_all_reduce: bool = False) -> dict[tuple[str, int], int]:
    """{(op, group): bytes} over records (Record or (op, nbytes, group) tuples); regather=False
    leaves out the re-gathers; rs_as_all_reduce counts each reduce-scatter as an all-reduce of
    the same full tensor (XLA's CPU pipeline writes it so: an all-reduce, then each device keeps
    its slice)."""
    out: dict[tuple[str, int], int] = {}
    for r in records:
        op, nbytes, group = (r.op, r.nbytes, r.group) if isinstance(r, Record) else r
        if isinstance(r, Record) and r.regather and not regather:
            continue
        if rs_as_all_reduce and op == "reduce_scatter":
            op = "all_reduce"
        out[(op, group)] = out.get((op, group), 0) + nbytes
    return dict(sorted(out.items()))


def mapping_table() -> list[tuple[str, str, str, str]]:
    """(the name in Megatron / DeepSpeed / FSDP, tensor, DTensor placements, JAX PartitionSpec)."""
    def dt(layout, tensor):
        return "[" + ", ".join(f"Shard({p[1]})" if p[0] == "Shard" else "Replicate()"
                               for p in LAYOUTS[layout].placements(tensor)) + "]"

    def ps(layout, tensor):
        return "P(" + ", ".join("None" if a is None else repr(a) for a in LAYOUTS[layout].specs[tensor]) + ")"

    rows = [("DDP: replicated weight", "dp", "fc"), ("DDP: batch split", "dp", "x"),
            ("Megatron ColumnParallelLinear", "tp", "fc"), ("Megatron RowParallelLinear", "tp", "proj"),
            ("Megatron sequence parallelism: activations", "sp", "x"),
            ("ZeRO-3 / FSDP (FULL_SHARD): a flat or per-row shard", "fsdp", "fc"),
            ("dp x tp: ColumnParallelLinear replicated over dp", "dp_tp", "fc"),
            ("dp x tp: the batch", "dp_tp", "x")]
    table = [(who, f"{tensor} ({layout})", dt(layout, tensor), ps(layout, tensor)) for who, layout, tensor in rows]
    table.append(("Megatron g's input: partial sums before the all-reduce", "y (tp)", "[Partial()]",
                  "(none under jit; in shard_map: the value before psum)"))
    return table
