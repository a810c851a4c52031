"""One traffic model per mesh axis: the collectives of one optimizer step, as small records.
(Over 300 lines on purpose: the five axes sit side by side in one notation, so a count can be
compared across them and a new axis is one more function here.)

Each axis function returns a list of `Collective`s, read by both sides of the course:
the byte accounting of notebook 10 (course_lib.parallel.topology sums `world_bytes` per axis)
and the step-time model of notebook 11 (course_lib.estimate.step_time prices `priced` calls
of `nbytes` on a link and counts `calls`). Each axis package re-exports its function.

Notation: B global batch, R = dp * ep replicas, m micro-batches of mb = B / (R m) sequences of
s tokens, d = d_model, e bytes per element, L blocks (L_0 on rank 0, the busiest: split_layers
gives the first stages the extra blocks), S = pp * v pipeline stages, M = mb s d e (one
micro-batch of the residual stream). Per micro-batch, summed over the pp stages of one replica
and one tp rank (the course's runtime, counted by course_lib.observe.CommTracer):

    tp   4L + 2 all-reduces of M (Megatron's g after attn.proj and mlp.proj, f before qkv and fc,
         g after the vocabulary-parallel embedding, f before the head) + 3 of s mb fp32 numbers
         (the loss: max, sum, target). Sequence parallelism: each all-reduce an all-gather of M
         (sent M / tp) or a reduce-scatter of M (sent M), 2L + 1 of each in forward; backward
         2L + 1 reduce-scatters, 2(2L + 1) all-gathers (the gradient of each forward reduce-
         scatter, and the re-gather of each saved sequence shard), and the gradients of the
         replicated parameters that saw a shard (norms, row-parallel biases, the position table)
    pp   2(S - 1) point-to-point messages of M (an activation forward, a gradient backward per
         boundary), the tied embedding's gradient between the end stages (one message each
         way), and the loss broadcast from the last stage
    ep   per MoE block 4 all-to-alls of the mb s top_k routed rows (dispatch, combine, and their
         gradients) + one of E int64 counts; once per step the dense gradients averaged over ep
    cp   per block the attention's K/V traffic of the method: all-gather + reduce-scatter, ring
         hops of K||V and dK||dV, or Ulysses' 4 all-to-alls (cp_traffic)
    dp   the gradients over the replicas (DDP's buckets, or one all-reduce per parameter group;
         ZeRO-1 reduce-scatter + all-gather; ZeRO-2 the reduce-scatter every micro-batch; ZeRO-3
         per block 2 all-gathers and a reduce-scatter; composed with pp / tp, ZeRO-2 and 3 reduce
         once per step and stage 3 gathers 2m or 1 times per unit: zero_pp_ops), and the loss
         averaged over dp for the log
    norm one all-reduce of the squared global norm (8 bytes) over the world

`calls` is what the tracer counts on rank 0 in one step (the first stage). Sequence parallelism's
re-gathers in backward and its small all-reduces of the replicated parameters' gradients are
`measured_only`: Megatron overlaps the re-gathers with the weight-gradient matmul and reduces
those gradients once per step, so a published cluster leaves them out; a measured table (the
course's runtime, which makes each call) prices them. `priced` departs from
`calls` only where the step-time model says so, each with its reason in the record (`why`):
it prices the busiest rank, l0 blocks and both ends (embedding, head and loss) on one rank
(tp_traffic's rank=r counts pipeline rank r's calls as the runtime makes them instead: what
the step-time model prices on a measured table); `report` marks the trainer's loss log, which the tracer sees and the step
does not need. Full recomputation: the step-time model prices Megatron's (every block's forward
again: 2 all-reduces, Korthikanti et al. 2022); the course's runtime (torch's non-reentrant
checkpoint) stops once the block's saved tensors are back, before the MLP's g: 1 all-reduce.
Precision bf16 (torch.autocast): the row-parallel matmuls' outputs travel as bf16 (see
tp_traffic); the residual stream between stages and the gradients stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib.comm.measured import CollectiveTable, collective_time
from course_lib.dims import check_batch, layers_per_rank
from course_lib.estimate.params import kv_dim, param_breakdown, param_count, unpack
from course_lib.estimate.per_gpu import zero_units


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
    if not (isinstance(rank, int) and 0 <= rank < pp):
        raise ValueError(f"rank={rank!r} must be a pipeline rank in [0, pp={pp})")
    return rank


def _shape(config, dims, batch_size, seq):
    base = unpack(config)[0]
    s = base.block_size if seq is None else seq
    mb = check_batch(batch_size, dims.replicas, dims.microbatches) // dims.microbatches
    return base, s, mb, max(layers_per_rank(base.n_layer, dims.pp, dims.virtual_stages))


def tp_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
               rank: int | None = None) -> list[Collective]:
    """Tensor (and sequence) parallelism's collectives (module docstring). Under bf16 autocast
    the row-parallel matmuls' outputs are bf16, and under SP so are the gradients flowing back
    into them and out of the column-parallel matmuls' (bf16) inputs: those messages are 2 bytes
    an element; the rest (norm outputs, the embedding, the loss) stays at act_bytes.
    rank: the calls of that pipeline rank as the course's runtime makes them (its own blocks,
    the end it holds, one all-reduce repeated per recomputed block), priced as made: the
    step-time model's reading on a measured table. None: rank 0's calls, priced as above."""
    if dims.tp == 1:
        return []
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    if rank is not None:  # that rank's blocks and ends, priced as the runtime calls them
        held = layers_per_rank(base.n_layer, dims.pp, dims.virtual_stages)[_pipeline_rank(rank, dims.pp)]
        own = (held, int(rank == 0), int(rank == dims.pp - 1))
    s //= getattr(dims, "cp", 1)  # context parallelism: a rank's tokens of each sequence
    R = dims.replicas * getattr(dims, "cp", 1)  # every cp rank of a replica does this on its tokens
    L, m, n, full = base.n_layer, dims.microbatches, dims.tp, int(dims.recompute == "full")
    M = mb * s * base.d_model * act_bytes
    Mb = mb * s * base.d_model * 2 if dims.precision == "bf16" else M
    megatron = "full recomputation priced as Megatron's, both of a block's; the runtime's checkpoint repeats one" \
        if full else ""
    ends = "the busiest rank priced as holding both ends" if dims.pp > 1 else ""

    def rec(what, op, size, count, priced=None, why="", measured_only=False):
        """count(l, a, z): calls per micro-batch of a rank holding l blocks, the first stage (a)
        and the last (z). Rank 0 holds the first; the step-time model prices l0 blocks and both
        ends; the world's bytes sum one copy of the L blocks and both ends per replica and tp rank."""
        sent = size // n if op == "all_gather" else size  # SP: tp divides the sequence
        calls, model = m * count(l0, 1, int(dims.pp == 1)), m * (priced or count)(l0, 1, 1)
        if rank is not None:
            calls = model = m * count(*own)
        return Collective("tp", what, op, size, n, calls, R * n * m * count(L, 1, 1) * sent,
                          None if model == calls else model, "" if model == calls else why or ends,
                          measured_only=measured_only)

    loss = rec("the vocabulary-parallel loss: max, sum, target", "all_reduce", mb * s * 4, lambda l, a, z: 3 * z)
    if not dims.sequence_parallel:
        return [rec("g after attn.proj and mlp.proj", "all_reduce", Mb, lambda l, a, z: (2 + full) * l,
                    lambda l, a, z: (2 + 2 * full) * l, megatron),
                rec("f before qkv, fc and the head; g after the embedding", "all_reduce", M,
                    lambda l, a, z: 2 * l + a + z),
                loss]
    # backward all-reduces of replicated gradients that saw one shard: per block 2 norms (+ their
    # biases and the 2 row-parallel biases), the final norm, the position table (a GPT's)
    b, d_e = int(getattr(base, "bias", False)), base.d_model * act_bytes
    pos = param_breakdown(base)["position"] * act_bytes
    small0 = l0 * (2 + 4 * b) + (1 + b) * (dims.pp == 1) + (pos > 0)
    if rank is not None:  # the final norm on the last stage, the position table on the first
        small0 = own[0] * (2 + 4 * b) + (1 + b) * own[2] + (pos > 0) * own[1]
    small_bytes = (L * (2 + 4 * b) + 1 + b) * d_e + pos
    return [
        rec("all-gathers into qkv, fc and the head, and of the embedding's output gradient", "all_gather", M,
            lambda l, a, z: (2 + 2 * full) * l + a + z),
        rec("all-gathers of the gradients of attn.proj's and mlp.proj's reduce-scatters", "all_gather", Mb,
            lambda l, a, z: 2 * l),
        rec("re-gathers of the saved sequence shards in backward", "all_gather", M, lambda l, a, z: 2 * l + z,
            measured_only=True),
        rec("reduce-scatters out of attn.proj and mlp.proj", "reduce_scatter", Mb, lambda l, a, z: (2 + full) * l,
            lambda l, a, z: (2 + 2 * full) * l, megatron),
        rec("reduce-scatter out of the embedding", "reduce_scatter", M, lambda l, a, z: a),
        rec("reduce-scatters of the input gradients of qkv, fc and the head", "reduce_scatter", Mb,
            lambda l, a, z: 2 * l + z),
        Collective("tp", "gradients of the replicated norms, row-parallel biases and the position table",
                   "all_reduce", d_e, n, m * small0, R * n * m * small_bytes, measured_only=True),
        loss]


