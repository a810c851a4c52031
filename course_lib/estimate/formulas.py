"""Back-of-the-envelope formulas for training memory and compute (notebook 01).

Every formula here is held against a measurement in notebook 01 and tests/test_estimate.py:
parameter and model-state bytes against the real model and optimizer, activation bytes
against the tensors autograd saves (`course_lib.observe.memory.SavedActivations`), FLOPs against
`torch.utils.flop_counter.FlopCounterMode`. Units: bytes, FLOPs (not FLOP/s), seconds;
GB means 10^9 bytes.

    param_count(config)                        exact parameter count (GPT, Llama-like, MoE)
    model_state_bytes(n_params, recipe, ...)   params + grads + optimizer state per device
    activation_bytes(config, batch, seq, ...)  tensors saved for backward, per layer and total
    flops_per_token / training_flops / training_time / gpus_needed
    per_gpu_memory(config, ..., dp, tp, pp, ep, ...)   everything above on one GPU of a 4D mesh

Configs: `course_lib.model.GPTConfig` (GPT-2/GPT-3 style), `LlamaLikeConfig` (SwiGLU, RMSNorm,
no biases, untied head, grouped-query attention, rotary positions) and `MoEConfig`, which
turns either into a mixture of experts (every MLP becomes `n_experts` copies plus a router,
each token runs through `top_k` of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.model import GPTConfig, expected_num_params

__all__ = ['LlamaLikeConfig', 'MoEConfig', 'param_breakdown', 'param_count', 'Recipe', 'model_state_bytes', 'activation_bytes', 'flops_per_token', 'training_flops', 'training_time', 'gpus_needed', 'per_gpu_memory', 'fmt_bytes', 'fmt_duration', 'GB', 'COURSE_GPT', 'GPT3_175B', 'LLAMA3_8B', 'LLAMA3_70B', 'LLAMA3_405B', 'PRESETS', 'RECIPES', 'ZERO_STAGES', 'RECOMPUTE', 'ATTENTION']

GB = 1e9


@dataclass(frozen=True)
class LlamaLikeConfig:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP (three d x d_ff matrices), no biases, rotary
    positions (no position table), untied output head, n_kv_head key/value heads (GQA)."""

    vocab_size: int
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    block_size: int = 8192
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")


@dataclass(frozen=True)
class MoEConfig:
    """`base` with every MLP replaced by `n_experts` expert MLPs and a router (a d x n_experts
    matrix, no bias); each token is sent to `top_k` experts (capacity limits ignored)."""

    base: GPTConfig | LlamaLikeConfig
    n_experts: int = 8
    top_k: int = 2

    def __post_init__(self):
        if not isinstance(self.base, (GPTConfig, LlamaLikeConfig)):
            raise ValueError(f"base={self.base!r} must be a GPTConfig or LlamaLikeConfig")
        if not (isinstance(self.n_experts, int) and self.n_experts >= 1):
            raise ValueError(f"n_experts={self.n_experts!r} must be a positive int")
        if not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.n_experts):
            raise ValueError(f"top_k={self.top_k!r} must satisfy 1 <= top_k <= n_experts={self.n_experts}")


# Published shapes. GPT-3: Brown et al. 2020, Table 2.1 (GPT-2 tokenizer, learned positions,
# tied embeddings). Llama 3: Dubey et al. 2024, Table 3 (vocab 128256, 8 KV heads).
COURSE_GPT = GPTConfig.tiny()
GPT3_175B = GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, d_model=12288)
LLAMA3_8B = LlamaLikeConfig(vocab_size=128256, n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336)
LLAMA3_70B = LlamaLikeConfig(vocab_size=128256, n_layer=80, d_model=8192, n_head=64, n_kv_head=8, d_ff=28672)
LLAMA3_405B = LlamaLikeConfig(vocab_size=128256, n_layer=126, d_model=16384, n_head=128, n_kv_head=8, d_ff=53248)
PRESETS = {"course GPT": COURSE_GPT, "GPT-3 175B": GPT3_175B, "Llama-3 8B": LLAMA3_8B,
           "Llama-3 70B": LLAMA3_70B, "Llama-3 405B": LLAMA3_405B}


