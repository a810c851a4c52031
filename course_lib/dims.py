"""One description of a parallel layout and THE rule book: what makes a layout valid for a model.

Pure Python (no torch), below both course_lib.parallel (which runs layouts) and
course_lib.estimate (which costs them), so both read the same rules and the same words:

    MESH_ORDER = ("pp", "dp", "ep", "cp", "tp")  outermost -> innermost: tp ranks are neighbours,
                                                  cp next (its ring is the next heaviest traffic)
    world_size = pp * dp * ep * cp * tp
    rank = (((pp_index * dp + dp_index) * ep + ep_index) * cp + cp_index) * tp + tp_index

Every axis is always present, size 1 included (ParallelDims.sizes(), make_mesh's RankMesh); the
groups spanning several axes are named once, as data (DERIVED_GROUPS), and `groups` gives any
group's rank lists. The geometry also takes sizes without "cp" (MESH_DIMS: notebooks 00 and 10's
four axes). torchtitan orders its mesh pp, dp, cp, tp the same way.

What each degree splits (B = global batch, L = layers, E = experts, T = sequence):

    tp   the weights of every matrix (heads, d_ff, vocabulary): tp | n_head, d_ff, n_kv_head (or, the course's GPT,
         n_kv_head | tp: copies_kv); with sequence parallelism also the activations outside attention/MLP: tp | T (T/cp)
    pp   the layers: pp * v stages (v virtual stages per rank), split as evenly as
         split_layers says (the first L mod S stages one block more): L >= pp * v
    dp   the batch: B / (dp * ep) rows per replica, in m micro-batches
    ep   the experts: E / ep per rank (ep | E); an ep rank is also a data replica
    cp   the sequence T of every row: T / cp tokens per rank (cp | T; 2cp | T with causal load
         balancing, rank r holding chunks r and 2cp-1-r); the cp ranks of a replica read the
         SAME rows, so replicas stay dp * ep; they hold whole weights, so the gradients are
         reduced (and ZeRO shards the state) over dp * ep * cp ranks. K, V travel un-repeated (their
         n_kv_head heads); Ulysses' all-to-all needs cp | n_head/tp and the tp rank's KV heads

The rules come in two kinds, kept apart: `check_model` is what any run of this layout needs (the
estimator costs exactly what it accepts); `check_composable` is what the course's runtime
(course_lib.parallel.hybrid) cannot compose yet. ParallelDims.check is both, plus the world size. Each
rule is one ValueError naming the value and the rule, raised before any rank starts. (Over 300 lines on
purpose: the rule book, vocabulary and geometry in one file both sides read.)"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from course_lib._validate import check_bool, check_int, check_one_of

MESH_ORDER = ("pp", "dp", "ep", "cp", "tp")  # outermost -> innermost, context parallelism included
MESH_DIMS = ("pp", "dp", "ep", "tp")  # the four axes notebooks 00 and 10 name (cp one rank)
# Groups spanning several axes, named once: {name: the axes its ranks differ in} (RankMesh.group)
DERIVED_GROUPS = {
    "dp_cp": ("dp", "cp"),  # dense gradients' mean and ZeRO's shards: cp ranks hold whole weights
    "replica": ("dp", "ep"),  # the ranks reading different rows: dp_index*ep + ep_index
    "loss": ("dp", "ep", "cp"),  # the step's loss: the mean over replicas and sequence shards
}
GROUPS = {**{a: (a,) for a in MESH_ORDER}, **DERIVED_GROUPS}  # every group a rank belongs to
TOPOLOGY_AWARE = MESH_ORDER  # tp innermost: its ranks share a node; cp next to it
NAIVE = ("tp", "cp", "ep", "dp", "pp")  # tp outermost: its ranks sit gpus_per_node or more apart
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev", "pipedream_2bw")  # the course runs
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank in a V (virtual_stages = 2): rank r holds stages r, 2p-1-r
ZERO_STAGES = (0, 1, 2, 3)  # 0: plain data parallelism; 1 optimizer state, 2 + gradients, 3 + parameters
COMPOSED_ZERO_STAGES = (0, 1, 2, 3)  # 2 and 3 with pp/tp: gradients reduced once per step (parallel/hybrid/zero_pp.py)
RECOMPUTE = ("none", "selective", "full")  # selective: attention's s^2 part (Korthikanti et al. 2022)
PRECISIONS = ("fp32", "bf16")  # bf16: torch.autocast around forward and backward, fp32 master weights
CP_METHODS = ("ring", "allgather", "ulysses")  # how context-parallel attention sees the other ranks' keys


# ---------------------------------------------------------------- the rules, one function each
def check_tp(tp: int, n_head: int, d_ff: int, n_kv_head: int | None = None, replicate_kv: bool = False) -> None:
    """Whole heads and MLP columns per tensor-parallel rank: tp | n_head, tp | d_ff, tp | n_kv_head, or with
    replicate_kv n_kv_head | tp (course_lib.parallel.tp copies each KV head to tp/n_kv_head ranks: copies_kv)."""
    check_int("tp", tp)
    for name, value in (("n_head", n_head), ("n_kv_head", n_kv_head), ("d_ff", d_ff)):
        if value is not None and value % tp and not (name == "n_kv_head" and replicate_kv and tp % value == 0):
            raise ValueError(f"tp={tp} must divide {name}={value}{' or be a multiple of it' * (replicate_kv and name == 'n_kv_head')}")


def copies_kv(shape) -> bool:
    """Whether tp may copy KV heads (n_kv_head | tp): for the course's GPT (a GPTConfig), which its runtime runs."""
    return hasattr(shape.config, "kv_heads")