def pp_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
               grad_bytes: int | None = None) -> list[Collective]:
    """The pipeline's point-to-point messages (module docstring)."""
    if dims.pp == 1:
        return []
    base, s, mb, _ = _shape(config, dims, batch_size, seq)
    s //= getattr(dims, "cp", 1)  # context parallelism: a rank's tokens of each sequence
    m, v, n, R = dims.microbatches, dims.virtual_stages, dims.tp, dims.replicas * getattr(dims, "cp", 1)
    # sequence parallelism sends each tp rank's shard of the sequence (Megatron; the runtime's stage.sequence_shards)
    M = mb * s * base.d_model * act_bytes // (n if dims.sequence_parallel else 1)
    # rank 0: v activations sent and v gradients received per micro-batch, and 2 (v - 1) more
    # (its later chunks both receive and send): the step-time model prices a boundary crossing once
    out = [Collective("pp", "activations forward, gradients backward", "send", M, 2, m * (4 * v - 2),
                      R * n * m * 2 * (dims.pp * v - 1) * M, 2 * v * m,
                      "each chunk boundary priced once per direction (the interleaved schedule's v times 1F1B's)"
                      if v > 1 else "")]
    if getattr(base, "tie_weights", False):
        rows = -(-base.vocab_size // n)
        g = rows * base.d_model * (act_bytes if grad_bytes is None else grad_bytes)
        out.append(Collective("pp", "the tied embedding's gradient between the end stages", "send", g, 2, 2,
                              R * n * 2 * g))
    out.append(Collective("pp", "the loss, broadcast from the last stage", "broadcast", 4, dims.pp, 1, R * n * 4,
                          report=True))
    return out


def ep_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
               grad_bytes: int | None = None) -> list[Collective]:
    """Expert parallelism's all-to-alls and its average of the dense gradients (module docstring)."""
    if dims.ep == 1:
        return []
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    s //= getattr(dims, "cp", 1)  # context parallelism: a rank's tokens of each sequence
    _, n_experts, top_k = unpack(config)
    L, m, n, R = base.n_layer, dims.microbatches, dims.ep, dims.replicas * getattr(dims, "cp", 1)
    rows = mb * s * top_k * base.d_model * act_bytes  # one micro-batch's routed rows, every rank sends all
    dense = (dense_params(config) + (padded_vocab(config, dims.tp) * base.d_model
                                     if dims.pp > 1 and getattr(base, "tie_weights", False) else 0))
    g = act_bytes if grad_bytes is None else grad_bytes
    return [
        Collective("ep", "dispatch and combine, forward and backward", "all_to_all", rows, n, 4 * l0 * m,
                   R * 4 * L * m * rows),
        Collective("ep", "the routing counts", "all_to_all", n_experts * 8, n, l0 * m, R * L * m * n_experts * 8, 0,
                   "left out by the step-time model: E numbers"),
        Collective("ep", "the dense gradients averaged over ep", "all_reduce", dense * g / dims.pp, n, 1,
                   R * dense * g, 0, "priced by the step-time model with dp's, over dp*ep replicas"),
        Collective("ep", "the loss averaged over ep", "all_reduce", 8, n, 1, 8 * dims.world_size, report=True)]


