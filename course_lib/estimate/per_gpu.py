"""Per-GPU memory of one layout: everything of memory.py on the busiest GPU of a
dp x ep x tp x pp mesh (notebook 01, section 6; the calculator draws it).

    rank_param_counts(config, tp, pp, ep, stage)   parameters one rank of a pipeline stage holds
    attention_per_rank(config, tp)                  one block's attention on one tp rank (KV heads copied too)
    gpu_memory(dims, shape, batch, ...)             bytes on the busiest GPU (or on one stage's) of
                                                    a ParallelDims already checked (check_model)
    per_gpu_memory(config, ...)                     the same from degrees given as keywords
                                                    (notebook 01): checks them, then gpu_memory
    zero_units(config, dims, rank)                  ZeRO-2/3's flat units on a pipeline rank, composed
    composed_zero_memory(config, dims, ...)         their state, accumulated gradient and gathered peak
"""

from __future__ import annotations

from course_lib._validate import check_int
from course_lib.dims import V_SCHEDULES, ParallelDims, check_experts, check_tp, copies_kv, split_layers
from course_lib.estimate.memory import RECIPES, activation_bytes, model_state_bytes
from course_lib.estimate.params import (cdiv, ff_dim, kv_copy_rows, kv_rows_per_rank, model_shape, param_breakdown,
                                       positive_int)
from course_lib.model.config import GPTConfig


def rank_param_counts(config, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0) -> dict[str, int]:
    """{"dense", "expert"}: parameters one rank of pipeline stage `stage` holds ("expert": the
    MLPs, a dense model's MLP being its one expert; "dense": everything else), the way
    course_lib.parallel splits them (d = d_model, f = d_ff, V = vocabulary, T = block_size,
    b = 1 with biases, stage s's layers as course_lib.dims.split_layers(L, pp) gives them (L/pp
    when pp | L), E/ep experts per rank):

        per layer   qkv (3d^2 + 3bd)/tp + proj d^2/tp + bd      row-parallel biases stay whole
                    mlp, per expert: (df + bf)/tp + fd/tp + bd    (added once, after the reduce)
                    LayerNorms 2(d + bd), router dE: whole on every tp rank
        stage 0     token embedding ceil(V/tp) d  (the vocabulary is padded to a multiple of tp
                    and split by rows)  +  positions T d (whole)
        last stage  final norm d + bd  +  head ceil(V/tp) d when untied, or when tied and pp > 1
                    (the last stage keeps its own copy of the tied matrix; with pp = 1 the head
                    IS the embedding, held once)

    Llama-like models have no biases (b = 0) and split their k, v heads over tp as well.
    Grouped-query attention (kv = n_kv_head * d_head wide K and V): qkv holds d/tp + 2 kv/tp rows;
    at tp > n_kv_head (the course's GPT copies each KV head on tp / n_kv_head ranks) d/tp + 2 d_head
    rows, each rank its group's head (attention_per_rank).
    """
    shape = model_shape(config)
    base = shape.base
    p = param_breakdown(config)
    d = base.d_model
    whole_bias = d if isinstance(base, GPTConfig) and base.bias else 0  # a row-parallel bias: not split
    layers = len(split_layers(base.n_layer, pp)[stage])
    attention = attention_per_rank(config, tp)
    mlp = (p["mlp"] - whole_bias) // tp + whole_bias
    dense = layers * (attention + p["norms"] + p["router"])
    vocab_rows = cdiv(base.vocab_size, tp) * d
    if stage == 0:
        dense += vocab_rows + p["position"]
    if stage == pp - 1:
        dense += p["final_norm"] + (vocab_rows if p["head"] or pp > 1 else 0)
    expert = layers * (shape.mlps // ep) * mlp
    return {"dense": dense, "expert": expert}


def attention_per_rank(config, tp: int) -> int:
    """One block's attention parameters on one tp rank: (attention - proj bias) / tp + the proj bias
    (whole on every rank); at tp > n_kv_head (KV heads copied, params.kv_copy_rows) Q's and proj's
    (2d^2 + bd) / tp, the rank's copied KV head 2 d_head (d + b), and the proj bias bd."""
    base, p = model_shape(config).base, param_breakdown(config)
    whole_bias = base.d_model if isinstance(base, GPTConfig) and base.bias else 0
    if not kv_copy_rows(config, tp):
        return (p["attention"] - whole_bias) // tp + whole_bias
    d, b = base.d_model, int(base.bias)
    return (2 * d * d + b * d) // tp + 2 * kv_rows_per_rank(config, tp) * (d + b) + whole_bias


def per_gpu_memory(config, batch: int = 1, seq: int | None = None, recipe: str = "bf16_mixed", zero_stage: int = 0,
                   dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, recompute: str = "none",
                   offload: str = "none", attention: str | None = None, sequence_parallel: bool | None = None,
                   stage: int | None = None, cp: int = 1, cp_method: str = "ring") -> dict:
    """Bytes on the busiest GPU: {"params", "grads", "optimizer", "activations", "total",
    "cpu_offload", "params_on_gpu", "n_gpus", "stage"}. `batch` is the micro-batch per GPU.
    stage=s: the bytes of a rank of pipeline stage s instead of the busiest one.

    The mesh is course_lib.parallel.mesh's: n_gpus = dp * ep * tp * pp. The parameters of a
    rank are `rank_param_counts`' (tp splits attention heads, MLP columns, embedding and head
    rows; norms and row-parallel biases stay replicated; pp gives each stage n_layer/pp
    layers (split_layers' uneven split otherwise: the first stages one more), the embedding to the first stage and the head to the last (a tied head keeps a
    copy there); ep splits MoE experts (each ep rank holds n_experts/ep of them). The ranks of
    an ep group read different data, so dense weights are replicated over dp*ep ranks (ZeRO
    shards them over dp*ep, as Megatron's distributed optimizer does) and expert weights over
    dp (ZeRO shards them over dp). Sharding rounds up: ceil(n / ranks) per rank.
    Activations follow the 1F1B schedule: stage s holds pp - s micro-batches of its n_layer/pp
    layers (stage 0: as much as one micro-batch through all layers, Korthikanti et al., / tp).
    cp > 1 (context parallelism, cp_method one of course_lib.dims.CP_METHODS): n_gpus is
    dp * ep * cp * tp * pp; every rank holds s/cp tokens of each micro-batch (activation_bytes'
    cp), and the cp ranks of a replica hold whole weights, so ZeRO shards the dense state over
    dp * ep * cp and the experts' over dp * cp (Megatron's distributed optimizer over dp x cp).
    sequence_parallel defaults to tp > 1. offload="optimizer" moves the optimizer state
    (fp32 master, m, v) to CPU memory (ZeRO-Offload), reported as "cpu_offload".
    """
    shape = model_shape(config)
    dp, tp, pp, ep, cp = (positive_int(name, v) for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep),
                                                                  ("cp", cp)))
    positive_int("batch", batch)
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, zero=zero_stage, recompute=recompute, cp_method=cp_method,
                        sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel)
    check_degrees(dims, shape)
    return gpu_memory(dims, shape, batch, seq, recipe, offload, attention, stage)


