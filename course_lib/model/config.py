"""The GPT's shape, GPTConfig, and its closed-form parameter count: pure Python, no torch.

The estimator (course_lib.estimate) reads model shapes from here, so it imports and runs where
torch is not installed; gpt.py builds the torch model from the same config (its docstring
derives the parameter count that expected_num_params evaluates).

    GPTConfig            the fields and their checks; tiny() is the tests' and notebooks' model
    ModelShape           the read-only shape the rule book (course_lib.dims) and the estimator
                         read, GPTConfig.shape (the estimator's configs have a .shape too)
    expected_num_params  the count of gpt.py's docstring (GPT.num_params counts real tensors)
    ATTN_IMPLS           the attention implementations: "naive" or "fused"
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from course_lib._validate import check_int

ATTN_IMPLS = ("naive", "fused")


@dataclass(frozen=True)
class ModelShape:
    """What a layout's rules and costs read of a model, one vocabulary for every config form:
    n_experts = 0 is the dense model (one MLP per block), n_experts = E > 0 a router and E expert
    MLPs per block, top_k of them per token (1 when dense). `config` is the config it views and
    `base` its architecture (the config itself, or an estimate MoEConfig's base): the formulas
    that need more than the shape (biases, tied head, SwiGLU) read them; they do not take part
    in ==. Here, beside GPTConfig, so that both course_lib.parallel (which runs a GPTConfig) and
    course_lib.estimate (which costs any config form) read it without torch; course_lib.dims
    reads its fields (ParallelDims.check_model) without importing it."""

    n_layer: int
    n_head: int
    n_kv_head: int  # key/value heads: n_head without grouped-query attention
    d_model: int
    ff_dim: int
    vocab_size: int
    block_size: int
    n_experts: int = 0
    top_k: int = 1
    config: object = field(default=None, compare=False, repr=False)
    base: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_kv_head", "d_model", "ff_dim", "vocab_size", "block_size", "top_k"):
            check_int(name, getattr(self, name))
        check_int("n_experts", self.n_experts, minimum=0, rule="an int >= 0 (0 = dense MLP)")
        if self.top_k > max(self.n_experts, 1):
            raise ValueError(f"top_k={self.top_k} must be <= n_experts={self.n_experts} (1 for a dense model)")

    @property
    def shape(self) -> "ModelShape":
        """Itself: whatever takes a config's .shape takes a shape."""
        return self

    @property
    def mlps(self) -> int:
        """MLPs per block: the n_experts experts, or the dense model's one."""
        return max(self.n_experts, 1)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 97  # course_lib.data.VOCAB_SIZE: the course's fixed alphabet
    block_size: int = 64  # context length: the longest sequence the model accepts
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    d_ff: int | None = None  # None means 4 * d_model, as in GPT-2
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms
    tie_weights: bool = True  # head.weight is tok_emb.weight
    attn_impl: str = "naive"  # "naive" (explicit T x T scores) or "fused" (one kernel, F.scaled_dot_product_attention)
    # Mixture of experts (course_lib/model/moe.py, notebook 07). n_experts = 0 is the dense model;
    # n_experts > 0 turns every block's MLP into a router plus n_experts expert MLPs.
    n_experts: int = field(default=0, repr=False)
    top_k: int = field(default=1, repr=False)  # experts per token
    capacity_factor: float | None = field(default=None, repr=False)  # None: no token is dropped
    aux_loss_coef: float = field(default=0.01, repr=False)  # Switch load-balancing loss weight
    z_loss_coef: float = field(default=0.001, repr=False)  # router z-loss weight
    # Grouped-query attention (Ainslie et al. 2023): n_kv_head key/value heads, each shared by
    # n_head / n_kv_head query heads. None means n_head (multi-head attention, every model before it).
    n_kv_head: int | None = field(default=None, repr=False)

    def __repr__(self):  # a dense config prints as it always did; an MoE or GQA config adds its fields
        shown = [f for f in fields(self) if f.repr or self.n_experts or (f.name == "n_kv_head" and self.n_kv_head)]
        return f"GPTConfig({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            check_int(name, getattr(self, name))
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, rule="a positive int or None (= 4*d_model)")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_kv_head is not None:
            check_int("n_kv_head", self.n_kv_head, rule="a positive int dividing n_head, or None (= n_head)")
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}: each key/value "
                                 f"head is shared by a whole group of n_head / n_kv_head query heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must satisfy 0 <= dropout < 1")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r} must be one of {ATTN_IMPLS}")
        check_int("n_experts", self.n_experts, minimum=0, rule="an int >= 0 (0 = dense MLP)")
        if self.n_experts:
            if not 1 <= check_int("top_k", self.top_k, minimum=None) <= self.n_experts:
                raise ValueError(f"top_k={self.top_k!r} must satisfy 1 <= top_k <= n_experts={self.n_experts}")
            cf = self.capacity_factor
            if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
                raise ValueError(f"capacity_factor={cf!r} must be > 0, or None for no capacity limit")
            for name in ("aux_loss_coef", "z_loss_coef"):
                if not getattr(self, name) >= 0:
                    raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """The key/value heads: n_kv_head, or n_head when it is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def kv_dim(self) -> int:
        """The width of K (and of V): kv_heads * d_head, d_model without grouped-query attention."""
        return self.kv_heads * self.d_head

    @property
    def ff_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def shape(self) -> ModelShape:
        """The read-only view the rule book and the estimator share (ModelShape)."""
        moe = self.n_experts > 0
        return ModelShape(self.n_layer, self.n_head, self.kv_heads, self.d_model, self.ff_dim, self.vocab_size,
                          self.block_size, self.n_experts, self.top_k if moe else 1, config=self, base=self)

    @classmethod
    def tiny(cls, vocab_size: int = 97, **overrides) -> "GPTConfig":
        """The small model of tests and notebooks (~0.1M params). The dataset decides
        vocab_size; other fields may be overridden: tiny(V, attn_impl="fused")."""
        base = cls(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=4, d_model=64)
        return replace(base, **overrides)


def expected_num_params(config: GPTConfig) -> int:
    """The closed-form parameter count of course_lib.model.gpt's docstring."""
    d, f, b, g = config.d_model, config.ff_dim, int(config.bias), config.kv_dim
    per_block = 2 * d * d + 2 * d * g + 2 * d * f + 2 * d + b * (5 * d + 2 * g + f)
    if config.n_experts:  # n_experts expert MLPs (2df + b(f + d) each) and a d x n_experts router
        per_block += (config.n_experts - 1) * (2 * d * f + b * (f + d)) + d * config.n_experts
    total = config.n_layer * per_block + config.vocab_size * d + config.block_size * d
    total += d + b * d  # ln_f
    if not config.tie_weights:
        total += config.vocab_size * d  # separate head matrix
    return total
