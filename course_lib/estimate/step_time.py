"""The step-time model of one layout (notebook 11): compute + overhead + exposed communication + bubble.
(A little over 300 lines: the four terms share one reading of the layout and the cluster.)

A layout is the runtime's course_lib.dims.ParallelDims: n_gpus = dp * ep * cp * tp * pp ranks
(make_mesh's order: tp innermost, then cp, ep, dp, pp), m = microbatches micro-batches per
data-parallel replica. The global batch B = batch_size sequences of `seq` tokens is given beside
it, so each micro-batch holds micro_batch = B / (dp * ep * m) sequences. One optimizer step:

    compute     F / (n_gpus * R)                   F = flops_per_token * B * seq (notebook 01),
                                                   R = achievable FLOP/s of one device;
                                                   forward = F/3, backward = 2F/3
                recipe "fp8": (F - F8) / (n_gpus * R) + F8 / (n_gpus * R8), F8 the blocks' linear
                matmuls (fp8_flops_per_token; attention scores, router and head stay bf16), R8
                = cluster.achievable_fp8_flops (clusters.gpu_cluster: 75% of the FP8 peak);
                KV heads copied at tp > n_kv_head: + 6 L C d B seq / (n_gpus * R), C the K and V
                rows held beyond one copy (params.kv_copy_rows: each copy multiplies too; not in F)
    overhead    (layers on the rank + 1) * m * c   c = cluster.layer_overhead: a layer's fixed
                                                   cost per micro-batch, whatever its size
    recompute   + forward again ("full") or + the attention scores' forward ("selective")
    tp          every layer, every micro-batch: 2 all-reduces forward, 2 backward (Megatron f, g;
                with sequence parallelism all-gather + reduce-scatter pairs, the same bytes,
                plus, on a measured table, the re-gathers in backward and the replicated
                parameters' flat all-reduce: course_lib.estimate.traffic's measured_only),
                plus the vocabulary-parallel embedding, head and loss; on the critical path,
                never hidden (the next matmul needs the result)
    pp          each micro-batch crosses each stage boundary as an activation and a gradient
    ep          2 all-to-alls forward and 2 backward per MoE layer
    cp          context parallelism (n_gpus then counts dp * ep * cp * tp * pp): every rank
                computes T/cp tokens, and under a causal mask the busiest rank's attention is
                attention_imbalance times an even share (1 with zig-zag chunks); all-gather
                and Ulysses collectives are priced whole (nothing overlaps them in the course's
                runtime); the ring only where its hops outlast the attention of a block pair
                (course_lib.estimate.context.ring_exposed), per layer and micro-batch
    bubble      busy * f / (1 - f), f = the schedule's bubble fraction (course_lib.estimate.bubble);
                ranks sharing fewer CPU cores lose only the part no other rank can use
    dp          the gradient all-reduce in DDP's buckets (ZeRO-1: reduce-scatter + all-gather;
                ZeRO-2: the reduce-scatter in every micro-batch; ZeRO-3: per block, 2 all-gathers
                and a reduce-scatter; composed with pp / tp, ZeRO-2/3 reduce once per step and
                stage 3 gathers each unit 2m times, or once without reshard_after_forward, its
                all-gathers exposed: traffic.zero_pp_ops), overlapped with backward: only
                max(0, T_dp - overlap * T_backward / m) is exposed (the gradients are final
                only during the last micro-batch's backward)
                gather_dtype="fp8" (zero=3): the parameter all-gathers at 1 byte per parameter
                (course_lib.parallel.zero.fp8_gather; its N 4-byte scales per gather left out)
    optimizer   tensors * cluster.tensor_overhead + bytes the update touches / memory bandwidth
                (AdamW reads and writes the weights, gradients and both moments of the
                parameters this rank owns; a per-tensor loop, or flat shards under ZeRO)

The tp, pp, ep, dp terms and the norm's all-reduce are sums over each axis's records
(course_lib.estimate.traffic, the traffic model notebook 10's byte accounting reads too): a
record's priced calls, each costed by course_lib.comm.measured.collective_time on the link its
group crosses, placed as make_mesh places it (course_lib.dims.link_of, notebook 10): the node's
link (`intra`) when the whole group sits on one node, else the network (`inter`). A link is an
alpha-beta LinkModel (T = a alpha + b S / beta, ring algorithms) or a table measured on the
machine at hand (CollectiveTable). The records' calls are the course's own implementations' on
rank 0, so the tracer checks them (step_time(...)["calls"], the trainer's loss log left out).
On a measured table (the course's runtime runs the layout) tensor parallelism is priced on the
pipeline rank whose calls cost the most, counted as that rank makes them (busiest_tp_rank);
a published cluster prices Megatron's: the busiest rank's blocks with both ends, and both of a
recomputed block's all-reduces.
"""

