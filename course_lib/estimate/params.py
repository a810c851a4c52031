"""Model shapes and exact parameter counts (notebook 01, section 1).

    LlamaLikeConfig, MoEConfig           shapes beyond the course GPT (SwiGLU/GQA, experts)
    model_shape(config)                  the read-only ModelShape of any config form (n_experts = 0:
                                         dense, an MoEConfig of one expert too), the view the rule
                                         book (ParallelDims.check_model) reads as well
    COURSE_GPT, GPT3_175B, LLAMA3_*      published shapes; PRESETS by name
    param_breakdown(config)              counts by part (one layer, one expert)
    param_count(config, active=False)    the exact total
    moe_flops_per_token(config, seq)     FLOPs with shared experts, expert size, dense first layers
    mla_attention_params(...)            one multi-head latent attention layer (DeepSeek-V2/V3)

Configs: `course_lib.model.GPTConfig` (GPT-2/GPT-3 style), `LlamaLikeConfig` (SwiGLU, RMSNorm,
no biases, untied head, grouped-query attention, rotary positions) and `MoEConfig`, which
turns either into a mixture of experts (every MLP becomes `n_experts` copies plus a router,
each token runs through `top_k` of them). The small helpers at the end of this module
(`as_count`, `positive_int`, `cdiv`) are shared by the other estimate modules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib._validate import check_int
from course_lib.model.config import GPTConfig, ModelShape, expected_num_params


def as_count(name: str, value, minimum: int = 0) -> int:
    """`value` as an int >= minimum. Integral floats are accepted, since that is what people
    type for large counts (7.5e9 -> 7_500_000_000); 7.5 or True are not counts."""
    kind = "a positive" if minimum == 1 else f"an integer >= {minimum}" if minimum else "a non-negative"
    return check_int(name, value, minimum, allow_integral_float=True,
                     rule=f"{kind} whole number (an int, or a float like 7.5e9)")


def positive_int(name: str, value) -> int:
    """`value` as an int >= 1 (integral floats accepted, see as_count)."""
    return as_count(name, value, minimum=1)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints, without floats."""
    return -(-a // b)


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
            check_int(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}: "
                             f"each key/value head serves a whole group of query heads")

    @property
    def shape(self) -> ModelShape:
        """The read-only view the rule book and the estimator share (a dense model)."""
        return ModelShape(self.n_layer, self.n_head, self.n_kv_head, self.d_model, self.d_ff, self.vocab_size,
                          self.block_size, config=self, base=self)


@dataclass(frozen=True)
class MoEConfig:
    """`base` with every MLP replaced by `n_experts` expert MLPs and a router (a d x n_experts
    matrix, no bias); each token is sent to `top_k` experts (capacity limits ignored).

    The DeepSeekMoE / DeepSeek-V3 shape (Dai et al. 2024; DeepSeek-AI 2024) adds: `n_shared_experts`
    experts every token passes through, `d_expert` the hidden size of every expert (routed and
    shared; None: the base's d_ff), `first_dense_layers` leading layers that keep the base's dense
    MLP, and `attention_params`, the parameters of one attention layer when the base's formula
    does not describe it (MLA: `mla_attention_params`). Only param_count / param_breakdown /
    moe_flops_per_token read these four; the other estimators see n_experts and top_k."""

    base: GPTConfig | LlamaLikeConfig
    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0
    d_expert: int | None = None
    first_dense_layers: int = 0
    attention_params: int | None = None

    def __post_init__(self):
        if not isinstance(self.base, (GPTConfig, LlamaLikeConfig)):
            raise ValueError(f"base={self.base!r} must be a GPTConfig or LlamaLikeConfig")
        check_int("n_experts", self.n_experts)
        if not 1 <= check_int("top_k", self.top_k, minimum=None) <= self.n_experts:
            raise ValueError(f"top_k={self.top_k!r} must satisfy 1 <= top_k <= n_experts={self.n_experts}")
        as_count("n_shared_experts", self.n_shared_experts)
        if self.d_expert is not None:
            positive_int("d_expert", self.d_expert)
        if as_count("first_dense_layers", self.first_dense_layers) >= self.base.n_layer:
            raise ValueError(f"first_dense_layers={self.first_dense_layers} must be < n_layer={self.base.n_layer}")
        if self.attention_params is not None:
            positive_int("attention_params", self.attention_params)

    @property
    def shape(self) -> ModelShape:
        """The base's shape with this config's experts: n_experts = 1 (one expert MLP, no
        router: the base model) is the dense shape, n_experts = 0."""
        moe = self.n_experts > 1
        return replace(self.base.shape, n_experts=self.n_experts if moe else 0, top_k=self.top_k if moe else 1,
                       config=self, base=self.base)