def dp_traffic(config, dims, batch_size: int, seq: int | None = None, local_params: int = 0,
               grad_bytes: int = 4, param_bytes: int | None = None) -> list[Collective]:
    """Data parallelism's (and ZeRO's) collectives. The step-time model prices the gradients of
    `local_params` (the busiest rank's, per_gpu_memory's) over dp * ep replicas (the experts'
    really over dp alone); world_bytes counts every rank's flat shards exactly
    (replica_group_params), over dp. With dp = 1 and ep > 1 nothing crosses a dp group: the
    records are the model's price of EP's dense average (calls 0)."""
    cp = getattr(dims, "cp", 1)  # cp ranks hold whole weights: the gradients are reduced over dp * ep * cp
    replicas = dims.replicas * cp
    if replicas == 1:
        return []
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    m, dp, pb = dims.microbatches, dims.dp * cp, grad_bytes if param_bytes is None else param_bytes
    grads, params, world = local_params * grad_bytes, local_params * pb, dims.world_size
    psi = replica_group_params(config, dims)  # the parameters of one data-parallel copy
    composed = dims.tp > 1 or dims.pp > 1 or dims.ep > 1 or cp > 1
    if dims.zero >= 2 and composed:  # reduced once per step (course_lib.parallel.hybrid.zero_pp)
        out = _composed_zero(config, dims, local_params, grad_bytes, pb)
    # the ZeRO engine (one all-reduce per parameter group) wherever the runtime composes
    elif dims.zero == 0 and composed:
        out = [Collective("dp", "all-reduce of the gradients (both groups' bytes)", "all_reduce", grads, replicas, 1,
                          dp * psi * grad_bytes),
               Collective("dp", "all-reduce of the second group (norms, biases)", "all_reduce", 0, replicas, 1, 0,
                          why="its bytes are counted with the first; priced at its latency")]
    elif dims.zero == 0:  # plain data parallelism: DDP's buckets
        out = [Collective("dp", f"DDP's bucket {i}", "all_reduce", size, replicas, 1, dp * psi * grad_bytes * size / grads)
               for i, size in enumerate(ddp_buckets(grads))]
    elif dims.zero == 1:
        out = [Collective("dp", "reduce-scatter of the gradients", "reduce_scatter", grads, replicas, 1,
                          dp * psi * grad_bytes),
               Collective("dp", "all-gather of the updated shards", "all_gather", params, replicas, 1, psi * pb)]
    elif dims.zero == 2:  # every rank taken as rank 0: the runtime composes stages 0 and 1 only
        out = [Collective("dp", "reduce-scatter of the gradients, every micro-batch", "reduce_scatter", grads,
                          replicas, m, world * m * grads),
               Collective("dp", "all-gather of the updated shards", "all_gather", params, replicas, 1,
                          world * params / replicas)]
    else:  # per micro-batch each block gathered in forward and again in backward, its gradient
        # scattered; the root (embeddings, norm, head) gathered once and kept until then
        u = l0 + 1
        out = [Collective("dp", "all-gathers of the blocks and the root", "all_gather", params / u, replicas,
                          m * (2 * l0 + 1), world * m * (2 * l0 + 1) * params / u / replicas),
               Collective("dp", "reduce-scatters of their gradients", "reduce_scatter", grads / u, replicas, m * u,
                          world * m * grads)]
    if dp == 1:
        return [replace(c, calls=0, world_bytes=0, priced=c.priced_calls, why="EP's dense average, priced as dp's")
                for c in out]
    return out + [Collective("dp", "the loss averaged over dp", "all_reduce", 8, dp, 1, 8 * world, report=True)]