def check_degrees(dims: ParallelDims, shape) -> None:
    """The rules of course_lib.dims a count of bytes needs, without a global batch or a schedule
    (per_gpu_memory's and the calculator's): whole degrees, tp | heads and d_ff, every one of
    pp stages a block, ep | n_experts. What the runtime splits, the estimator costs."""
    for name in ("dp", "tp", "pp", "ep", "cp"):
        positive_int(name, getattr(dims, name))
    check_tp(dims.tp, shape.n_head, shape.ff_dim, shape.n_kv_head, copies_kv(shape))
    split_layers(shape.n_layer, dims.pp)  # uneven when pp does not divide n_layer
    check_experts(dims.ep, shape.n_experts)


def gpu_memory(dims: ParallelDims, shape, batch: int = 1, seq: int | None = None, recipe: str = "bf16_mixed",
               offload: str = "none", attention: str | None = None, stage: int | None = None) -> dict:
    """per_gpu_memory of the layout `dims` (its dp, tp, pp, ep, cp, zero, recompute,
    sequence_parallel, cp_method) for the model `shape` (model_shape(config)): `batch` the
    micro-batch per GPU. The layout's rules are not checked again here: `dims` has passed
    dims.check_model(shape, ...) (step_time.check_layout) or per_gpu_memory's checks."""
    config, pp = shape.config, dims.pp
    batch = positive_int("batch", batch)
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} must be one of {sorted(RECIPES)}")
    if offload not in ("none", "optimizer"):
        raise ValueError(f"offload={offload!r} must be 'none' or 'optimizer'")
    if stage is not None:
        check_int("stage", stage, minimum=0, maximum=pp - 1, rule=f"None (the busiest) or an int in [0, pp={pp})")
    stages = split_layers(shape.n_layer, pp)
    dp, tp, ep, cp, zero_stage = dims.dp, dims.tp, dims.ep, dims.cp, dims.zero
    dtype = 4 if recipe == "fp32" else 2
    act = activation_bytes(config, batch, seq, dtype, dims.recompute, attention, tp, dims.sequence_parallel, cp=cp,
                           cp_method=dims.cp_method, fp8_linears=recipe == "fp8")

    def bytes_of(s: int) -> dict:
        counts = rank_param_counts(config, tp, pp, ep, s)
        state = model_state_bytes(counts["dense"], recipe, zero_stage, dp * ep * cp)
        if counts["expert"]:
            expert = model_state_bytes(counts["expert"], recipe, zero_stage, dp * cp)
            state = {k: state[k] + expert[k] for k in state}
        # 1F1B: stage s has pp - s micro-batches in flight through its layers.
        in_flight = pp - s
        activations = (in_flight * len(stages[s]) * act["per_layer"] + act["recompute_buffer"]
                       + (in_flight * act["input_side"] if s == 0 else 0)
                       + (act["output_side"] if s == pp - 1 else 0))
        out = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
               "activations": activations, "cpu_offload": 0}
        if offload == "optimizer":
            out["cpu_offload"], out["optimizer"] = out["optimizer"], 0
        out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"]
        out.update(params_on_gpu=counts["dense"] + counts["expert"], n_gpus=dp * ep * cp * tp * pp, stage=s)
        return out

    if stage is not None:
        return bytes_of(stage)
    best = None
    for s in sorted({0, pp - 1}):  # a middle stage holds no more than stage 0 (no fewer layers, more in flight)
        out = bytes_of(s)
        if best is None or out["total"] > best["total"]:
            best = out
    return best