# Published shapes. GPT-3: Brown et al. 2020, Table 2.1 (GPT-2 tokenizer, learned positions,
# tied embeddings). Llama 3: Dubey et al. 2024, Table 3 (vocab 128256, 8 KV heads).
COURSE_GPT = GPTConfig.tiny()
GPT3_175B = GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, d_model=12288)
LLAMA3_8B = LlamaLikeConfig(vocab_size=128256, n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336)
LLAMA3_70B = LlamaLikeConfig(vocab_size=128256, n_layer=80, d_model=8192, n_head=64, n_kv_head=8, d_ff=28672)
LLAMA3_405B = LlamaLikeConfig(vocab_size=128256, n_layer=126, d_model=16384, n_head=128, n_kv_head=8, d_ff=53248)
PRESETS = {"course GPT": COURSE_GPT, "GPT-3 175B": GPT3_175B, "Llama-3 8B": LLAMA3_8B,
           "Llama-3 70B": LLAMA3_70B, "Llama-3 405B": LLAMA3_405B}


def model_shape(config) -> ModelShape:
    """The read-only shape of a GPTConfig (a course MoE GPT too), LlamaLikeConfig, MoEConfig or
    ModelShape: n_experts = 0 is dense whichever config form said it (an MoEConfig's one expert)."""
    if isinstance(config, (GPTConfig, LlamaLikeConfig, MoEConfig, ModelShape)):
        return config.shape
    raise ValueError(f"config={config!r} must be a GPTConfig, LlamaLikeConfig or MoEConfig")


