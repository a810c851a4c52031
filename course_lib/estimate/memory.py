"""Memory formulas: model state by precision recipe and ZeRO stage, and activations
(notebook 01, sections 2 and 3). (Just over 300 lines: every per-rank byte formula of one
notation in one file, per-parameter ZeRO-3 beside the flat stages it is compared with.) Bytes throughout; `course_lib.units.fmt_bytes` prints them
in IEC units (GiB = 2**30 bytes).

    RECIPES, Recipe                               bytes per parameter of each precision recipe
    model_state_bytes(n_params, recipe, zero_stage, dp)
    per_param_memory(units, dp, hsdp, reshard_after_forward)   per-parameter stage 3 (FSDP2), HSDP
    activation_bytes(config, batch, seq, ...)    tensors saved for backward, per layer and total
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib._validate import check_int
from course_lib.dims import RECOMPUTE, ZERO_STAGES, check_context_parallel, check_tp, copies_kv
from course_lib.estimate.params import cdiv, ff_dim, as_count, kv_rows_per_rank, model_shape, positive_int
from course_lib.model.config import GPTConfig

@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter held for each part of the model state under a precision recipe."""

    param: int
    grad: int
    optimizer: int
    description: str

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


RECIPES = {
    "fp32": Recipe(4, 4, 8, "fp32 weights and gradients; AdamW keeps two fp32 moments m and v"),
    "bf16_mixed": Recipe(2, 2, 12, "bf16 weights and gradients for compute; the optimizer keeps an fp32 "
                         "master copy plus m and v (the master-weights recipe of Micikevicius et al. 2018, "
                         "with bf16, Kalamkar et al. 2019, instead of fp16)"),
    "fp16_mixed": Recipe(2, 2, 12, "as bf16_mixed; fp16's narrow range needs a loss scaler, whose state "
                         "(a scale and a growth counter) is a few bytes in total, not per parameter"),
    "bf16_fp32_accum": Recipe(2, 6, 12, "bf16 weights; backward writes bf16 grads (2 B) that are summed over "
                              "micro-batches into an fp32 buffer (4 B); fp32 master, m, v (12 B). Megatron's "
                              "fused kernel writes straight into the fp32 buffer, dropping the 2 B: 18 B/param"),
    "bf16_autocast": Recipe(4, 4, 8, "torch.autocast: the parameters, gradients and AdamW's m, v stay fp32 "
                            "(16 B/param, as fp32); matmuls run on bf16 copies of the weights made during "
                            "forward (2 B/param more while they live) and save bf16 activations"),
    "fp8": Recipe(2, 2, 12, "FP8 matmuls (Micikevicius et al. 2022; course_lib.techniques.fp8): state as "
                  "bf16_mixed; each step makes e4m3 copies of the weights (1 B/param while they live), saves "
                  "the matmul inputs for backward in e4m3 (1 B/element) and can all-gather parameters in FP8 "
                  "(half of bf16's bytes); norms, softmax, residual stream and loss stay bf16/fp32"),
}

def model_state_bytes(n_params: int, recipe: str = "fp32", zero_stage: int = 0, dp: int = 1) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"}: bytes ONE data-parallel rank holds.

    Per parameter (see RECIPES): fp32 4 + 4 + 8 = 16; bf16_mixed / fp16_mixed 2 + 2 + 12 = 16;
    bf16_fp32_accum 2 + 6 + 12 = 20; bf16_autocast 4 + 4 + 8 = 16 (the transient bf16 weight
    copies autocast makes are not model state). n_params may be an integral float (7.5e9). ZeRO (Rajbhandari et al. 2020) splits a part across the
    dp ranks instead of replicating it, each rank keeping a shard of ceil(n_params / dp):
    stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
    So with Psi = n_params and K = optimizer bytes, mixed precision holds per rank
    (2 + 2 + K) Psi, (2 + 2 + K/dp) Psi, (2 + (2 + K)/dp) Psi, (2 + 2 + K) Psi / dp for stages 0..3.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} must be one of {sorted(RECIPES)}")
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage={zero_stage!r} must be one of {ZERO_STAGES}")
    dp = positive_int("dp", dp)
    n_params = as_count("n_params", n_params)
    r, shard = RECIPES[recipe], cdiv(n_params, dp)
    out = {
        "params": r.param * (shard if zero_stage >= 3 else n_params),
        "grads": r.grad * (shard if zero_stage >= 2 else n_params),
        "optimizer": r.optimizer * (shard if zero_stage >= 1 else n_params),
    }
    out["total"] = sum(out.values())
    return out


