"""Exercise 01: plan a training layout with the memory and FLOPs arithmetic of notebook 01.
Fill in the five functions, then run the check cells of ex01_memory_math.ipynb. Each check
prints PASS when your answer is right.

Write parts 1, 2 and 5 as plain arithmetic: this file may not import course_lib.estimate
(it holds the answers). For parts 3 and 4 you choose a layout: try candidates in the notebook
with course_lib.estimate.per_gpu_memory (the notebook shows how), then return the one you chose
here. Many layouts are right: the checks test the rules, not one answer.

GPU memory: an H100 has "80 GB" on its spec sheet: 80 * 10**9 bytes (= 74.5 GiB).
"""


def state_bytes_per_gpu(n_params: int, recipe: str, zero_stage: int, dp: int) -> int:
    """Bytes of model state (params + grads + optimizer) ONE GPU holds, training n_params
    parameters with AdamW under `recipe` ("fp32", "bf16_mixed", "bf16_fp32_accum" or
    "bf16_autocast": notebook 01 §2 gives what each keeps per parameter) and ZeRO
    `zero_stage` (0-3) over `dp` data-parallel ranks.

    A buffer that ZeRO shards is split into dp equal shards of whole elements: when dp does not
    divide n_params, the last shard is padded, so every rank holds the same number of elements.
    Returns an int (bytes are whole)."""
    raise NotImplementedError("exercise 01: write state_bytes_per_gpu")


def needs_offload(n_params: float, n_gpus: int, gpu_bytes: float, bytes_per_param: int = 16) -> bool:
    """True when the model state (bytes_per_param bytes for each of n_params parameters) cannot
    fit in the GPUs' memory however it is split over the n_gpus GPUs of gpu_bytes each, before
    a single activation. Then part of the state must leave the GPUs (optimizer offload to CPU
    memory) or the job needs more GPUs. n_params may be a float such as 70.6e9."""
    raise NotImplementedError("exercise 01: write needs_offload")


def plan_70b_on_8_gpus() -> dict:
    """A layout that trains Llama-3 70B (course_lib.estimate.LLAMA3_70B) on ONE node of 8 H100s
    (80 GB each), micro-batch 1 of 4,096 tokens, bf16 mixed precision with AdamW.

    Return {"dp": .., "tp": .., "pp": .., "zero_stage": 0-3, "recompute": "none" | "selective"
    | "full", "offload": "none" | "optimizer"} such that dp * tp * pp == 8, the estimator accepts
    the layout, the busiest GPU needs at most 90% of 80 GB (the rest goes to the CUDA context,
    communication buffers and fragmentation), and whatever is offloaded fits the node's 2 TB
    (2 * 10**12 bytes) of CPU memory in total over its 8 GPUs."""
    raise NotImplementedError("exercise 01: write plan_70b_on_8_gpus")


def plan_70b_on_64_gpus() -> dict:
    """The same model and batch on 8 nodes of 8 H100s (64 GPUs), WITHOUT offload.

    Same keys and the same 90% rule; dp * tp * pp == 64; offload must be "none"; and tensor
    parallelism must stay inside one node (tp divides 8), because it communicates in every
    layer and only NVLink inside a node is fast enough for that."""
    raise NotImplementedError("exercise 01: write plan_70b_on_64_gpus")


def training_days(n_params: float, n_tokens: float, n_gpus: int, peak_flops: float, mfu: float) -> float:
    """Wall-clock days to train on n_gpus by the 6 * P * D rule, each GPU running at
    mfu * peak_flops FLOP/s, with perfect scaling."""
    raise NotImplementedError("exercise 01: write training_days")