def kv_dim(base) -> int:
    return base.kv_dim if isinstance(base, GPTConfig) else base.n_kv_head * (base.d_model // base.n_head)


def kv_rows_per_rank(config, tp: int) -> int:
    """Rows of K (and as many of V) one of tp tensor-parallel ranks holds: kv_dim / tp when tp | n_kv_head,
    else one whole KV head, d_head rows, copied on tp / n_kv_head ranks (n_kv_head | tp: the course's GPT,
    course_lib.dims.copies_kv; the runtime keeps zeros where a copy is not its group's first, so the
    memory is held either way)."""
    shape = model_shape(config)
    return cdiv(shape.n_kv_head, tp) * (shape.d_model // shape.n_head)


def kv_copy_rows(config, tp: int) -> int:
    """K and V rows per block held across a tp group beyond one copy of each: 2 (tp kv_rows_per_rank - kv_dim),
    0 unless KV heads are copied (tp > n_kv_head)."""
    shape = model_shape(config)
    return 2 * (tp * kv_rows_per_rank(config, tp) - shape.n_kv_head * (shape.d_model // shape.n_head))


def ff_dim(base) -> int:
    return base.ff_dim if isinstance(base, GPTConfig) else base.d_ff


def param_breakdown(config) -> dict[str, int]:
    """Parameter counts by part; per-layer parts are for ONE layer ("mlp": one expert).

    GPT (d = d_model, f = d_ff, b = 1 with biases, kv = n_kv_head * d_head, d without GQA):
    attention 2d^2 + 2d*kv + b(2d + 2kv) (qkv and proj; 4d^2 + 4bd at kv = d),
    mlp 2df + b(f + d), norms 2(d + bd), embedding Vd, position Td, final_norm d + bd,
    head Vd only if untied. Llama-like (kv = n_kv_head * d_head): attention 2d^2 + 2d*kv
    (q, o and the narrower k, v), mlp 3df (gate, up, down), norms 2d, final_norm d, head Vd.
    MoE adds a router of d * n_experts per layer.
    """
    shape = model_shape(config)
    base = shape.base
    d, f, V = base.d_model, ff_dim(base), base.vocab_size
    if isinstance(base, GPTConfig):
        b = int(base.bias)
        parts = dict(embedding=V * d, position=base.block_size * d, attention=2 * d * d + 2 * d * kv_dim(base) + b * (2 * d + 2 * kv_dim(base)),
                     mlp=2 * d * f + b * (f + d), norms=2 * (d + b * d), final_norm=d + b * d,
                     head=0 if base.tie_weights else V * d)
    else:
        parts = dict(embedding=V * d, position=0, attention=2 * d * d + 2 * d * kv_dim(base),
                     mlp=3 * d * f, norms=2 * d, final_norm=d, head=V * d)
    parts["router"] = d * shape.n_experts  # none in a dense model (n_experts = 0)
    # one routed expert and the S shared ones of a layer (DeepSeekMoE); "mlp" stays the base's MLP
    fe = getattr(config, "d_expert", None) or f
    expert = (2 * d * fe + b * (fe + d)) if isinstance(base, GPTConfig) else 3 * d * fe
    parts["expert"], parts["shared"] = expert, _n_shared(config) * expert
    if getattr(config, "attention_params", None):
        parts["attention"] = config.attention_params
    return parts


def _n_shared(config) -> int:
    """Shared experts of an MoEConfig or a course MoEGPTConfig (course_lib.model.moe_config)."""
    return getattr(config, "n_shared_experts", 0)


def mla_attention_params(d_model: int, n_head: int, d_head: int, q_rank: int, kv_rank: int, rope_dim: int) -> int:
    """One multi-head latent attention layer (DeepSeek-V2 §2.1; no biases): queries through a
    rank-q_rank bottleneck, keys and values through one rank-kv_rank latent, plus a shared
    rotary key of rope_dim and per-head rotary queries; RMSNorms on both latents.

        d q_rank + q_rank n_head (d_head + rope_dim)        W_DQ, W_UQ (content and rotary queries)
        + d (kv_rank + rope_dim) + kv_rank n_head 2 d_head  W_DKV with W_KR, then W_UK and W_UV
        + n_head d_head d + q_rank + kv_rank                W_O and the two latent norms
    """
    h = n_head
    return (d_model * q_rank + q_rank * h * (d_head + rope_dim) + d_model * (kv_rank + rope_dim)
            + kv_rank * h * 2 * d_head + h * d_head * d_model + q_rank + kv_rank)


def param_count(config, active: bool = False) -> int:
    """Exact parameter count. For a GPTConfig this is `course_lib.model.expected_num_params`
    (the closed form `sum(p.numel() for p in GPT(config).parameters())` is tested against);
    otherwise the sum of `param_breakdown`:

        embedding + position + final_norm + head + n_layer * (attention + norms + router + E * mlp)

    with E = n_experts, or E = top_k when active=True (the parameters one token uses).
    GPT-3 175B gives 174.6e9; Llama-3 8B / 70B / 405B give 8.03e9 / 70.55e9 / 405.85e9.
    An MoEConfig with shared experts, d_expert or dense first layers (the DeepSeek shape):

        ... + dense * (attention + norms + mlp) + (n_layer - dense) * (attention + norms + router
              + E * expert + S * expert)

    DeepSeek-V3 (with mla_attention_params) gives 671.0e9 total and 37.6e9 active.
    """
    shape = model_shape(config)
    base = shape.base
    if isinstance(config, GPTConfig):  # + the shared experts of a course MoEGPTConfig
        return expected_num_params(config) + config.n_layer * param_breakdown(config)["shared"]
    p = param_breakdown(config)
    experts = shape.top_k if active else shape.mlps
    if not isinstance(config, MoEConfig) or config.d_expert is None and not config.n_shared_experts:
        moe_mlp = experts * p["mlp"]  # the plain MoE: each expert is the base's MLP
    else:
        moe_mlp = experts * p["expert"] + p["shared"]
    dense = getattr(config, "first_dense_layers", 0)
    per_layer = p["attention"] + p["norms"]
    moe_layers = (base.n_layer - dense) * (per_layer + p["router"] + moe_mlp)
    return p["embedding"] + p["position"] + p["final_norm"] + p["head"] + moe_layers + dense * (per_layer + p["mlp"])


def moe_flops_per_token(config, seq: int | None = None, training: bool = True) -> float:
    """Matmul FLOPs per token of an MoEConfig with shared experts, expert size and dense layers
    (course_lib.estimate.compute.flops_per_token's rule, which it equals for a plain MoEConfig):

        forward = 2 * [L * A + dense * F + (L - dense) * (R + (top_k + S) * X) + V d] + 4 L s d
        A attention matrices, F the dense MLP, R = d E the router, X one expert's matrices
    Fine-grained experts (course_lib.model.moe_config.fine_grained) keep (top_k + S) * X, so they
    change only R. Training = 3 * forward."""
    shape = model_shape(config)
    base, top_k = shape.base, shape.top_k
    s = positive_int("seq", base.block_size if seq is None else seq)
    p = param_breakdown(config)
    d, L, V = base.d_model, base.n_layer, base.vocab_size
    fe = getattr(config, "d_expert", None) or ff_dim(base)
    gpt = isinstance(base, GPTConfig)
    attn = p["attention"] if not gpt or getattr(config, "attention_params", None) else 4 * d * d
    dense_mlp, expert = (2 * d * ff_dim(base), 2 * d * fe) if gpt else (p["mlp"], 3 * d * fe)
    dense = getattr(config, "first_dense_layers", 0)
    n_mm = L * attn + dense * dense_mlp + (L - dense) * (p["router"] + (top_k + _n_shared(config)) * expert) + V * d
    forward = 2 * n_mm + 4 * L * s * d
    return 3 * forward if training else forward