def check_mesh_args(world_size: int, replicas: int = 1, reshard_after_forward=True) -> int:  # HSDP, FSDP2's reshard
    """ValueError naming the value and the rule; returns S = world_size // replicas. Pure Python:
    call it in the parent, before any rank starts (apply_zero calls it before any collective)."""
    check_int("hsdp", replicas, rule="an int >= 1 (replicas)")
    if world_size % replicas:
        raise ValueError(f"hsdp={replicas} replicas must divide the {world_size} data-parallel ranks "
                         f"(the mesh is replicas x shard group)")
    shards = world_size // replicas
    k = reshard_after_forward
    if not isinstance(k, bool):
        divisors = [d for d in range(1, shards + 1) if shards % d == 0]
        rule = (f"True, False or an int dividing the shard group size {shards} (one of {divisors}): after "
                f"forward each tensor is kept in k equal pieces, gathered again from k ranks")
        if shards % check_int("reshard_after_forward", k, rule=rule):
            raise ValueError(f"reshard_after_forward={k!r} must be {rule}")
    return shards


def per_param_memory(units, dp: int, hsdp: int = 1, reshard_after_forward=True, param_bytes: int = 4,
                     optimizer_bytes: int = 8) -> dict[str, int]:
    """Bytes ONE rank holds under per-parameter stage 3 (FSDP2's design, Zhao et al. 2023; the
    course's apply_zero(..., sharding="per_param"), without prefetch). `units`: each unit's
    parameter shapes in forward order, the root first (policy "block": [[the shapes outside the
    blocks], [block 0's shapes], ...]). Returns {"params", "grads", "optimizer", "total",
    "local_elements", "gathered_after_forward", "gathered_peak"}.

    Shards. HSDP lays the dp ranks out as R x S (R = hsdp replicas of a shard group of S = dp/R
    ranks): the state is sharded over S only, each replica holding the same shards. A parameter of
    shape (d0, rest) is cut on dim 0 into S blocks of ceil(d0/S) rows, the last rank(s) padded with
    zero rows, and every rank holds its block, padding included:

        S_u = sum over W in unit u of ceil(d0_W / S) * prod(rest_W)     local elements
        P_u = S * S_u                                                 the gathered (padded) unit

    Model state: the local shards are the fp32 masters and their gradients are reduced into fp32,
    so params = 4 sum_u S_u, grads = 4 sum_u S_u, optimizer = optimizer_bytes * sum_u S_u (AdamW's
    m and v: 8); HSDP keeps R times the bytes of plain sharding over dp ranks.

    Gathered parameters, param_bytes per element (4; 2 with param_dtype=bfloat16). A gather
    allocates the unit's padded tensors (P_u elements) and an all-gather output of P_u elements,
    copied out and dropped when the gather completes (the copy-in of S_u elements handed to it is
    not counted). The root is gathered once per step and kept until its gradients are reduced, at
    the end of backward. After its forward, block b keeps

        kept_b = 0        reshard_after_forward=True: freed, gathered again before its backward
                 P_b      False: kept until its gradients are reduced
                 P_b / k  an int k dividing S: this rank's 1/k of each padded tensor, the rest
                          gathered again from the k ranks of its subgroup (k = S is True, 1 False)

    and a block's gathered tensors (and its kept piece) are freed when its gradients are reduced,
    before the block in front of it is gathered again. So, with r = P_root:

        gathered_after_forward = r + sum_b kept_b
        gathered_peak = max(2 r,                                 the root's gather
                            r + sum_{b<i} kept_b + 2 P_i,        block i's gather in forward
                            r + sum_{b<=i} kept_b + 2 P_i)       again in backward (True or k)

    each times param_bytes.
    """
    dp, hsdp = positive_int("dp", dp), positive_int("hsdp", hsdp)
    s = check_mesh_args(dp, hsdp, reshard_after_forward)
    k = reshard_after_forward
    if not isinstance(k, bool):
        k = True if k == s else (False if k == 1 else k)
    local = []
    for i, shapes in enumerate(units):
        n = 0
        for shape in shapes:
            shape = tuple(shape)
            if not shape or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in shape):
                raise ValueError(f"units[{i}] has shape {shape!r}: per-parameter sharding needs a dim 0 "
                                 f"(a tuple of positive ints)")
            row = 1  # elements per dim-0 row
            for x in shape[1:]:
                row *= x
            n += cdiv(shape[0], s) * row
        local.append(n)
    if not local:
        raise ValueError("units is empty: give at least the root unit's parameter shapes")
    total = sum(local)
    out = {"params": 4 * total, "grads": 4 * total, "optimizer": as_count("optimizer_bytes", optimizer_bytes) * total}
    out["total"] = sum(out.values())
    root, *blocks = [s * n for n in local]
    kept = [0 if k is True else b if k is False else b // k for b in blocks]
    held = [2 * root]
    for i, b in enumerate(blocks):
        held.append(root + sum(kept[:i]) + 2 * b)
        if k is not False:
            held.append(root + sum(kept[:i + 1]) + 2 * b)
    e = positive_int("param_bytes", param_bytes)
    out.update(local_elements=total, gathered_after_forward=e * (root + sum(kept)), gathered_peak=e * max(held))
    return out


# ---------------------------------------------------------------- activations

ATTENTION = ("naive", "fused")


def activation_bytes(config, batch: int, seq: int | None = None, dtype_bytes: int = 4, recompute: str = "none",
                     attention: str | None = None, tp: int = 1, sequence_parallel: bool = False,
                     dropout: bool | None = None, mask_bytes: int = 1, cp: int = 1,
                     cp_method: str = "ring", fp8_linears: bool = False) -> dict:
    """Bytes of the tensors autograd keeps for backward (one model replica, one micro-batch).

    Read off the graph, op by op: each op saves what its backward needs. With n = b*s tokens,
    d = d_model, f = d_ff, a = heads, e = dtype_bytes, one GPT layer saves (``layer_terms``):

        ln1 input e*n*d, qkv input e*n*d, Q K V 3e*n*d, attention proj input e*n*d,
        ln2 input e*n*d, fc input e*n*d, GELU input e*n*f, mlp proj input e*n*f,
        LayerNorm mean and rstd: 2 * 2 * 4 bytes per token (fp32), plus
        naive attention: the softmax output e*a*s^2*b (and the bool causal mask s^2), or
        fused attention: only the fp32 log-sum-exp 4*a*s*b (the s x s scores are recomputed).
        With dropout: a mask per dropout (mask_bytes per element) and the dropped-out
        attention weights (e*a*s^2*b).

    In fp32 without dropout that is 4*n*(8d + 2f) + 4*a*s^2*b + 16n + s^2 (f = 4d: 64sbh + ...).
    With e = 2, 1-byte masks and dropout, leaving out the LayerNorm statistics and the causal
    mask (an artefact of the course model's naive kernel), it is exactly
    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
    s*b*h*(34 + 5*a*s/h) per layer. Tensor parallelism divides the terms inside the
    parallel regions by tp (with sequence_parallel=True, all of them): sbh(10 + 24/t + 5as/(ht)).
    Grouped-query attention: K and V are kv = n_kv_head * d_head wide (kv/tp per rank); at
    tp > n_kv_head a rank keeps its one copied KV head, d_head wide (params.kv_rows_per_rank).

    recompute: "selective" keeps Q, K, V but recomputes the s^2 attention terms (Korthikanti's
    34sbh); "full" (activation checkpointing) keeps each layer's input e*n*d and recomputes the
    layer in backward, so one layer's full set is live again then ("recompute_buffer").
    Outside the layers: token ids (int64), an embedding dropout mask, final norm and head
    inputs, the fp32 log-softmax 4*n*V/tp (autocast computes the loss in fp32) and the targets.
    mask_bytes: 1 for PyTorch's fused GPU dropout (bool mask); on the CPU dropout multiplies by
    a noise tensor of the input dtype, so pass mask_bytes=dtype_bytes there.

    Context parallelism (cp ranks, course_lib.dims): a rank holds s/cp tokens of every row, so
    every term above is counted with n = b*s/cp (positions, ids and the loss too): they all fall
    by cp exactly. The attention terms, per head: naive, the scores of the rank's s/cp queries
    against all s keys, s/cp x s (the same for the three methods: Ulysses' s x s of a/cp heads
    is as many); fused, the log-sum-exp of its s/cp queries. The course's ring keeps only q, k,
    v, the output and the log-sum-exp (blocks merged by log-sum-exp, never saved whole): cost
    it with attention="fused". cp_method="allgather" adds, per layer, the other ranks' keys and
    values gathered for it, e*b*(s - s/cp)*2*kv/tp ("gathered k, v"): the course's
    allgather_attention lets autograd keep the gathered tensor for backward (an implementation
    that frees it and gathers again in backward holds it for one layer at a time only).

    fp8_linears=True (recipe "fp8": course_lib.techniques.fp8.apply_fp8, per-tensor scales): each
    linear of a layer saves its input in e4m3 (1 byte, not e) plus an e4m3 copy of its weight and
    two fp32 scales, instead of its input in e. Per layer (GPT: qkv, attention proj, fc, mlp proj):

        qkv input n*d, attention proj input n*d, mlp input n*d, mlp proj input n*f (1 byte each;
        GELU's own input stays e*n*f), weight copies 4d^2 + 2df (1 byte each), scales 2 * 4 * 4

    so fp32 saves 3(3nd + nf) fewer bytes and (4d^2 + 2df) + 32 more. The head stays high
    precision (apply_fp8's default); attention, norms and GELU save what they saved. Llama-like
    layers are counted with fused q|k|v and gate|up matmuls (one FP8 copy of each input, as
    Transformer Engine fuses them); MoE with the top_k experts' weight copies.
    """
    shape = model_shape(config)
    base, n_experts, top_k = shape.base, shape.n_experts, shape.top_k  # n_experts 0: dense
    if not isinstance(fp8_linears, bool):
        raise ValueError(f"fp8_linears={fp8_linears!r} must be True or False")
    seq = base.block_size if seq is None else seq
    batch, seq, tp = positive_int("batch", batch), positive_int("seq", seq), positive_int("tp", tp)
    if seq > base.block_size:
        raise ValueError(f"seq={seq} must be <= block_size={base.block_size}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTE}")
    if attention is None:
        attention = "naive" if getattr(base, "attn_impl", "fused") == "naive" else "fused"
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} must be one of {ATTENTION}")
    check_tp(tp, base.n_head, ff_dim(base), getattr(base, "n_kv_head", None), copies_kv(shape))
    # cp | s (the zig-zag's 2cp | s is the layout's, not the bytes'), cp | heads for Ulysses
    check_context_parallel(cp, seq, base.n_head, cp_method, False, getattr(base, "n_kv_head", None), tp)
    if dropout is None:
        dropout = base.dropout > 0
    gpt = isinstance(base, GPTConfig)
    s, b, d, f, a, e = seq, batch, base.d_model, ff_dim(base), base.n_head, dtype_bytes
    q = s // cp  # this rank's tokens of each row (queries); keys: all s of them
    n = q * b
    rep = tp if sequence_parallel else 1  # divisor outside the tensor-parallel regions
    stats = cdiv(n * 4 * (2 if gpt else 1), rep)  # fp32 mean + rstd (LayerNorm) or rstd (RMSNorm), per norm
    mask = mask_bytes if dropout else 0

    kv = tp * kv_rows_per_rank(shape, tp)  # kv_dim(base), or tp copied heads' worth at tp > n_kv_head
    t = {"norm1 input": cdiv(e * n * d, rep) + stats, "qkv input": cdiv(e * n * d, rep),
         "q, k, v": e * n * (d + 2 * kv) // tp}
    if cp > 1 and cp_method == "allgather":
        t["gathered k, v"] = e * b * (s - q) * 2 * kv // tp
    quadratic = []  # the s^2 terms selective recomputation drops
    if attention == "naive":
        t["softmax output"] = e * a * q * s * b // tp
        t["causal mask (bool)"] = q * s
        quadratic += ["softmax output", "causal mask (bool)"]
        if dropout:
            t["attention dropout mask"] = mask * a * q * s * b // tp
            t["attention dropout output"] = e * a * q * s * b // tp
            quadratic += ["attention dropout mask", "attention dropout output"]
    else:
        t["log-sum-exp (fp32)"] = 4 * a * q * b // tp
    t["attention proj input"] = e * n * d // tp
    t["attention residual dropout mask"] = cdiv(mask * n * d, rep)
    t["norm2 input"] = cdiv(e * n * d, rep) + stats
    if n_experts:  # the router matmul saves its input; its softmax saves fp32 probabilities
        t["router input"] = cdiv(e * n * d, rep)
        t["router probabilities (fp32)"] = cdiv(4 * n * n_experts, rep)
    # MLP: an expert layer runs top_k experts per token; each saves its own (dispatched) input.
    t["mlp input"] = cdiv(e * n * d, rep) * top_k
    hidden = 2 if gpt else 4  # GELU: its input and output; SwiGLU: gate, up, silu(gate), product
    t["mlp hidden"] = hidden * e * n * f // tp * top_k
    t["mlp residual dropout mask"] = cdiv(mask * n * d, rep)
    if fp8_linears:  # each linear's input in e4m3 (1 byte), an e4m3 weight copy, 2 fp32 scales
        t["qkv input"], t["attention proj input"] = cdiv(n * d, rep), n * d // tp
        t["mlp input"] = cdiv(n * d, rep) * top_k
        t["mlp hidden"] = ((hidden - 1) * e * n * f // tp + n * f // tp) * top_k  # the down/proj input: 1 byte
        t["fp8 weight copies"] = (d * (d + 2 * kv) + d * d + top_k * (hidden // 2 + 1) * d * f) // tp
        t["fp8 scales (fp32)"] = 4 * 2 * 4  # 4 linears (fused), a scale for input and weight each
    t = {k: v for k, v in t.items() if v}
    full_layer = sum(t.values())

    if recompute == "full":
        layer_terms = {"layer input (checkpoint)": cdiv(e * n * d, rep)}
    elif recompute == "selective":
        layer_terms = {k: v for k, v in t.items() if k not in quadratic}
    else:
        layer_terms = t
    per_layer = sum(layer_terms.values())
    input_side = 8 * n + (8 * q if gpt else 0) + cdiv(mask * n * d, rep)  # ids, positions, embedding dropout
    output_side = (cdiv(e * n * d, rep) + stats + cdiv(e * n * d, rep)  # final norm, head input
                   + 4 * n * cdiv(base.vocab_size, tp) + 8 * n)  # fp32 log-softmax, targets
    out = {"layer_terms": layer_terms, "per_layer": per_layer, "n_layer": base.n_layer,
           "layers": per_layer * base.n_layer, "recompute_buffer": full_layer if recompute == "full" else 0,
           "input_side": input_side, "output_side": output_side}
    out["total"] = out["layers"] + out["recompute_buffer"] + input_side + output_side
    return out