def rank_stages(dims, rank: int = 0) -> list[int]:
    """The pipeline stages (chunks, in order) that pipeline rank `rank` runs: r, r + pp, ... of
    pp * v stages, or r and 2 pp - 1 - r in a V (course_lib.parallel.pp's placements)."""
    pp, v = dims.pp, dims.virtual_stages
    if getattr(dims, "schedule", "1f1b") in V_SCHEDULES and pp > 1:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(v)]


def zero_units(config, dims, rank: int = 0, by_chunk: bool = False) -> list:
    """P_u: the elements of each flat unit a rank of pipeline rank `rank` (any tp rank) shards
    over dp under ZeRO-2 or 3 composed with pp / tp (course_lib.parallel.hybrid.zero_pp, whose
    parameter groups are the matrices, weight-decayed, and the vectors: norms and biases):

        zero 2   one unit per group over all the rank's chunks; the matrix tied across ranks
                 (the embedding on the first rank, its copy in the head on the last, pp > 1) in
                 a unit of its own: [matrices - tied, vectors, tied]
        zero 3   one unit per chunk and group: [matrices(c), vectors(c)] for each chunk c

    A chunk's parameters are rank_param_counts' for its stage of pp * v; its vectors per block
    (GPT, b = 1 with biases): 2(d + bd) norms, qkv b(d/tp + 2 kv_rows_per_rank: 3bd/tp without
    grouped-query attention), proj bd, per expert fc bf/tp and proj bd (Llama-like: the 2
    RMSNorms, 2d), and the final norm on the last stage. Empty units are left out.
    by_chunk=True: stage 3's units as one list per chunk."""
    shape = model_shape(config)
    base = shape.base
    n_stages = dims.pp * dims.virtual_stages
    tp, ep = dims.tp, dims.ep
    stages = rank_stages(dims, rank)
    b = int(getattr(base, "bias", False)) if isinstance(base, GPTConfig) else 0
    d, f = base.d_model, ff_dim(base)
    norms = param_breakdown(config)["norms"]
    qkv_bias = b * (d // tp + 2 * kv_rows_per_rank(config, tp))
    per_block = norms + qkv_bias + b * d + (shape.mlps // ep) * (b * f // tp + b * d)
    final = param_breakdown(config)["final_norm"]
    split = split_layers(base.n_layer, n_stages)
    tied = bool(getattr(base, "tie_weights", False)) and n_stages > 1
    tied_rows = cdiv(base.vocab_size, tp) * d
    chunks = []
    for k, s in enumerate(stages):
        counts = rank_param_counts(config, tp, n_stages, ep, s)
        total = counts["dense"] + counts["expert"]
        vectors = len(split[s]) * per_block + (final if s == n_stages - 1 else 0)
        matrices = total - vectors
        if tied and s == n_stages - 1 and 0 in stages[:k]:  # the V: the head IS the embedding here
            matrices -= tied_rows
        chunks.append((matrices, vectors))
    if by_chunk:
        return [[n for n in chunk if n] for chunk in chunks]
    if dims.zero == 3:
        return [n for chunk in chunks for n in chunk if n]
    across = tied and dims.pp > 1 and (0 in stages) != (n_stages - 1 in stages)  # tied_across_ranks
    held_tied = tied_rows if across else 0
    units = [sum(m for m, _ in chunks) - held_tied, sum(v for _, v in chunks), held_tied]
    return [n for n in units if n]


FSDP_UNITS = ("chunk", "block")


def composed_zero_memory(config, dims, recipe: str = "bf16_mixed", rank: int = 0, fsdp_unit: str = "chunk") -> dict:
    """Model-state bytes of a rank of pipeline rank `rank` under ZeRO-2/3 composed with pp / tp
    (course_lib.parallel.hybrid.zero_pp): {"params", "grads", "optimizer", "gathered",
    "between_steps"}. Units P_u (zero_units), S_u = ceil(P_u / N) over N = dp*ep*cp ranks,
    Psi_r = sum_u P_u, recipe bytes p, g, k per parameter (RECIPES):

        between_steps   sum_u model_state_bytes(P_u, recipe, zero, N): the shards (the rank's state
                        between steps: params p Psi_r at stage 2, p sum S_u at 3; grads g sum S_u;
                        optimizer k sum S_u)
        grads           g Psi_r: each gradient accumulated unsharded over the m micro-batches
                        until its one reduce-scatter (the price of reducing once per step)
        gathered        stage 3, p times the parameters gathered at the peak:
                        fsdp_unit="chunk" (the course's engine: a chunk's units together)
                            reshard_after_forward=True   max over chunks of sum_u N S_u
                            False                        sum over all the rank's units of N S_u
                        fsdp_unit="block" (FSDP per transformer block, the embedding, final norm
                        and head a root unit kept for the step; no prefetch)
                            True   root + the largest block;   False   Psi_r

    params and optimizer are between_steps'; the peak adds grads and gathered to them."""
    if fsdp_unit not in FSDP_UNITS:
        raise ValueError(f"fsdp_unit={fsdp_unit!r} must be one of {FSDP_UNITS}")
    n = dims.dp * dims.ep * dims.cp
    r, units = RECIPES[recipe], zero_units(config, dims, rank)
    between = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    for p in units:
        for k, v in model_state_bytes(p, recipe, dims.zero, n).items():
            between[k] += v
    local = sum(units)
    gathered = 0
    if dims.zero == 3:
        reshard = getattr(dims, "reshard_after_forward", True)
        if fsdp_unit == "chunk":
            chunks = [sum(n * cdiv(p, n) for p in c) for c in zero_units(config, dims, rank, by_chunk=True)]
            gathered = max(chunks) if reshard else sum(chunks)
        else:
            blocks = [len(split_layers(model_shape(config).n_layer, dims.pp * dims.virtual_stages)[s]) for s in rank_stages(dims, rank)]
            block = _block_params(config, dims.tp, dims.ep)
            gathered = local - sum(blocks) * block + block if reshard else local
        gathered *= r.param
    return {"params": between["params"], "grads": r.grad * local, "optimizer": between["optimizer"],
            "gathered": gathered, "between_steps": between}


def _block_params(config, tp: int, ep: int) -> int:
    """One transformer block's parameters on one tp rank (rank_param_counts' per-layer terms)."""
    shape = model_shape(config)
    base = shape.base
    p = param_breakdown(config)
    whole_bias = base.d_model if isinstance(base, GPTConfig) and base.bias else 0
    mlp = (p["mlp"] - whole_bias) // tp + whole_bias
    return attention_per_rank(config, tp) + p["norms"] + p["router"] + (shape.mlps // ep) * mlp
