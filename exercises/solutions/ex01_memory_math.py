"""Reference solution for exercise 01 (kept apart from the learner's stubs)."""

import math

BYTES = {"fp32": (4, 4, 8), "bf16_mixed": (2, 2, 12), "bf16_fp32_accum": (2, 6, 12)}  # param, grad, optimizer


def gpt_param_count(n_layer: int, d_model: int, vocab_size: int, block_size: int, tie_weights: bool = True) -> int:
    d = d_model
    per_block = 12 * d * d + 13 * d  # 4d^2 attention + 8d^2 MLP weights; 4d + 5d biases; 4d LayerNorm
    total = n_layer * per_block + vocab_size * d + block_size * d + 2 * d  # embeddings, final LayerNorm
    return total + (0 if tie_weights else vocab_size * d)


def state_bytes_per_param(recipe: str, zero_stage: int, dp: int) -> float:
    param, grad, opt = BYTES[recipe]
    return (param / dp if zero_stage >= 3 else param) + (grad / dp if zero_stage >= 2 else grad) + (
        opt / dp if zero_stage >= 1 else opt)


def min_gpus_zero3(n_params: int, recipe: str, gpu_bytes: float) -> int:
    per_param = sum(BYTES[recipe])
    dp = max(1, math.ceil(n_params * per_param / gpu_bytes))  # the smallest dp the average allows
    while math.ceil(n_params / dp) * per_param > gpu_bytes:  # rounding the shard up may need one more
        dp += 1
    return dp


def activation_bytes_per_layer(batch: int, seq: int, d_model: int, n_head: int) -> int:
    n, d, f = batch * seq, d_model, 4 * d_model
    per_token = 4 * (8 * d + 2 * f)  # ln1, qkv in, q, k, v, proj in, ln2, fc in; GELU in and out
    attention = 4 * n_head * seq * seq * batch  # softmax output
    return n * per_token + attention + seq * seq + 16 * n  # + bool causal mask + LayerNorm stats


def training_flops(n_params: float, n_tokens: float) -> float:
    return 6 * n_params * n_tokens


def gpu_days(total_flops: float, peak_flops: float, mfu: float) -> float:
    return total_flops / (peak_flops * mfu) / 86400
