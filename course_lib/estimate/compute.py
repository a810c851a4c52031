"""FLOPs and time to train (notebook 01, sections 4 and 5).

    flops_per_token(config, seq, causal, training)   matmul FLOPs, as FlopCounterMode counts them
    training_flops(n_params, n_tokens)               the 6 P D rule
    training_time / gpus_needed                      divide by GPUs x peak x MFU
    fmt_duration(seconds)
"""

from __future__ import annotations

import math

from course_lib.estimate.params import GPTConfig, ff_dim, kv_dim, model_shape, param_breakdown, positive_int



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
    shape = model_shape(config)
    base, top_k = shape.base, shape.top_k
    s = base.block_size if seq is None else seq
    s = positive_int("seq", s)
    p = param_breakdown(config)
    d, f, L, V = base.d_model, ff_dim(base), base.n_layer, base.vocab_size
    if isinstance(base, GPTConfig):  # q and proj d x d, k and v d x kv (kv = d without grouped-query attention)
        attn_mm, mlp_mm = 2 * d * d + 2 * d * kv_dim(base), 2 * d * f
    else:
        attn_mm, mlp_mm = p["attention"], p["mlp"]
    n_mm = L * (attn_mm + top_k * mlp_mm + p["router"]) + V * d
    attn = 4 * L * s * d * (0.5 if causal else 1.0)
    forward = 2 * n_mm + attn
    return 3 * forward if training else forward


def training_flops(n_params: float, n_tokens: float) -> float:
    """The 6*P*D rule (Kaplan et al. 2020): 2 FLOPs per parameter per token forward, 4 backward.
    It leaves out the attention term of `flops_per_token` (small while s << 6 d)."""
    for name, value in (("n_params", n_params), ("n_tokens", n_tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r} must be a number > 0")
    return 6.0 * n_params * n_tokens


def training_time(total_flops: float, n_gpus: int, peak_flops: float, mfu: float = 0.4) -> float:
    """Seconds = total_flops / (n_gpus * peak_flops * mfu). MFU (model FLOPs utilisation) is the
    achieved fraction of peak; large runs report 0.35-0.55."""
    n_gpus = positive_int("n_gpus", n_gpus)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must satisfy 0 < mfu <= 1")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops!r} must be > 0")
    return total_flops / (n_gpus * peak_flops * mfu)


def gpus_needed(total_flops: float, seconds: float, peak_flops: float, mfu: float = 0.4) -> int:
    """Fewest GPUs that finish `total_flops` within `seconds` (perfect scaling assumed)."""
    return math.ceil(total_flops / (seconds * peak_flops * mfu))


def fmt_duration(seconds: float) -> str:
    """'32.0 years', '23.4 days', '5.0 hours', '2.4 ms' style."""
    for unit, scale in (("years", 365.25 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
