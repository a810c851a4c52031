"""The traffic model's record and how it is read: `Collective` (one kind of call in one step),
wire_bytes and seconds (what a record costs on a link), DDP's buckets, and the parameter counts
the axes' records are sized by (course_lib.estimate.traffic: the notation)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib._validate import check_int
from course_lib.comm.measured import CollectiveTable, collective_time
from course_lib.dims import check_batch, layers_per_rank
from course_lib.estimate.params import kv_copy_rows, model_shape, param_breakdown, param_count


@dataclass(frozen=True)
class Collective:
    """One kind of collective call in one step: `calls` of `op` on a tensor of `nbytes` (the
    full tensor, collective_time's convention) over `group` ranks, on rank 0; `world_bytes`:
    bytes sent, summed over every rank (the tracer's count: an all-gather's input, a
    reduce-scatter's input, a message, a broadcast's source only)."""

    axis: str
    what: str
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send (a send or a receive), broadcast
    nbytes: float
    group: int
    calls: int
    world_bytes: float
    priced: int | None = None  # calls the step-time model prices (None: all of them)
    why: str = ""  # why priced differs from calls
    report: bool = False  # the loss log, outside the step
    # calls the course's runtime makes one by one where Megatron overlaps or batches them: priced
    # on a measured CollectiveTable (the course's own runs), left out on a published cluster
    measured_only: bool = False

    @property
    def priced_calls(self) -> int:
        return self.calls if self.priced is None else self.priced


def _pipeline_rank(rank: int, pp: int) -> int:
    return check_int("rank", rank, minimum=0, maximum=pp - 1, rule=f"a pipeline rank in [0, pp={pp})")


def _shape(config, dims, batch_size, seq):
    base = model_shape(config).base
    s = base.block_size if seq is None else seq
    mb = check_batch(batch_size, dims.replicas, dims.microbatches) // dims.microbatches
    return base, s, mb, max(layers_per_rank(base.n_layer, dims.pp, dims.virtual_stages))


# ----------------------------------------------------------------------------- reading a record
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
        "send": lambda n: 1.0, "broadcast": lambda n: 1.0}


def wire_bytes(c: Collective) -> float:
    """Bytes rank 0 puts on its link in one step for this record: ring all-reduce 2(n-1)/n S,
    ring all-gather / reduce-scatter and pairwise all-to-all (n-1)/n S, a message S, per call."""
    return 0.0 if c.group <= 1 else c.calls * WIRE[c.op](c.group) * c.nbytes


def broadcast_hops(n: int) -> int:
    """Messages one after another from a broadcast's root to its last rank: ceil(log2 n), a
    binomial tree (gloo's broadcast: in round i the ranks that hold the data send it to the
    ranks 2^i away; MPICH's short-message broadcast is the same tree, Thakur et al. 2005)."""
    return (n - 1).bit_length() if n > 1 else 0


def seconds(c: Collective, link) -> float:
    """The step-time model's seconds of this record on `link` (a LinkModel or a measured
    CollectiveTable): priced calls, each collective_time(link, op, nbytes, group); a broadcast
    (no column of the measured table, no alpha-beta formula of its own) as broadcast_hops(group)
    point-to-point messages of nbytes: ceil(log2 n) (alpha + S / beta) on a LinkModel."""
    if c.report or not c.priced_calls or (c.measured_only and not isinstance(link, CollectiveTable)):
        return 0.0
    if c.op == "broadcast":
        return c.priced_calls * broadcast_hops(c.group) * collective_time(link, "send", c.nbytes, 2)
    return c.priced_calls * collective_time(link, c.op, c.nbytes, c.group)


def ddp_buckets(nbytes: float, first: float = 1 << 20, cap: float = 25 * (1 << 20)) -> list[float]:
    """The gradient all-reduces of DDP (course_lib.parallel.dp.ddp, torch's rule): a first
    bucket of 1 MiB, then buckets of up to 25 MiB."""
    sizes, left = [], float(nbytes)
    while left > 0:
        sizes.append(min(left, first if not sizes else cap))
        left -= sizes[-1]
    return sizes


# ----------------------------------------------------------------------------- parameter counts
def padded_vocab(config, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (the vocabulary-parallel embedding's rows)."""
    return -(-model_shape(config).base.vocab_size // tp) * tp


def _dense_base(config):
    base = model_shape(config).base
    return replace(base, n_experts=0) if getattr(base, "n_experts", 0) else base


def total_params(config) -> int:
    """Every parameter once; an MoE model: the dense count with each MLP replaced by
    n_experts MLPs and a router (d x E, no bias)."""
    shape = model_shape(config)
    base, experts = shape.base, shape.n_experts
    if not experts:
        return param_count(config)
    dense = _dense_base(config)
    return param_count(dense) + base.n_layer * (param_breakdown(dense)["mlp"] * (experts - 1) + base.d_model * experts)


def dense_params(config) -> int:
    """Parameters outside the experts (all of them for a dense model)."""
    shape = model_shape(config)
    base, experts = shape.base, shape.n_experts
    if not experts:
        return total_params(config)
    return total_params(config) - base.n_layer * experts * param_breakdown(_dense_base(config))["mlp"]


def tp_replicated_params(config) -> int:
    """Parameters every tp rank keeps whole: norms, row-parallel biases, a position table."""
    base = _dense_base(config)
    parts, bias = param_breakdown(base), int(getattr(base, "bias", False))
    return base.n_layer * (parts["norms"] + 2 * base.d_model * bias) + parts["final_norm"] + parts["position"]


def replica_group_params(config, dims) -> int:
    """Parameters held by the pp*ep*tp ranks of one data-parallel copy, summed: a tp-replicated
    tensor counted tp times, dense tensors ep times, the tied matrix once more when the first
    and last stage differ, the vocabulary padding of tensor parallelism included, and the copies of
    KV heads at tp > n_kv_head (kv_copy_rows per block, each row d weights and a bias)."""
    base = model_shape(config).base
    vpad, d, tied = padded_vocab(config, dims.tp), base.d_model, getattr(base, "tie_weights", False)
    n = total_params(config) + (vpad - base.vocab_size) * d * (1 if tied else 2)
    n += (dims.tp - 1) * tp_replicated_params(config) if dims.tp > 1 else 0
    n += dims.ep * base.n_layer * kv_copy_rows(config, dims.tp) * (d + int(getattr(base, "bias", False)))
    n += (dims.ep - 1) * dense_params(config) + dims.ep * (vpad * d if dims.pp > 1 and tied else 0)
    return n