def check_context_parallel(cp: int, seq: int | None, n_head: int, method: str = "ring",
                           load_balance: bool = True, n_kv_head: int | None = None, tp: int = 1) -> None:
    """Context parallelism splits the sequence of T = seq tokens over cp ranks in equal shards:
    cp | T, and with causal load balancing ("zig-zag": rank r holds chunks r and 2cp-1-r of 2cp)
    2cp | T. Ulysses re-shards a tp rank's heads with an all-to-all, K and V un-repeated (grouped-query
    attention): cp | n_head/tp and cp | its KV heads, n_kv_head/tp or one copied head at tp > n_kv_head
    (copies_kv; so cp = 1 there). None for seq: not known yet, checked later."""
    check_int("cp", cp)
    check_one_of("cp_method", method, CP_METHODS)
    check_bool("load_balance", load_balance)
    if cp == 1:
        return
    if seq is not None and seq % (2 * cp if load_balance else cp):
        why = (f"2*cp = {2 * cp} chunks (load_balance=True: rank r holds chunks r and 2cp-1-r)"
               if load_balance else f"cp = {cp} equal shards")
        raise ValueError(f"seq_len={seq} must be divisible by {why}")
    for name, value in (("n_head", n_head), ("n_kv_head", n_kv_head)) if method == "ulysses" else ():
        if value is not None and max(1, value // tp) % cp:
            where = (f"{name}={value}" if tp == 1 else f"the {name}/tp = {value}/{tp} = {value // tp} heads of a tensor-"
                     f"parallel rank" if value >= tp else f"the one KV head a tp={tp} > {name}={value} rank copies")
            raise ValueError(f"cp={cp} must divide {where} for method='ulysses' (its all-to-all gives each "
                             f"rank whole heads of the whole sequence)")


def check_sequence_parallel(sequence_parallel: bool, tp: int, seq: int | None = None) -> None:
    """Sequence parallelism splits the WHOLE sequence of T = seq tokens over the tp ranks
    (None: the sequence is not known yet, checked later)."""
    check_bool("sequence_parallel", sequence_parallel)
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tp > 1: it splits the sequence over the tp ranks")
    if sequence_parallel and seq is not None and seq % tp:
        raise ValueError(f"sequence length {seq} must be divisible by tp={tp} under sequence parallelism")


def check_virtual_stages(schedule: str, v: int) -> None:
    """The chunks a rank holds: exactly 2 in a V schedule, one unless the schedule is interleaved."""
    if schedule in V_SCHEDULES and v != 2:
        raise ValueError(f"schedule={schedule!r} places exactly 2 chunks per rank in a V (rank r holds stages r and "
                         f"2p-1-r): virtual_stages must be 2, got {v}")
    if v > 1 and schedule not in ("interleaved_1f1b", *V_SCHEDULES):
        raise ValueError(f"virtual_stages={v} needs schedule='interleaved_1f1b' ({schedule!r} runs one chunk per rank)")


def check_pipeline_choice(schedule: str, pp: int, m: int, v: int = 1) -> None:
    """A schedule's own rules (m micro-batches, v chunks per rank), before it is built (parallel.pp.check_schedule: after)."""
    for name, value in (("pp", pp), ("microbatches", m), ("virtual_stages", v)):
        check_int(name, value)
    check_one_of("schedule", schedule, SCHEDULES)
    if v > 1 and pp == 1:
        raise ValueError(f"virtual_stages={v} needs pp > 1")
    check_virtual_stages(schedule, v)
    if schedule == "interleaved_1f1b" and pp > 1 and m % pp:
        raise ValueError(f"microbatches={m} must be a multiple of the pp={pp} ranks for interleaved_1f1b "
                         f"(micro-batches enter the chunks in rounds of pp)")


def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """The block indices of each of n_stages stages: n_layer // S each, the first n_layer mod S
    one more. Every stage needs a block: n_layer >= n_stages."""
    if n_layer < n_stages:
        raise ValueError(f"n_layer={n_layer} blocks cannot fill {n_stages} stages (pp x virtual_stages): "
                         f"every stage needs at least one block")
    base, extra = divmod(n_layer, n_stages)
    return [range(s * base + min(s, extra), (s + 1) * base + min(s + 1, extra)) for s in range(n_stages)]


def layers_per_rank(n_layer: int, pp: int, v: int = 1) -> list[int]:
    """Blocks held by each pipeline rank: rank r runs stages r, r + pp, ... of split_layers(n_layer, pp*v)."""
    stages = split_layers(n_layer, pp * v)
    return [sum(map(len, stages[r::pp])) for r in range(pp)]  # its v stages r, r + pp, ...


def check_experts(ep: int, n_experts: int) -> None:
    """ep | n_experts; a dense model (n_experts = 0: ModelShape's vocabulary) has nothing to split."""
    check_int("ep", ep)
    if ep > 1 and not n_experts:
        raise ValueError(f"ep={ep} needs an MoE model: n_experts={n_experts} is dense")
    if n_experts and n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_experts={n_experts}: every rank holds n_experts / ep whole experts")


def check_batch(batch_size: int, replicas: int, microbatches: int) -> int:
    """Every replica an equal share, cut into whole micro-batches; returns the share."""
    check_int("batch_size", batch_size)
    if batch_size % replicas:
        raise ValueError(f"batch_size={batch_size} must be divisible by dp*ep = {replicas}: "
                         f"every replica takes an equal share")
    if (share := batch_size // replicas) % microbatches:
        raise ValueError(f"microbatches={microbatches} must divide the per-replica batch batch_size/(dp*ep) = {share}")
    return share


# ---------------------------------------------------------------- the mesh's geometry
def check_order(order) -> tuple[str, ...]:
    """A permutation of MESH_ORDER, or of MESH_DIMS (without cp: one rank wherever it sits)."""
    if sorted(order := tuple(order)) not in (sorted(MESH_ORDER), sorted(MESH_DIMS)):
        raise ValueError(f"order={order!r} must be a permutation of {MESH_ORDER} (cp may be left out: one rank)")
    return order


def _axes(sizes: dict[str, int], order) -> tuple[str, ...]:
    """`order` over the dims `sizes` names: without "cp" in sizes a four-axis mesh (cp dropped from
    the order); an order without cp takes a cp of size 1, placed next to tp."""
    order = check_order(order)
    if "cp" not in sizes:
        return tuple(d for d in order if d != "cp")
    if "cp" not in order:
        if sizes["cp"] != 1:
            raise ValueError(f"order={order!r} leaves out cp, so it needs cp=1, not cp={sizes['cp']}")
        order = order[:order.index("tp")] + ("cp",) + order[order.index("tp"):]
    return order


def coordinates(rank: int, sizes: dict[str, int], order=TOPOLOGY_AWARE) -> dict[str, int]:
    """{dim: index} of `rank` (the last dim of `order` varies fastest), for the dims `sizes` names."""
    order = _axes(sizes, order)
    world = math.prod(sizes[d] for d in order)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, {world})")
    out = {}
    for d in reversed(order):
        rank, out[d] = divmod(rank, sizes[d])
    return {d: out[d] for d in MESH_ORDER if d in out}


def rank_of(coords: dict[str, int], sizes: dict[str, int], order=TOPOLOGY_AWARE) -> int:
    rank = 0
    for d in _axes(sizes, order):
        rank = rank * sizes[d] + (coords.get(d, 0) if d == "cp" else coords[d])
    return rank


def groups(sizes: dict[str, int], order=TOPOLOGY_AWARE, names=None) -> dict[str, list[list[int]]]:
    """THE group geometry: {name: its groups} for names = {name: axes} (default: each dim `sizes`
    names, alone; GROUPS: every group a RankMesh holds). A group of axes A is the ranks that differ
    only in A's indices: the groups partition the world, each in increasing rank (a rank's index
    in it: its coordinates along A read as one number, in `order`), by their smallest rank."""
    order = _axes(sizes, order)
    names = {d: (d,) for d in MESH_ORDER if d in order} if names is None else names
    coords = [coordinates(r, sizes, order) for r in range(math.prod(sizes[d] for d in order))]
    out = {}
    for name, axes in names.items():
        seen: dict[tuple, list[int]] = {}
        for r, c in enumerate(coords):
            seen.setdefault(tuple(v for k, v in c.items() if k not in axes), []).append(r)
        out[name] = list(seen.values())
    return out


def fits_node(span: int, gpus_per_node: int) -> bool:
    """Groups {base + k*stride, k < n} of span n * stride (ranks numbered node by node) all sit in
    one node iff the span fits a node and never straddles two (link_of, estimate's Cluster.link)."""
    return span <= gpus_per_node and gpus_per_node % span == 0


def link_of(dim: str, sizes: dict[str, int], gpus_per_node: int, order=TOPOLOGY_AWARE) -> str:
    """"intra" if every group of `dim` sits inside one node, else "inter" ("none" for size 1)."""
    check_int("gpus_per_node", gpus_per_node)
    if sizes.get(dim, 1 if dim == "cp" else None) == 1:
        return "none"
    order = _axes(sizes, order)
    stride = math.prod(sizes[d] for d in order[order.index(dim) + 1:])
    return "intra" if fits_node(stride * sizes[dim], gpus_per_node) else "inter"


def product_text(degrees: dict[str, int]) -> str:
    """'pp*dp*ep*tp = 2*2*1*2 = 8' in the caller's order, cp shown when > 1: a world-size mismatch."""
    shown = {d: n for d, n in degrees.items() if d != "cp" or n != 1}
    return f"{'*'.join(shown)} = {'*'.join(map(str, shown.values()))} = {math.prod(shown.values())}"


# ---------------------------------------------------------------- one layout
@dataclass(frozen=True)
class ParallelDims:
    """The degrees and options of one run; validated once, in the parent, before any rank starts."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    virtual_stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    precision: str = "fp32"  # PRECISIONS; the single-process twin (train_single) takes the same
    recompute: str = "none"  # RECOMPUTE; "full": every block's forward again in backward
    cp: int = 1  # context parallelism: T / cp tokens of every sequence per rank
    cp_method: str = "ring"  # CP_METHODS: how attention sees the other cp ranks' keys
    cp_load_balance: bool = True  # zig-zag chunks (rank r: r and 2cp-1-r) even the causal work
    reshard_after_forward: bool = True  # zero=3: free a stage's gathered parameters after each forward

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Different shares of the batch: dp * ep (a replica's cp ranks read the same rows)."""
        return self.dp * self.ep

    def sizes(self) -> dict[str, int]:
        """{axis: degree} in MESH_ORDER, every axis (size 1 included): the mesh make_mesh builds."""
        return {d: getattr(self, d) for d in MESH_ORDER}

    def label(self) -> str:
        """'dp2·tp2·pp2' (cp, ep only when > 1: 'dp8·tp8·pp16·cp16'): how a resume names its layout."""
        return "·".join(f"{d}{getattr(self, d)}" for d in ("dp", "tp", "pp", "cp", "ep")
                        if d not in ("cp", "ep") or getattr(self, d) > 1)

    def describe(self, batch_size: int | None = None) -> str:
        """The whole layout: label() then every option that differs from its default, and the
        micro-batch size when the global batch is given: 'dp8·tp8·pp16·sp·v2·m192·mb1·rc-full'.
        With cp > 1 its method and, when off, the load balancing: 'dp2·tp1·pp1·cp4·allgather·no-lb'."""
        parts = [self.label()]
        parts += [self.cp_method] if self.cp > 1 and self.cp_method != "ring" else []
        parts += ["no-lb"] if self.cp > 1 and not self.cp_load_balance else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        parts += [self.schedule] if self.pp > 1 and self.schedule not in ("1f1b", "interleaved_1f1b") else []
        parts += [f"m{self.microbatches}"] if self.microbatches > 1 else []
        parts += [f"mb{self.micro_batch(batch_size)}"] if batch_size is not None else []
        parts += [f"zero{self.zero}"] if self.zero else []
        parts += ["no-reshard"] if not self.reshard_after_forward else []
        parts += [f"rc-{self.recompute}"] if self.recompute != "none" else []
        parts += [self.precision] if self.precision != "fp32" else []
        return "·".join(parts)

    def micro_batch(self, batch_size: int) -> int:
        """Sequences per micro-batch: batch_size / (dp * ep * microbatches), whole (check_batch)."""
        return check_batch(batch_size, self.replicas, self.microbatches) // self.microbatches

    def _check_counts(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp", "virtual_stages", "microbatches"):
            check_int(name, getattr(self, name))

    def check_model(self, model_config, batch_size: int, seq_len: int | None = None) -> "ParallelDims":
        """THE rule book: what any run of this layout needs from the model, read through its .shape
        (course_lib.model.config.ModelShape, the estimator's view too), and the batch. Returns self."""
        self._check_counts()
        check_int("zero", self.zero, minimum=0)
        check_one_of("zero", self.zero, ZERO_STAGES)
        check_one_of("precision", self.precision, PRECISIONS)
        check_one_of("recompute", self.recompute, RECOMPUTE)
        shape = model_config.shape
        seq = shape.block_size if seq_len is None else check_int("seq_len", seq_len)
        check_pipeline_choice(self.schedule, self.pp, self.microbatches, self.virtual_stages)
        split_layers(shape.n_layer, self.pp * self.virtual_stages)
        check_tp(self.tp, shape.n_head, shape.ff_dim, shape.n_kv_head, copies_kv(shape))
        check_context_parallel(self.cp, seq, shape.n_head, self.cp_method, self.cp_load_balance, shape.n_kv_head,
                               self.tp)  # Ulysses: a tp rank's heads
        check_sequence_parallel(self.sequence_parallel, self.tp, seq // self.cp)  # tp splits a cp shard
        check_experts(self.ep, shape.n_experts)
        check_batch(batch_size, self.replicas, self.microbatches)
        return self

    def check_composable(self, model_config) -> "ParallelDims":
        """What the course's runtime (course_lib.parallel.hybrid) cannot compose yet. Returns self."""
        cfg = model_config
        if self.cp > 1:  # what course_lib.parallel.hybrid composes with context parallelism
            if cfg.n_experts:
                raise ValueError(f"cp={self.cp} with n_experts={cfg.n_experts}: context parallelism here splits the "
                                 f"dense GPT only (the routers' balancing losses are means over all the batch's "
                                 f"tokens, not over a shard)")
            if getattr(cfg, "dropout", 0.0):
                raise ValueError(f"cp={self.cp} with dropout={cfg.dropout}: context-parallel attention has no "
                                 f"attention dropout; use dropout=0")
        if self.zero not in COMPOSED_ZERO_STAGES:
            raise ValueError(f"zero={self.zero} must be one of {COMPOSED_ZERO_STAGES}")
        check_bool("reshard_after_forward", self.reshard_after_forward)
        if not self.reshard_after_forward and self.zero != 3:
            raise ValueError(f"reshard_after_forward=False with zero={self.zero}: it is a ZeRO-3 policy (keep the "
                             f"gathered parameters for the whole step); below stage 3 they are never freed")
        looped = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")  # build_stage's stage s on rank s mod pp
        if self.pp > 1 and self.schedule not in looped:
            raise ValueError(f"schedule={self.schedule!r} with pp={self.pp}: the composed runtime builds looped stages "
                             f"(stage s on rank s mod pp) and runs a flushed schedule each step, one of {looped}; "
                             f"the V and PipeDream-2BW schedules run in course_lib.parallel.pp alone")
        why = {"ep": "before expert parallelism's average over ep", "cp": "and are composed over the dp group "
               "only, not over the dp*cp ranks that context parallelism reduces over"}
        for name in why if self.zero >= 2 else ():  # parallel/hybrid/zero_pp.py: each gradient reduced once
            if getattr(self, name) > 1:
                raise ValueError(f"zero={self.zero} with {name}={getattr(self, name)}: stages 2 and 3 reduce each gradient "
                                 f"over dp as soon as its last micro-batch's backward ends, {why[name]}; use zero=0 or 1")
        if self.recompute == "selective":
            raise ValueError("recompute='selective' is costed by the estimator, not run here: the runtime "
                             "recomputes whole blocks (recompute='full') or nothing ('none')")
        if self.tp > 1 and cfg.n_experts:
            raise ValueError(f"tp={self.tp} with n_experts={cfg.n_experts}: tensor parallelism here splits the "
                             f"dense GPT only; give an MoE model tp=1 and split its experts with ep")
        if cfg.n_experts and self.pp > 1 and (cfg.aux_loss_coef or cfg.z_loss_coef or cfg.capacity_factor):
            raise ValueError(f"pp={self.pp} with an MoE model needs aux_loss_coef=0, z_loss_coef=0 and "
                             f"capacity_factor=None: the pipeline's last stage computes only the cross-entropy, "
                             f"and capacity would depend on the micro-batch")
        return self

    def check(self, world_size: int | None, model_config, batch_size: int,
              seq_len: int | None = None) -> "ParallelDims":
        """The rule book, the runtime's limits and the world size (None: the product of the
        degrees, the parent launching that many ranks). Returns self."""
        if world_size is not None:
            self._check_counts()
            if self.world_size != world_size:
                raise ValueError(f"{product_text(self.sizes())} must equal world_size={world_size}")
        self.check_model(model_config, batch_size, seq_len)
        return self.check_composable(model_config)


def check_runner(dims, runner: str, axes: tuple[str, ...]) -> ParallelDims:
    """run_<axis>(dims, model_config, train_cfg, ...) runs the fields in `axes` only: any other field
    off its default is refused here, in the parent (run_hybrid composes axes). Returns dims."""
    if not isinstance(dims, ParallelDims):
        raise ValueError(f"dims={dims!r} must be a course_lib.dims.ParallelDims (e.g. ParallelDims(tp=2))")
    dims._check_counts()
    for f in fields(dims):
        if f.name not in axes and getattr(dims, f.name) != f.default:
            raise ValueError(f"{f.name}={getattr(dims, f.name)!r}: {runner} runs {', '.join(axes)} only, so {f.name} "
                             f"must be {f.default!r} (run_hybrid composes the axes)")
    return dims