def zero_pp_ops(config, dims, rank: int = 0, param_bytes: int = 4, grad_bytes: int = 4) -> dict[str, dict[str, int]]:
    """{op: {"calls", "bytes_sent"}} of one rank's ZeRO-2/3 collectives in one step when composed
    with pp / tp (what course_lib.observe.CommTracer counts on the dp group of a rank of pipeline
    rank `rank`). Its units P_u (per_gpu.zero_units), S_u = ceil(P_u / N) over N = dp*ep*cp ranks:

        reduce-scatter  once per unit and step (the gradient accumulated over the m micro-batches):
                        U calls, N sum_u S_u grad_bytes sent
        all-gather      zero 2: the updated shards, once per unit: U calls, sum_u S_u param_bytes
                        zero 3, reshard_after_forward=True: each unit gathered before every
                        micro-batch's forward and again before its backward: 2 m U calls,
                        2 m sum_u S_u param_bytes; False: once, kept for the step: U, sum_u S_u
                        param_bytes. The ratio of the two policies is 2m, calls and bytes."""
    n = dims.dp * dims.ep * getattr(dims, "cp", 1)
    shards = [-(-p // n) for p in zero_units(config, dims, rank)]
    reshard = getattr(dims, "reshard_after_forward", True)
    gathers = 2 * dims.microbatches if dims.zero == 3 and reshard else 1
    return {"all_gather": {"calls": gathers * len(shards), "bytes_sent": gathers * sum(shards) * param_bytes},
            "reduce_scatter": {"calls": len(shards), "bytes_sent": n * sum(shards) * grad_bytes}}


def _composed_zero(config, dims, local_params, grad_bytes, param_bytes) -> list[Collective]:
    """dp_traffic's records for ZeRO-2/3 composed with pp / tp: rank 0's calls (zero_pp_ops),
    every rank's bytes (tp copies of each pipeline rank's, over its N dp ranks), priced as the
    busiest rank's average unit (local_params / U elements; rank 0's own when local_params is 0)."""
    n = dims.dp * dims.ep * getattr(dims, "cp", 1)
    ranks = [zero_pp_ops(config, dims, r, param_bytes, grad_bytes) for r in range(dims.pp)]
    units = ranks[0]["reduce_scatter"]["calls"]
    local = local_params or ranks[0]["reduce_scatter"]["bytes_sent"] / grad_bytes  # N sum_u S_u

    def world(op):
        return dims.tp * n * sum(r[op]["bytes_sent"] for r in ranks)
    policy = ("2m per unit: freed after each forward and backward" if getattr(dims, "reshard_after_forward", True)
              else "once per unit: kept for the step") if dims.zero == 3 else "the updated shards, once per unit"
    return [Collective("dp", f"all-gathers of the units ({policy})", "all_gather", local * param_bytes / units, n,
                       ranks[0]["all_gather"]["calls"], world("all_gather")),
            Collective("dp", "reduce-scatter of each unit's gradient, once per step", "reduce_scatter",
                       local * grad_bytes / units, n, units, world("reduce_scatter"))]


def norm_traffic(dims) -> list[Collective]:
    """The squared global norm, one all-reduce over the world, when any rank holds a part of
    the model another does not (plain data parallelism clips its identical copies alone)."""
    if dims.world_size == 1 or not (dims.zero or dims.tp > 1 or dims.pp > 1 or dims.ep > 1):
        return []
    return [Collective("norm", "the squared global norm", "all_reduce", 8, dims.world_size, 1, 8 * dims.world_size)]


def cp_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4) -> list[Collective]:
    """Context parallelism's collectives: the attention of every block, per micro-batch, forward
    and backward (course_lib.parallel.cp.attention). Each of the cp ranks of a replica holds s/cp
    tokens of its mb sequences; C = mb (s/cp) kv e / tp is its keys (or values) of one micro-batch
    (kv the key/value width: d_model, or n_kv_head * d_head under grouped-query attention; tp
    splits the heads) and Q = mb (s/cp) d e / tp its queries. Per block and micro-batch, on every
    cp rank (dims.cp_method; the layout, contiguous or zig-zag, moves no byte):

        allgather  forward one all-gather of K||V (2C in, 2 cp C out); backward its gradient, one
                   reduce-scatter of dK||dV (2 cp C in)
        ring       forward cp-1 hops of K||V (2C), backward cp-1 hops of K||V again and cp hops of
                   the dK||dV accumulator (2C); a hop is a send and a receive (the tracer counts
                   both: the receives are a record of their own, with no bytes)
        ulysses    forward two all-to-alls, Q||K||V to head shards (Q + 2C) and the output back
                   (Q); backward their gradients (the same sizes)

    Full recomputation runs every block's forward again, its calls included. The gradients'
    average over the cp replicas (whole weights on every cp rank) is data parallelism's."""
    cp = getattr(dims, "cp", 1)
    if cp == 1:
        return []
    method = getattr(dims, "cp_method", "ring")
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    L, m, n, R = base.n_layer, dims.microbatches, dims.tp, dims.replicas
    C, Q = mb * (s // cp) * kv_dim(base) * act_bytes // n, mb * (s // cp) * base.d_model * act_bytes // n
    fwd = 1 + int(dims.recompute == "full")  # forwards per block and micro-batch

    def rec(what, op, nbytes, per_block, sent, group=cp, priced=None, why=""):
        """per_block calls per block and micro-batch on rank 0, `sent` bytes per call on every
        rank; the world's bytes over the L blocks of R replicas x tp x cp ranks."""
        return Collective("cp", what, op, nbytes, group, m * l0 * per_block, R * n * cp * m * L * per_block * sent,
                          priced, why)

    if method == "allgather":
        return [rec("all-gather of K||V (forward)", "all_gather", 2 * cp * C, fwd, 2 * C),
                rec("reduce-scatter of dK||dV (backward)", "reduce_scatter", 2 * cp * C, 1, 2 * cp * C)]
    if method == "ring":
        hops = (fwd + 1) * (cp - 1) + cp  # K||V forward (again when recomputed) and backward; dK||dV
        return [rec("K||V sent round the ring, forward and backward", "send", 2 * C, (fwd + 1) * (cp - 1), 2 * C, 2),
                rec("the dK||dV accumulators sent round the ring (backward)", "send", 2 * C, cp, 2 * C, 2),
                rec("the receives of those hops", "send", 0, hops, 0, 2, 0, "a receive: its bytes are its send's")]
    return [rec("all-to-alls of Q||K||V to head shards and of their gradients back", "all_to_all", Q + 2 * C,
                fwd + 1, Q + 2 * C),
            rec("all-to-alls of the output back to sequence shards and of its gradient", "all_to_all", Q,
                fwd + 1, Q)]


def step_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
                 grad_bytes: int | None = None, param_bytes: int | None = None,
                 local_params: int | None = None) -> dict[str, list[Collective]]:
    """{axis: its records} for every axis of `dims` (a course_lib.dims.ParallelDims); element
    sizes: act_bytes on the wire for activations, grad_bytes and param_bytes for the model state
    (default act_bytes). local_params: the busiest rank's parameters (default: the average
    rank's, replica_group_params / (pp * ep * tp))."""
    g = act_bytes if grad_bytes is None else grad_bytes
    if local_params is None:  # the average rank's
        local_params = replica_group_params(config, dims) / (dims.pp * dims.ep * dims.tp)
    return {"tp": tp_traffic(config, dims, batch_size, seq, act_bytes),
            "pp": pp_traffic(config, dims, batch_size, seq, act_bytes, g),
            "ep": ep_traffic(config, dims, batch_size, seq, act_bytes, g),
            "dp": dp_traffic(config, dims, batch_size, seq, local_params, g, param_bytes),
            "norm": norm_traffic(dims)} | ({"cp": cp_traffic(config, dims, batch_size, seq, act_bytes)}
                                           if getattr(dims, "cp", 1) > 1 else {})


# ----------------------------------------------------------------------------- reading a record
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
        "send": lambda n: 1.0, "broadcast": lambda n: 1.0}