from __future__ import annotations

from dataclasses import replace

from course_lib._validate import check_int, check_one_of
from course_lib.dims import ParallelDims, layers_per_rank
from course_lib.comm.measured import CollectiveTable, collective_time
from course_lib.estimate.bubble import formula_for
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.compute import flops_per_token
from course_lib.estimate.context import attention_imbalance, ring_exposed
from course_lib.estimate.memory import RECIPES
from course_lib.estimate.params import GPTConfig, kv_copy_rows, model_shape, param_breakdown
from course_lib.estimate.per_gpu import FSDP_UNITS, composed_zero_memory, gpu_memory, zero_units
from course_lib.estimate.traffic import (ddp_buckets, seconds, step_traffic,  # noqa: F401 (ddp_buckets: re-exported)
                                          tp_traffic)


def check_layout(config, dims: ParallelDims, batch_size: int, seq: int | None = None) -> tuple[int, int]:
    """ValueError unless the layout `dims` can run `config` on a global batch of batch_size
    sequences; returns (seq, micro_batch). The rule book itself (ParallelDims.check_model, on the
    model's ModelShape), once: what the estimator's entry points check before costing, and
    nothing on the way re-checks it."""
    if not isinstance(dims, ParallelDims):
        raise ValueError(f"dims={dims!r} must be a course_lib.dims.ParallelDims")
    shape = model_shape(config)
    seq = shape.block_size if seq is None else check_int("seq", seq)
    if seq > shape.block_size:
        raise ValueError(f"seq={seq} must be <= block_size={shape.block_size}")
    dims.check_model(shape, batch_size, seq)
    return seq, batch_size // (dims.replicas * dims.microbatches)


def composed(dims) -> bool:
    """Whether the runtime composes data parallelism with another dimension (course_lib.parallel.
    hybrid): ZeRO-2 and 3 then reduce once per step (course_lib.parallel.hybrid.zero_pp)."""
    return dims.world_size > dims.dp  # an axis other than dp above 1


def memory_per_rank(config, dims: ParallelDims, batch_size: int, seq: int | None = None,
                    recipe: str = "bf16_mixed", attention: str | None = None, fsdp_unit: str = "chunk") -> dict:
    """notebook 01's per_gpu_memory for this layout, with the in-flight micro-batches of the
    schedule: 1F1B holds min(m, pp) on stage 0 (per_gpu_memory's assumption), GPipe all m,
    interleaving (1 + (pp - 1) / (pp * v)) times 1F1B's (Narayanan et al. 2021).
    ZeRO-2 and 3 composed with pp / tp (course_lib.estimate.per_gpu.composed_zero_memory, on the
    busiest stage): the gradient accumulated unsharded over the step's micro-batches, stage 3's
    gathered parameters ("gathered": one chunk, or block with fsdp_unit="block", with
    dims.reshard_after_forward; the rank's whole stage without), and "between_steps": the shards
    held between steps; total = params + grads + optimizer + gathered + activations."""
    seq, micro_batch = check_layout(config, dims, batch_size, seq)
    return _memory_per_rank(config, dims, seq, micro_batch, recipe, attention, fsdp_unit)


