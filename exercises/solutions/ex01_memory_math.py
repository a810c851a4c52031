"""Reference solution for exercise 01 (kept apart from the learner's stubs)."""

BYTES = {"fp32": (4, 4, 8), "bf16_mixed": (2, 2, 12), "bf16_fp32_accum": (2, 6, 12),
         "bf16_autocast": (4, 4, 8)}  # param, grad (+ fp32 accumulation buffer), optimizer


def state_bytes_per_gpu(n_params: int, recipe: str, zero_stage: int, dp: int) -> int:
    param, grad, opt = BYTES[recipe]
    shard = -(-n_params // dp)  # ceil: every rank holds the same number of elements, the last padded
    return (param * (shard if zero_stage >= 3 else n_params) + grad * (shard if zero_stage >= 2 else n_params)
            + opt * (shard if zero_stage >= 1 else n_params))


def needs_offload(n_params: float, n_gpus: int, gpu_bytes: float, bytes_per_param: int = 16) -> bool:
    return n_params * bytes_per_param / n_gpus > gpu_bytes  # the best case: perfectly sharded state


def plan_70b_on_8_gpus() -> dict:
    # 70.6e9 x 16 B = 1.13e12 B of state > 8 x 80e9 B: the optimizer state (12 B/param, 847e9 B)
    # must go to CPU memory. What stays is 4 B/param = 282e9 B: tp=8 splits it into 35e9 B per
    # GPU, and divides the activations by 8 too (sequence parallelism): 49e9 B in all.
    return {"dp": 1, "tp": 8, "pp": 1, "zero_stage": 0, "recompute": "selective", "offload": "optimizer"}


def plan_70b_on_64_gpus() -> dict:
    # tp=8 inside each node, dp=8 across the nodes with ZeRO-1 sharding the optimizer state:
    # (2 + 2 + 12/8) B x 70.6e9 / 8 = 48.5e9 B of state per GPU, plus 13.9e9 B of activations
    # (selective recomputation, divided by tp) = 62.4e9 B <= 72e9 B.
    return {"dp": 8, "tp": 8, "pp": 1, "zero_stage": 1, "recompute": "selective", "offload": "none"}


def training_days(n_params: float, n_tokens: float, n_gpus: int, peak_flops: float, mfu: float) -> float:
    return 6 * n_params * n_tokens / (n_gpus * peak_flops * mfu) / 86400
