"""The step-time model of one layout (notebook 10): compute + overhead + exposed communication + bubble.

A layout is the runtime's course_lib.dims.ParallelDims: n_gpus = dp * ep * tp * pp ranks
(make_mesh's order: tp innermost, then ep, dp, pp), m = microbatches micro-batches per
data-parallel replica. The global batch B = batch_size sequences of `seq` tokens is given beside
it, so each micro-batch holds micro_batch = B / (dp * ep * m) sequences. One optimizer step:

    compute     F / (n_gpus * R)                   F = flops_per_token * B * seq (notebook 01),
                                                   R = achievable FLOP/s of one device;
                                                   forward = F/3, backward = 2F/3
    overhead    (layers on the rank + 1) * m * c   c = cluster.layer_overhead: a layer's fixed
                                                   cost per micro-batch, whatever its size
    recompute   + forward again ("full") or + the attention scores' forward ("selective")
    tp          every layer, every micro-batch: 2 all-reduces forward, 2 backward (Megatron f, g;
                with sequence parallelism all-gather + reduce-scatter pairs, the same bytes),
                plus the vocabulary-parallel embedding, head and loss; on the critical path,
                never hidden (the next matmul needs the result)
    pp          each micro-batch crosses each stage boundary as an activation and a gradient
    ep          2 all-to-alls forward and 2 backward per MoE layer
    bubble      busy * f / (1 - f), f = the schedule's bubble fraction (course_lib.estimate.bubble);
                ranks sharing fewer CPU cores lose only the part no other rank can use
    dp          the gradient all-reduce in DDP's buckets (ZeRO-1: reduce-scatter + all-gather;
                ZeRO-2: the reduce-scatter in every micro-batch; ZeRO-3: per block, 2 all-gathers
                and a reduce-scatter), overlapped with backward: only
                max(0, T_dp - overlap * T_backward / m) is exposed (the gradients are final
                only during the last micro-batch's backward)
    optimizer   tensors * cluster.tensor_overhead + bytes the update touches / memory bandwidth
                (AdamW reads and writes the weights, gradients and both moments of the
                parameters this rank owns; a per-tensor loop, or flat shards under ZeRO)

Every collective is costed by course_lib.comm.measured.collective_time on the link its group
crosses, placed as make_mesh places it (course_lib.dims.link_of, notebook 09):
the node's link (`intra`) when the whole group sits on one node, else the network (`inter`).
A link is an alpha-beta LinkModel (T = a alpha + b S / beta, ring algorithms) or a table
measured on the machine at hand (CollectiveTable). The counts of calls follow the course's own
implementations, so the tracer can check them (step_time(...)["calls"]).
"""

from __future__ import annotations

from course_lib._validate import check_int, check_one_of
from course_lib.comm.measured import collective_time
from course_lib.dims import (RECOMPUTE, ZERO_STAGES, ParallelDims, check_batch, check_schedule,
                             check_sequence_parallel, layers_per_rank)
from course_lib.estimate.bubble import formula_for
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.compute import flops_per_token
from course_lib.estimate.memory import RECIPES
from course_lib.estimate.params import GPTConfig, unpack
from course_lib.estimate.per_gpu import per_gpu_memory


def check_layout(config, dims: ParallelDims, batch_size: int, seq: int | None = None) -> tuple[int, int]:
    """ValueError unless the layout `dims` can run `config` on a global batch of batch_size
    sequences; returns (seq, micro_batch). The rule book's rules (course_lib.dims), in
    ParallelDims.check_model's order, so both name the same broken rule first."""
    if not isinstance(dims, ParallelDims):
        raise ValueError(f"dims={dims!r} must be a course_lib.dims.ParallelDims")
    base = unpack(config)[0]
    seq = base.block_size if seq is None else check_int("seq", seq)
    if seq > base.block_size:
        raise ValueError(f"seq={seq} must be <= block_size={base.block_size}")
    for name in ("dp", "tp", "pp", "ep", "virtual_stages", "microbatches"):
        check_int(name, getattr(dims, name))
    check_one_of("zero", dims.zero, ZERO_STAGES)
    check_one_of("recompute", dims.recompute, RECOMPUTE)
    check_schedule(dims.schedule, dims.pp, dims.microbatches, dims.virtual_stages)
    check_sequence_parallel(dims.sequence_parallel, dims.tp)
    # every chunk at least one block (uneven splits run and are costed by their busiest rank);
    # the sequence shared whole by sequence parallelism; per_gpu_memory checks tp against heads
    # and d_ff, ep against the experts
    layers_per_rank(base.n_layer, dims.pp, dims.virtual_stages)
    check_sequence_parallel(dims.sequence_parallel, dims.tp, seq)
    per_gpu_memory(config, 1, seq, "fp32", 0, dims.dp, dims.tp, dims.pp, dims.ep)
    share = check_batch(batch_size, dims.replicas, dims.microbatches)
    return seq, share // dims.microbatches