def _memory_per_rank(config, dims: ParallelDims, seq: int, micro_batch: int, recipe: str = "bf16_mixed",
                     attention: str | None = None, fsdp_unit: str = "chunk") -> dict:
    """memory_per_rank of a layout check_layout has passed (seq, micro_batch: its answer)."""
    check_one_of("fsdp_unit", fsdp_unit, FSDP_UNITS)
    L, m, v = dims, dims.microbatches, dims.virtual_stages
    mem = gpu_memory(L, model_shape(config), micro_batch, seq, recipe, attention=attention)
    if L.pp > 1:
        # 1F1B and ZB-H1 hold min(m, pp) micro-batches on stage 0: all of them when m < pp
        factor = {"gpipe": m / L.pp, "interleaved_1f1b": 1 + (L.pp - 1) / (L.pp * v)}.get(
            L.schedule, min(m, L.pp) / L.pp)
        mem["activations"] = int(mem["activations"] * factor)
        mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
    if L.zero >= 2 and composed(L):
        mem.update(composed_zero_memory(config, L, recipe, mem["stage"], fsdp_unit))
        mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + mem["gathered"] + mem["activations"]
    return mem


def parameter_tensors(config, ep: int = 1) -> tuple[int, int]:
    """(tensors per block on a rank, tensors outside the blocks): what a per-tensor optimizer
    loops over. A course GPT block: two LayerNorms, qkv and proj, fc and proj (each with a
    bias when config.bias); an MoE block a router and E/ep experts of fc and proj instead of
    the MLP; outside: token and position embeddings, the final norm (and an untied head)."""
    shape = model_shape(config)
    base, n_experts = shape.base, shape.n_experts  # 0: dense
    if not isinstance(base, GPTConfig):  # Llama-like: 2 RMSNorms, q k v o, gate up down
        return 2 + 4 + (1 + 3 * n_experts // ep if n_experts else 3), 2 + (0 if getattr(base, "tie_weights", False) else 1)
    per = 2 if base.bias else 1
    mlp = 1 + 2 * per * (n_experts // ep) if n_experts else 2 * per
    return 2 * per + 2 * per + mlp, 2 + per + (0 if base.tie_weights else 1)


def fp8_flops_per_token(config) -> float:
    """Training FLOPs per token of the matmuls apply_fp8 runs in FP8: the blocks' linears,
    3 * 2 * n_layer * (attention matrices + top_k MLP matrices) (flops_per_token's N_mm without
    the router and the head, which stay in bf16, and without the attention scores)."""
    shape = model_shape(config)
    base, top_k = shape.base, shape.top_k
    p = param_breakdown(config)
    d, f = base.d_model, (base.ff_dim if isinstance(base, GPTConfig) else base.d_ff)
    attn_mm, mlp_mm = (4 * d * d, 2 * d * f) if isinstance(base, GPTConfig) else (p["attention"], p["mlp"])
    return 6.0 * base.n_layer * (attn_mm + top_k * mlp_mm)


def fp8_rate(cluster) -> float:
    """The cluster's achievable FP8 matmul rate; ValueError when it has none (A100, CPU ranks)."""
    rate = getattr(cluster, "achievable_fp8_flops", 0.0)
    if not rate > 0:
        raise ValueError(f"recipe='fp8' needs a cluster with an FP8 matmul rate (achievable_fp8_flops > 0, "
                         f"e.g. clusters.gpu_cluster('H100 SXM 80 GB', n)); {cluster.name!r} has none")
    return rate


CHECK_BYTES = 8 * 8  # course_lib.observe.checks' fingerprint: 8 int64 per rank


def check_seconds(records, link) -> float:
    """Seconds of the collective checks (course_lib.observe.checks) before `records`' calls: one
    all-gather of CHECK_BYTES per rank before every collective the step prices, as many times as
    it prices the call (the busiest rank's count: a pipeline's last stage also makes the head's
    and the loss's calls). Point-to-point sends are not checked; the loss log is outside the step."""
    return sum(r.priced_calls * collective_time(link, "all_gather", CHECK_BYTES * r.group, r.group)
               for r in records if r.op != "send" and seconds(r, link))


def busiest_tp_rank(config, dims: ParallelDims, batch_size: int, seq: int, act_bytes: int, link,
                    checked_collectives: bool = False) -> list:
    """Tensor parallelism's records on a measured table (the course's own runtime): the calls of
    the pipeline rank whose tp collectives (and their checks) cost the most, counted as that rank
    makes them (traffic.tp_traffic's rank). A published cluster prices Megatron's instead: l0
    blocks and both ends on one rank, both of a recomputed block's all-reduces."""
    def cost(records):
        return sum(seconds(r, link) for r in records) + (check_seconds(records, link) if checked_collectives else 0.0)

    return max((tp_traffic(config, dims, batch_size, seq, act_bytes, rank=r) for r in range(dims.pp)), key=cost)


def step_time(config, dims: ParallelDims, cluster: Cluster, batch_size: int, seq: int | None = None,
              recipe: str = "bf16_mixed", attention: str | None = None, causal: bool = False,
              gather_dtype: str | None = None, checked_collectives: bool = False) -> dict:
    """Seconds of one optimizer step by term (see the module docstring) and the totals:
    {"compute", "overhead", "recompute", "tp", "pp", "ep", "bubble", "dp_total", "dp_exposed",
    "optimizer", "total", "flops" (model FLOPs of the step, recomputation excluded), "mfu",
    "tokens", "calls" (collective calls of the busiest rank per step, by mesh dimension)}.
    mfu is against cluster.peak_flops (bf16's peak) whatever the recipe, so an fp8 run can pass
    what bf16 could reach. gather_dtype="fp8" needs dims.zero == 3 (module docstring).
    checked_collectives: the ranks run course_lib.observe.checks (run_on_ranks' default): each
    collective is preceded by an all-gather of a CHECK_BYTES fingerprint per rank, priced on the
    same link as "checks"."""
    seq, micro_batch = check_layout(config, dims, batch_size, seq)
    return _step_time(config, dims, cluster, batch_size, seq, micro_batch, recipe, attention, causal, gather_dtype,
                      checked_collectives)


def _step_time(config, dims: ParallelDims, cluster: Cluster, batch_size: int, seq: int, micro_batch: int,
               recipe: str = "bf16_mixed", attention: str | None = None, causal: bool = False,
               gather_dtype: str | None = None, checked_collectives: bool = False) -> dict:
    """step_time of a layout check_layout has passed (seq, micro_batch: its answer)."""
    check_one_of("recipe", recipe, RECIPES)
    check_one_of("gather_dtype", gather_dtype, (None, "fp8"))
    if gather_dtype == "fp8" and dims.zero != 3:
        raise ValueError(f"gather_dtype='fp8' needs zero=3 (only stage 3 gathers parameters before using them), "
                         f"got zero={dims.zero}")
    L, C = dims, cluster
    n_gpus, m, v = L.world_size, L.microbatches, L.virtual_stages
    if n_gpus > C.n_gpus:
        product = "dp*ep*cp*tp*pp" if L.cp > 1 else "dp*ep*tp*pp"
        raise ValueError(f"the layout needs {product} = {n_gpus} devices, the cluster has n_gpus={C.n_gpus}")
    base = model_shape(config).base
    e = 4 if recipe in ("fp32", "bf16_autocast") else 2  # bytes of an activation / gradient on the wire
    batch = batch_size
    tokens = batch * seq
    flops = flops_per_token(config, seq, causal=causal) * tokens
    rate, layer_overhead = C.rates(recipe)  # measured in this precision where calibrated in it
    compute = flops / (n_gpus * rate)
    if recipe == "fp8":  # the blocks' linears at the FP8 rate, the rest at bf16's
        f8 = fp8_flops_per_token(config) * tokens
        compute = (flops - f8) / (n_gpus * rate) + f8 / (n_gpus * fp8_rate(C))
    if copied := kv_copy_rows(config, L.tp):  # KV heads copied at tp > n_kv_head: every copy's K, V matmuls run
        compute += 3 * 2 * base.n_layer * copied * base.d_model * tokens / (n_gpus * rate)
    if causal:  # the busiest cp rank's causal attention: imbalance x an even share (cp = 1: x 1, nothing added)
        attn = 3 * 4 * base.n_layer * seq * base.d_model * 0.5 * tokens  # flops_per_token's causal term
        compute += attn * (attention_imbalance(seq, L.cp, L.cp_load_balance) - 1) / (n_gpus * rate)
    layers = max(layers_per_rank(base.n_layer, L.pp, v))  # the busiest rank's, over its v chunks
    # fixed cost: every layer's ops (and the embedding, head and loss: one layer's worth on the
    # busiest end rank) once per micro-batch, whatever their size
    overhead = (layers + 1) * m * layer_overhead
    attn_fraction = 4 * base.n_layer * seq * base.d_model * (0.5 if causal else 1.0) / (
        flops_per_token(config, seq, causal=causal, training=False))
    recompute = {"none": 0.0, "full": (compute + overhead) / 3,
                 "selective": compute / 3 * attn_fraction}[L.recompute]
    # the collectives: each mesh axis's records (course_lib.estimate.traffic, the model notebook
    # 09's byte accounting reads too), priced on the link the axis's group crosses (make_mesh's
    # placement); `calls` what the tracer counts on rank 0, the trainer's loss log left out.
    # tp: per layer and micro-batch 2 all-reduces forward, 2 backward (Megatron's g and f), the
    # embedding's and the head's, the loss's 3; under full recomputation Megatron's 2 more per
    # layer (the course's torch checkpoint repeats 1: an upper bound there); sequence
    # parallelism prices all-gathers and reduce-scatters in place of the all-reduces and, on a
    # measured table, every call the course's runtime makes: the re-gathers of saved shards in
    # backward, the flat all-reduce of the replicated parameters' gradients (one call per
    # micro-batch's backward, as Megatron batches them; one per parameter cost a call's fixed
    # time each, which rules a CPU link).
    # pp: an activation forward and a gradient backward per micro-batch and chunk boundary, the
    # tied embedding's gradient between the end stages. ep: 2 all-to-alls forward and 2 backward
    # of top_k copies of each token per MoE layer. dp: the gradients of the parameters this rank
    # holds, over dp*ep*cp ranks (experts: dp*cp): DDP's buckets, or the ZeRO engine's one all-reduce
    # per parameter group (a composed layout), ZeRO-1 reduce-scatter + all-gather, ZeRO-2 the
    # reduce-scatter every micro-batch, ZeRO-3 per block 2 all-gathers and a reduce-scatter per
    # micro-batch (the root once). norm: the global norm's all-reduce, over the whole world.
    # the parameters of the stage per_gpu_memory's defaults find busiest (no recomputation,
    # sequence parallelism with tp, the ring): the rank whose gradients and updates are priced
    busiest = replace(L, recompute="none", sequence_parallel=L.tp > 1, cp_method="ring")
    local = gpu_memory(busiest, model_shape(config), micro_batch, seq, recipe)["params_on_gpu"]
    param_bytes = 1 if gather_dtype == "fp8" else RECIPES[recipe].param  # what ZeRO's all-gathers carry
    traffic = step_traffic(config, L, batch_size, seq, e, RECIPES[recipe].grad, param_bytes, local)
    term, calls, checks = {}, {}, 0.0
    for axis, records in traffic.items():
        if axis == "norm":
            link = C.intra if n_gpus <= C.gpus_per_node else C.inter
        else:
            link = C.link_of(axis, L) if records else None
        calls[axis] = sum(r.calls for r in records if not r.report)
        if axis == "tp" and isinstance(link, CollectiveTable):  # the course's runtime, as it runs
            records = busiest_tp_rank(config, L, batch_size, seq, e, link, checked_collectives)
        term[axis] = sum(seconds(r, link) for r in records)
        if checked_collectives:
            checks += check_seconds(records, link)
    tp, pp, ep = term["tp"], term["pp"], term["ep"]
    cp_total = cp = term.get("cp", 0.0)
    if L.cp_method == "ring":  # the hops' sends priced where compute does not cover them (cp = 1: none)
        ring = ring_exposed(config, L, micro_batch, seq, C.link_of("cp", L), rate, e, causal)
        repeats = 2 if L.recompute == "full" else 1  # full recomputation runs the forward ring again
        cp = layers * m * (repeats * ring["forward"] + ring["backward"]) + sum(
            seconds(r, C.link_of("cp", L)) for r in traffic.get("cp", []) if r.op != "send")
    busy = compute + overhead + recompute + tp + pp + ep + cp
    bubble = 0.0
    if L.pp > 1:
        f = formula_for(L.schedule, L.pp, m, v)
        # a device per rank: busy / (1 - f) in all. Ranks sharing fewer cores: busy was measured
        # with every rank running; alone a rank runs n / cores times faster, and the step
        # cannot end before all the work is done on the cores (busy)
        share = min(1.0, C.shared_cores / n_gpus) if C.shared_cores else 1.0
        bubble = max(0.0, busy * share / (1 - f) - busy)

    dp_total = term["dp"]
    replicas, units = L.dp * L.ep * L.cp, layers + 1  # ZeRO shards over every rank holding these weights
    # gradients are final only in the last micro-batch's backward, so only that one hides them
    hidden_by = C.overlap * (2 / 3) * compute / m
    dp_exposed = max(0.0, dp_total - hidden_by)
    if L.zero == 3 and composed(L):  # a unit's all-gather blocks the forward (or backward) that needs it:
        # the composed engine gathers on demand, no prefetch; the reduce-scatters hide as before
        link = C.link_of("dp", L) if traffic["dp"] else None
        gathers = sum(seconds(r, link) for r in traffic["dp"] if r.op == "all_gather")
        dp_exposed = gathers + max(0.0, dp_total - gathers - hidden_by)
    owned = local if L.zero == 0 else -(-local // replicas)
    # the update: a per-tensor loop over this rank's tensors (ZeRO: over flat shards, one per
    # parameter group, or one per unit at stage 3), plus reading and writing its state
    per_block, outside = parameter_tensors(config, L.ep)
    tensors = per_block * layers + outside if L.zero == 0 else (units if L.zero == 3 else 2)
    if L.zero >= 2 and composed(L):  # the composed engine's flat units (per_gpu.zero_units)
        tensors = len(zero_units(config, L))
    optimizer = tensors * C.tensor_overhead + owned * 2 * RECIPES[recipe].total / C.memory_bandwidth
    if traffic["norm"]:  # the global norm's all-reduce
        optimizer += term["norm"]
    total = busy + bubble + dp_exposed + optimizer + checks
    return {"compute": compute, "overhead": overhead, "recompute": recompute, "tp": tp, "cp": cp, "checks": checks,
            "cp_total": cp_total, "pp": pp, "ep": ep,
            "bubble": bubble, "dp_total": dp_total, "dp_exposed": dp_exposed, "optimizer": optimizer,
            "total": total, "flops": flops, "tokens": tokens, "batch": batch, "calls": calls,
            "mfu": flops / (total * n_gpus * C.peak_flops)}


TERMS = ("compute", "overhead", "recompute", "tp", "pp", "ep", "bubble", "dp_exposed", "optimizer")
# with context parallelism's exposed traffic: TERMS stays the list notebook 11 prints
ALL_TERMS = ("compute", "overhead", "recompute", "tp", "cp", "pp", "ep", "bubble", "dp_exposed", "optimizer",
             "checks")