def _unpack(config):
    """(base config, n_experts, top_k); a dense model is one expert with top_k = 1."""
    if isinstance(config, MoEConfig):
        return config.base, config.n_experts, config.top_k
    if isinstance(config, (GPTConfig, LlamaLikeConfig)):
        return config, 1, 1
    raise ValueError(f"config={config!r} must be a GPTConfig, LlamaLikeConfig or MoEConfig")


def _kv_dim(base) -> int:
    return base.d_model if isinstance(base, GPTConfig) else base.n_kv_head * (base.d_model // base.n_head)


def _ff(base) -> int:
    return base.ff_dim if isinstance(base, GPTConfig) else base.d_ff


def param_breakdown(config) -> dict[str, int]:
    """Parameter counts by part; per-layer parts are for ONE layer ("mlp": one expert).

    GPT (d = d_model, f = d_ff, b = 1 with biases): attention 4d^2 + 4bd (qkv and proj),
    mlp 2df + b(f + d), norms 2(d + bd), embedding Vd, position Td, final_norm d + bd,
    head Vd only if untied. Llama-like (kv = n_kv_head * d_head): attention 2d^2 + 2d*kv
    (q, o and the narrower k, v), mlp 3df (gate, up, down), norms 2d, final_norm d, head Vd.
    MoE adds a router of d * n_experts per layer.
    """
    base, n_experts, _ = _unpack(config)
    d, f, V = base.d_model, _ff(base), base.vocab_size
    if isinstance(base, GPTConfig):
        b = int(base.bias)
        parts = dict(embedding=V * d, position=base.block_size * d, attention=4 * d * d + 4 * b * d,
                     mlp=2 * d * f + b * (f + d), norms=2 * (d + b * d), final_norm=d + b * d,
                     head=0 if base.tie_weights else V * d)
    else:
        parts = dict(embedding=V * d, position=0, attention=2 * d * d + 2 * d * _kv_dim(base),
                     mlp=3 * d * f, norms=2 * d, final_norm=d, head=V * d)
    parts["router"] = d * n_experts if n_experts > 1 else 0
    return parts


def param_count(config, active: bool = False) -> int:
    """Exact parameter count. For a GPTConfig this is `course_lib.model.expected_num_params`
    (the closed form `sum(p.numel() for p in GPT(config).parameters())` is tested against);
    otherwise the sum of `param_breakdown`:

        embedding + position + final_norm + head + n_layer * (attention + norms + router + E * mlp)

    with E = n_experts, or E = top_k when active=True (the parameters one token uses).
    GPT-3 175B gives 174.6e9; Llama-3 8B / 70B / 405B give 8.03e9 / 70.55e9 / 405.85e9.
    """
    base, n_experts, top_k = _unpack(config)
    if isinstance(config, GPTConfig):
        return expected_num_params(config)
    p = param_breakdown(config)
    experts = top_k if active else n_experts
    per_layer = p["attention"] + p["norms"] + p["router"] + experts * p["mlp"]
    return p["embedding"] + p["position"] + p["final_norm"] + p["head"] + base.n_layer * per_layer


# ---------------------------------------------------------------- model state (params, grads, optimizer)


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
                         "master copy plus m and v (Micikevicius et al. 2018)"),
    "fp16_mixed": Recipe(2, 2, 12, "as bf16_mixed; fp16's narrow range needs a loss scaler, whose state "
                         "(a scale and a growth counter) is a few bytes in total, not per parameter"),
    "bf16_fp32_accum": Recipe(2, 6, 12, "bf16 weights; backward writes bf16 grads (2 B) that are summed over "
                              "micro-batches into an fp32 buffer (4 B); fp32 master, m, v (12 B). Megatron's "
                              "fused kernel writes straight into the fp32 buffer, dropping the 2 B: 18 B/param"),
}
ZERO_STAGES = (0, 1, 2, 3)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def model_state_bytes(n_params: int, recipe: str = "fp32", zero_stage: int = 0, dp: int = 1) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"}: bytes ONE data-parallel rank holds.

    Per parameter (see RECIPES): fp32 4 + 4 + 8 = 16; bf16_mixed / fp16_mixed 2 + 2 + 12 = 16;
    bf16_fp32_accum 2 + 6 + 12 = 20. ZeRO (Rajbhandari et al. 2020) splits a part across the
    dp ranks instead of replicating it, each rank keeping a shard of ceil(n_params / dp):
    stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
    So with Psi = n_params and K = optimizer bytes, mixed precision holds per rank
    (2 + 2 + K) Psi, (2 + 2 + K/dp) Psi, (2 + (2 + K)/dp) Psi, (2 + 2 + K) Psi / dp for stages 0..3.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} must be one of {sorted(RECIPES)}")
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage={zero_stage!r} must be one of {ZERO_STAGES}")
    _positive_int("dp", dp)
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
        raise ValueError(f"n_params={n_params!r} must be a non-negative int")
    r, shard = RECIPES[recipe], -(-n_params // dp)
    out = {
        "params": r.param * (shard if zero_stage >= 3 else n_params),
        "grads": r.grad * (shard if zero_stage >= 2 else n_params),
        "optimizer": r.optimizer * (shard if zero_stage >= 1 else n_params),
    }
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------- activations

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("naive", "fused")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def activation_bytes(config, batch: int, seq: int | None = None, dtype_bytes: int = 4, recompute: str = "none",
                     attention: str | None = None, tp: int = 1, sequence_parallel: bool = False,
                     dropout: bool | None = None, mask_bytes: int = 1) -> dict:
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

    recompute: "selective" keeps Q, K, V but recomputes the s^2 attention terms (Korthikanti's
    34sbh); "full" (activation checkpointing) keeps each layer's input e*n*d and recomputes the
    layer in backward, so one layer's full set is live again then ("recompute_buffer").
    Outside the layers: token ids (int64), an embedding dropout mask, final norm and head
    inputs, the fp32 log-softmax 4*n*V/tp (autocast computes the loss in fp32) and the targets.
    mask_bytes: 1 for PyTorch's fused GPU dropout (bool mask); on the CPU dropout multiplies by
    a noise tensor of the input dtype, so pass mask_bytes=dtype_bytes there.
    """
    base, n_experts, top_k = _unpack(config)
    seq = base.block_size if seq is None else seq
    _positive_int("batch", batch)
    _positive_int("seq", seq)
    _positive_int("tp", tp)
    if seq > base.block_size:
        raise ValueError(f"seq={seq} must be <= block_size={base.block_size}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTE}")
    if attention is None:
        attention = "naive" if getattr(base, "attn_impl", "sdpa") == "naive" else "fused"
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} must be one of {ATTENTION}")
    if base.n_head % tp or _ff(base) % tp:
        raise ValueError(f"tp={tp} must divide n_head={base.n_head} and d_ff={_ff(base)}")
    if dropout is None:
        dropout = base.dropout > 0
    gpt = isinstance(base, GPTConfig)
    s, b, d, f, a, e = seq, batch, base.d_model, _ff(base), base.n_head, dtype_bytes
    n = s * b
    rep = tp if sequence_parallel else 1  # divisor outside the tensor-parallel regions
    stats = _cdiv(n * 4 * (2 if gpt else 1), rep)  # fp32 mean + rstd (LayerNorm) or rstd (RMSNorm), per norm
    mask = mask_bytes if dropout else 0

    t = {"norm1 input": _cdiv(e * n * d, rep) + stats, "qkv input": _cdiv(e * n * d, rep),
         "q, k, v": e * n * (d + 2 * _kv_dim(base)) // tp}
    quadratic = []  # the s^2 terms selective recomputation drops
    if attention == "naive":
        t["softmax output"] = e * a * s * s * b // tp
        t["causal mask (bool)"] = s * s
        quadratic += ["softmax output", "causal mask (bool)"]
        if dropout:
            t["attention dropout mask"] = mask * a * s * s * b // tp
            t["attention dropout output"] = e * a * s * s * b // tp
            quadratic += ["attention dropout mask", "attention dropout output"]
    else:
        t["log-sum-exp (fp32)"] = 4 * a * s * b // tp
    t["attention proj input"] = e * n * d // tp
    t["attention residual dropout mask"] = _cdiv(mask * n * d, rep)
    t["norm2 input"] = _cdiv(e * n * d, rep) + stats
    if n_experts > 1:  # the router matmul saves its input; its softmax saves fp32 probabilities
        t["router input"] = _cdiv(e * n * d, rep)
        t["router probabilities (fp32)"] = _cdiv(4 * n * n_experts, rep)
    # MLP: an expert layer runs top_k experts per token; each saves its own (dispatched) input.
    t["mlp input"] = _cdiv(e * n * d, rep) * top_k
    hidden = 2 if gpt else 4  # GELU: its input and output; SwiGLU: gate, up, silu(gate), product
    t["mlp hidden"] = hidden * e * n * f // tp * top_k
    t["mlp residual dropout mask"] = _cdiv(mask * n * d, rep)
    t = {k: v for k, v in t.items() if v}
    full_layer = sum(t.values())

    if recompute == "full":
        layer_terms = {"layer input (checkpoint)": _cdiv(e * n * d, rep)}
    elif recompute == "selective":
        layer_terms = {k: v for k, v in t.items() if k not in quadratic}
    else:
        layer_terms = t
    per_layer = sum(layer_terms.values())
    input_side = 8 * n + (8 * s if gpt else 0) + _cdiv(mask * n * d, rep)  # ids, positions, embedding dropout
    output_side = (_cdiv(e * n * d, rep) + stats + _cdiv(e * n * d, rep)  # final norm, head input
                   + 4 * n * _cdiv(base.vocab_size, tp) + 8 * n)  # fp32 log-softmax, targets
    out = {"layer_terms": layer_terms, "per_layer": per_layer, "n_layer": base.n_layer,
           "layers": per_layer * base.n_layer, "recompute_buffer": full_layer if recompute == "full" else 0,
           "input_side": input_side, "output_side": output_side}
    out["total"] = out["layers"] + out["recompute_buffer"] + input_side + output_side
    return out


# ---------------------------------------------------------------- FLOPs and time


def flops_per_token(config, seq: int | None = None, causal: bool = False, training: bool = True) -> float:
    """Matmul FLOPs per token, the way FlopCounterMode counts them (2 per multiply-add).

    forward = 2 * N_mm + 4 * n_layer * s * d_attn, where N_mm is the number of weights used in
    a matmul (attention and MLP matrices of the top_k active experts, router, and the output
    head, which multiplies even when tied; embeddings are lookups, biases and norms are not
    matmuls) and 4*L*s*d_attn is Q K^T plus (attention weights) V over the full s x s square.
    causal=True halves the attention term, as if the masked half were skipped: that is
    Kaplan et al. 2020's 2 * n_layer * n_ctx * d_attn. Backward costs twice the forward
    (gradients for inputs and for weights), so training = 3 * forward, about 6 * N per token.
    """
    base, n_experts, top_k = _unpack(config)
    s = base.block_size if seq is None else seq
    _positive_int("seq", s)
    p = param_breakdown(config)
    d, f, L, V = base.d_model, _ff(base), base.n_layer, base.vocab_size
    if isinstance(base, GPTConfig):
        attn_mm, mlp_mm = 4 * d * d, 2 * d * f
    else:
        attn_mm, mlp_mm = p["attention"], p["mlp"]
    n_mm = L * (attn_mm + top_k * mlp_mm + p["router"]) + V * d
    attn = 4 * L * s * d * (0.5 if causal else 1.0)
    forward = 2 * n_mm + attn
    return 3 * forward if training else forward


def training_flops(n_params: float, n_tokens: float) -> float:
    """The 6*P*D rule (Kaplan et al. 2020): 2 FLOPs per parameter per token forward, 4 backward.
    It leaves out the attention term of `flops_per_token` (small while s << 6 d)."""
    return 6.0 * n_params * n_tokens


def training_time(total_flops: float, n_gpus: int, peak_flops: float, mfu: float = 0.4) -> float:
    """Seconds = total_flops / (n_gpus * peak_flops * mfu). MFU (model FLOPs utilisation) is the
    achieved fraction of peak; large runs report 0.35-0.55."""
    _positive_int("n_gpus", n_gpus)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must satisfy 0 < mfu <= 1")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops!r} must be > 0")
    return total_flops / (n_gpus * peak_flops * mfu)


def gpus_needed(total_flops: float, seconds: float, peak_flops: float, mfu: float = 0.4) -> int:
    """Fewest GPUs that finish `total_flops` within `seconds` (perfect scaling assumed)."""
    return math.ceil(total_flops / (seconds * peak_flops * mfu))


# ---------------------------------------------------------------- one GPU of a dp x tp x pp x ep mesh


def per_gpu_memory(config, batch: int = 1, seq: int | None = None, recipe: str = "bf16_mixed", zero_stage: int = 0,
                   dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, recompute: str = "none",
                   offload: str = "none", attention: str | None = None, sequence_parallel: bool | None = None) -> dict:
    """Bytes on the busiest GPU: {"params", "grads", "optimizer", "activations", "total",
    "cpu_offload", "params_on_gpu", "n_gpus", "stage"}. `batch` is the micro-batch per GPU.

    The mesh is course_lib.parallel.mesh's: n_gpus = dp * ep * tp * pp. tp splits attention heads, MLP
    columns, embedding and head rows (norms stay replicated); pp gives each stage n_layer/pp
    layers, the embedding to the first stage and the head to the last (a tied head keeps a
    copy there); ep splits MoE experts (each ep rank holds n_experts/ep of them). The ranks of
    an ep group read different data, so dense weights are replicated over dp*ep ranks (ZeRO
    shards them over dp*ep) and expert weights over dp (ZeRO shards them over dp).
    Activations follow the 1F1B schedule: stage 0 holds pp micro-batches of its n_layer/pp
    layers (Korthikanti et al.: as much as one micro-batch through all layers, / tp).
    sequence_parallel defaults to tp > 1. offload="optimizer" moves the optimizer state
    (fp32 master, m, v) to CPU memory (ZeRO-Offload), reported as "cpu_offload".
    """
    base, n_experts, _ = _unpack(config)
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)):
        _positive_int(name, v)
    if base.n_head % tp:
        raise ValueError(f"tp={tp} must divide n_head={base.n_head}")
    if isinstance(base, LlamaLikeConfig) and base.n_kv_head % tp:
        raise ValueError(f"tp={tp} must divide n_kv_head={base.n_kv_head}")
    if _ff(base) % tp:
        raise ValueError(f"tp={tp} must divide d_ff={_ff(base)}")
    if base.n_layer % pp:
        raise ValueError(f"pp={pp} must divide n_layer={base.n_layer}")
    if ep > 1 and n_experts == 1:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model (this one is dense): wrap it in MoEConfig")
    if n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_experts={n_experts}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} must be one of {sorted(RECIPES)}")
    if offload not in ("none", "optimizer"):
        raise ValueError(f"offload={offload!r} must be 'none' or 'optimizer'")
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    p = param_breakdown(config)
    layers = base.n_layer // pp
    dense_layer = layers * (p["attention"] // tp + p["norms"] + p["router"])
    expert_layer = layers * (n_experts // ep) * (p["mlp"] // tp)
    first = _cdiv(p["embedding"], tp) + p["position"]
    last = p["final_norm"] + _cdiv(p["head"] or (p["embedding"] if pp > 1 else 0), tp)
    dtype = 4 if recipe == "fp32" else 2
    act = activation_bytes(config, batch, seq, dtype, recompute, attention, tp, sp)

    # 1F1B: stage 0 has pp micro-batches in flight through its n_layer/pp layers, the last stage one.
    stages = {0: (dense_layer + first + (last if pp == 1 else 0),
                  act["layers"] + act["recompute_buffer"] + pp * act["input_side"]
                  + (act["output_side"] if pp == 1 else 0))}
    if pp > 1:
        stages[pp - 1] = (dense_layer + last,
                          act["per_layer"] * layers + act["recompute_buffer"] + act["output_side"])
    best = None
    for stage, (dense, activations) in stages.items():
        state = model_state_bytes(dense, recipe, zero_stage, dp * ep)
        if expert_layer:
            expert = model_state_bytes(expert_layer, recipe, zero_stage, dp)
            state = {k: state[k] + expert[k] for k in state}
        out = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
               "activations": activations, "cpu_offload": 0}
        if offload == "optimizer":
            out["cpu_offload"], out["optimizer"] = out["optimizer"], 0
        out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"]
        out.update(params_on_gpu=dense + expert_layer, n_gpus=dp * ep * tp * pp, stage=stage)
        if best is None or out["total"] > best["total"]:
            best = out
    return best


def fmt_bytes(n: float) -> str:
    """'350.0 GB' style (GB = 1e9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_duration(seconds: float) -> str:
    """'32.0 years', '23.4 days', '5.0 hours', '2.4 ms' style."""
    for unit, scale in (("years", 365.25 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