def wire_bytes(c: Collective) -> float:
    """Bytes rank 0 puts on its link in one step for this record: ring all-reduce 2(n-1)/n S,
    ring all-gather / reduce-scatter and pairwise all-to-all (n-1)/n S, a message S, per call."""
    return 0.0 if c.group <= 1 else c.calls * WIRE[c.op](c.group) * c.nbytes


def seconds(c: Collective, link) -> float:
    """The step-time model's seconds of this record on `link` (a LinkModel or a measured
    CollectiveTable): priced calls, each collective_time(link, op, nbytes, group)."""
    if c.report or not c.priced_calls or (c.measured_only and not isinstance(link, CollectiveTable)):
        return 0.0
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
    return -(-unpack(config)[0].vocab_size // tp) * tp


def _dense_base(config):
    base = unpack(config)[0]
    return replace(base, n_experts=0) if getattr(base, "n_experts", 0) else base


def total_params(config) -> int:
    """Every parameter once; an MoE model: the dense count with each MLP replaced by
    n_experts MLPs and a router (d x E, no bias)."""
    base, experts, _ = unpack(config)
    if experts == 1:
        return param_count(config)
    dense = _dense_base(config)
    return param_count(dense) + base.n_layer * (param_breakdown(dense)["mlp"] * (experts - 1) + base.d_model * experts)


def dense_params(config) -> int:
    """Parameters outside the experts (all of them for a dense model)."""
    base, experts, _ = unpack(config)
    if experts == 1:
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
    and last stage differ, the vocabulary padding of tensor parallelism included."""
    base = unpack(config)[0]
    vpad, d, tied = padded_vocab(config, dims.tp), base.d_model, getattr(base, "tie_weights", False)
    n = total_params(config) + (vpad - base.vocab_size) * d * (1 if tied else 2)
    n += (dims.tp - 1) * tp_replicated_params(config) if dims.tp > 1 else 0
    n += (dims.ep - 1) * dense_params(config) + dims.ep * (vpad * d if dims.pp > 1 and tied else 0)
    return n