def memory_per_rank(config, dims: ParallelDims, batch_size: int, seq: int | None = None,
                    recipe: str = "bf16_mixed", attention: str | None = None) -> dict:
    """notebook 01's per_gpu_memory for this layout, with the in-flight micro-batches of the
    schedule: 1F1B holds min(m, pp) on stage 0 (per_gpu_memory's assumption), GPipe all m,
    interleaving (1 + (pp - 1) / (pp * v)) times 1F1B's (Narayanan et al. 2021)."""
    seq, micro_batch = check_layout(config, dims, batch_size, seq)
    L, m, v = dims, dims.microbatches, dims.virtual_stages
    mem = per_gpu_memory(config, micro_batch, seq, recipe, L.zero, L.dp, L.tp, L.pp, L.ep, L.recompute,
                         attention=attention, sequence_parallel=L.sequence_parallel)
    if L.pp > 1:
        # 1F1B and ZB-H1 hold min(m, pp) micro-batches on stage 0: all of them when m < pp
        factor = {"gpipe": m / L.pp, "interleaved_1f1b": 1 + (L.pp - 1) / (L.pp * v)}.get(
            L.schedule, min(m, L.pp) / L.pp)
        mem["activations"] = int(mem["activations"] * factor)
        mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
    return mem


def parameter_tensors(config, ep: int = 1) -> tuple[int, int]:
    """(tensors per block on a rank, tensors outside the blocks): what a per-tensor optimizer
    loops over. A course GPT block: two LayerNorms, qkv and proj, fc and proj (each with a
    bias when config.bias); an MoE block a router and E/ep experts of fc and proj instead of
    the MLP; outside: token and position embeddings, the final norm (and an untied head)."""
    base, n_experts, _ = unpack(config)
    if not isinstance(base, GPTConfig):  # Llama-like: 2 RMSNorms, q k v o, gate up down
        return 2 + 4 + (3 if n_experts == 1 else 1 + 3 * n_experts // ep), 2 + (0 if getattr(base, "tie_weights", False) else 1)
    per = 2 if base.bias else 1
    mlp = 2 * per if n_experts == 1 else 1 + 2 * per * (n_experts // ep)
    return 2 * per + 2 * per + mlp, 2 + per + (0 if base.tie_weights else 1)


def ddp_buckets(nbytes: float, first: float = 1 << 20, cap: float = 25 * (1 << 20)) -> list[float]:
    """The gradient all-reduces of DDP (course_lib.parallel.dp.ddp, torch's rule): a first
    bucket of 1 MiB, then buckets of up to 25 MiB."""
    sizes, left = [], float(nbytes)
    while left > 0:
        sizes.append(min(left, first if not sizes else cap))
        left -= sizes[-1]
    return sizes


def step_time(config, dims: ParallelDims, cluster: Cluster, batch_size: int, seq: int | None = None,
              recipe: str = "bf16_mixed", attention: str | None = None, causal: bool = False) -> dict:
    """Seconds of one optimizer step by term (see the module docstring) and the totals:
    {"compute", "overhead", "recompute", "tp", "pp", "ep", "bubble", "dp_total", "dp_exposed",
    "optimizer", "total", "flops" (model FLOPs of the step, recomputation excluded), "mfu",
    "tokens", "calls" (collective calls of the busiest rank per step, by mesh dimension)}."""
    seq, micro_batch = check_layout(config, dims, batch_size, seq)
    check_one_of("recipe", recipe, RECIPES)
    L, C = dims, cluster
    n_gpus, m, v = L.world_size, L.microbatches, L.virtual_stages
    if n_gpus > C.n_gpus:
        raise ValueError(f"the layout needs dp*ep*tp*pp = {n_gpus} devices, the cluster has n_gpus={C.n_gpus}")
    base, n_experts, top_k = unpack(config)
    e = 4 if recipe in ("fp32", "bf16_autocast") else 2  # bytes of an activation / gradient on the wire
    batch = batch_size
    tokens = batch * seq
    flops = flops_per_token(config, seq, causal=causal) * tokens
    compute = flops / (n_gpus * C.achievable_flops)
    layers = max(layers_per_rank(base.n_layer, L.pp, v))  # the busiest rank's, over its v chunks
    # fixed cost: every layer's ops (and the embedding, head and loss: one layer's worth on the
    # busiest end rank) once per micro-batch, whatever their size
    overhead = (layers + 1) * m * C.layer_overhead
    attn_fraction = 4 * base.n_layer * seq * base.d_model * (0.5 if causal else 1.0) / (
        flops_per_token(config, seq, causal=causal, training=False))
    recompute = {"none": 0.0, "full": (compute + overhead) / 3,
                 "selective": compute / 3 * attn_fraction}[L.recompute]
    calls = {"tp": 0, "pp": 0, "ep": 0, "dp": 0, "norm": 0}

    message = micro_batch * seq * base.d_model * e  # one residual-stream activation
    # tp, per micro-batch: per layer 2 all-reduces forward (after attention's and the MLP's
    # row-parallel matmul) and 2 backward (f's), +2 when the forward is recomputed (Megatron's
    # full recomputation; torch's non-reentrant checkpoint, which the capstone uses, stops once
    # the saved tensors are back and repeats only attention's: an upper bound there); the
    # vocabulary-parallel embedding (forward) and head input (backward): 2 more; with sequence
    # parallelism each all-reduce becomes an all-gather + a reduce-scatter of the same tensor
    tp = 0.0
    if L.tp > 1:
        tp_link = C.link_of("tp", L)
        n_ar = (4 + (2 if L.recompute == "full" else 0)) * layers + 2
        if L.sequence_parallel:
            one = (collective_time(tp_link, "all_gather", message, L.tp)
                   + collective_time(tp_link, "reduce_scatter", message, L.tp))
        else:
            one = collective_time(tp_link, "all_reduce", message, L.tp)
        # the vocabulary-parallel loss: 3 all-reduces of one number per token (max, sum, target)
        loss = 3 * collective_time(tp_link, "all_reduce", micro_batch * seq * 4, L.tp)
        tp = m * (n_ar * one + loss)
        calls["tp"] = m * (n_ar * (2 if L.sequence_parallel else 1) + 3)
    # pp: an activation forward and a gradient backward per micro-batch and chunk boundary
    # and, once per step, the tied embedding's gradient between the first and last stage (each
    # holds a copy): sent and received
    pp = 0.0
    if L.pp > 1:
        pp_link = C.link_of("pp", L)
        pp = 2 * v * m * collective_time(pp_link, "send", message / (L.tp if L.sequence_parallel else 1), 2)
        calls["pp"] = 2 * v * m
        if getattr(base, "tie_weights", False):
            vocab_rows = -(-base.vocab_size // L.tp)
            pp += 2 * collective_time(pp_link, "send", vocab_rows * base.d_model * RECIPES[recipe].grad, 2)
            calls["pp"] += 2
    # ep: 2 all-to-alls forward, 2 backward, of top_k copies of each token, per MoE layer
    ep = 0.0
    if L.ep > 1:
        ep = 4 * layers * m * collective_time(C.link_of("ep", L), "all_to_all", message * top_k, L.ep)
        calls["ep"] = 4 * layers * m
    busy = compute + overhead + recompute + tp + pp + ep
    bubble = 0.0
    if L.pp > 1:
        f = formula_for(L.schedule, L.pp, m, v)
        # a device per rank: busy / (1 - f) in all. Ranks sharing fewer cores: busy was measured
        # with every rank running; alone a rank runs n / cores times faster, and the step
        # cannot end before all the work is done on the cores (busy)
        share = min(1.0, C.shared_cores / n_gpus) if C.shared_cores else 1.0
        bubble = max(0.0, busy * share / (1 - f) - busy)

    # dp: the gradients of the parameters this rank holds, over dp*ep replicas (experts: dp)
    mem = per_gpu_memory(config, micro_batch, seq, recipe, L.zero, L.dp, L.tp, L.pp, L.ep)
    local = mem["params_on_gpu"]
    replicas = L.dp * L.ep
    dp_link = C.link_of("dp", L)
    grad_bytes = local * RECIPES[recipe].grad
    param_bytes = local * RECIPES[recipe].param
    units = layers + 1  # ZeRO-3 gathers one block (or the root: embeddings, norm, head) at a time
    dp_total = 0.0
    if replicas > 1:
        if L.zero == 0:  # the gradient all-reduce, once per step (no_sync before)
            # pure data parallelism runs DDP (its buckets); a composed layout runs the ZeRO
            # engine at stage 0: one all-reduce per parameter group (decayed matrices, the rest)
            composed = L.tp > 1 or L.pp > 1 or L.ep > 1
            sizes = [grad_bytes, 0] if composed else ddp_buckets(grad_bytes)
            dp_total = sum(collective_time(dp_link, "all_reduce", s, replicas) for s in sizes)
            calls["dp"] = len(sizes)
        elif L.zero == 1:  # reduce-scatter the gradients, all-gather the updated shards
            dp_total = (collective_time(dp_link, "reduce_scatter", grad_bytes, replicas)
                        + collective_time(dp_link, "all_gather", param_bytes, replicas))
            calls["dp"] = 2
        elif L.zero == 2:  # the reduce-scatter runs in every micro-batch's backward
            dp_total = (m * collective_time(dp_link, "reduce_scatter", grad_bytes, replicas)
                        + collective_time(dp_link, "all_gather", param_bytes, replicas))
            calls["dp"] = m + 1
        else:  # per micro-batch: each block gathered in forward, again in backward, its gradient
            # scattered; the root (embeddings, norm, head) gathered once and kept until then
            gather = collective_time(dp_link, "all_gather", param_bytes / units, replicas)
            scatter = collective_time(dp_link, "reduce_scatter", grad_bytes / units, replicas)
            dp_total = m * (layers * (2 * gather + scatter) + gather + scatter)
            calls["dp"] = m * (3 * layers + 2)
    # gradients are final only in the last micro-batch's backward, so only that one hides them
    hidden_by = C.overlap * (2 / 3) * compute / m
    dp_exposed = max(0.0, dp_total - hidden_by)
    owned = local if L.zero == 0 else -(-local // replicas)
    # the update: a per-tensor loop over this rank's tensors (ZeRO: over flat shards, one per
    # parameter group, or one per unit at stage 3), plus reading and writing its state
    per_block, outside = parameter_tensors(config, L.ep)
    tensors = per_block * layers + outside if L.zero == 0 else (units if L.zero == 3 else 2)
    optimizer = tensors * C.tensor_overhead + owned * 2 * RECIPES[recipe].total / C.memory_bandwidth
    if n_gpus > 1 and (L.zero or L.tp > 1 or L.pp > 1 or L.ep > 1):  # the global norm's all-reduce
        optimizer += collective_time(C.intra if n_gpus <= C.gpus_per_node else C.inter, "all_reduce", 8, n_gpus)
        calls["norm"] = 1
    total = busy + bubble + dp_exposed + optimizer
    return {"compute": compute, "overhead": overhead, "recompute": recompute, "tp": tp, "pp": pp, "ep": ep,
            "bubble": bubble, "dp_total": dp_total, "dp_exposed": dp_exposed, "optimizer": optimizer,
            "total": total, "flops": flops, "tokens": tokens, "batch": batch, "calls": calls,
            "mfu": flops / (total * n_gpus * C.peak_flops)}


TERMS = ("compute", "overhead", "recompute", "tp", "pp", "ep", "bubble", "dp_exposed", "optimizer")
