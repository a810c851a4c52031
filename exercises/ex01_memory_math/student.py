"""Exercise 01: memory and FLOPs arithmetic. Fill in the six functions, then run the check cells
of ex01_memory_math.ipynb. Each check prints PASS when your function is right.

Use plain arithmetic (no course_lib.estimate: that is what the checks compare against).
Notebook 01 derives every formula you need."""


def gpt_param_count(n_layer: int, d_model: int, vocab_size: int, block_size: int, tie_weights: bool = True) -> int:
    """Exact parameter count of the course GPT (course_lib.model.GPT) with biases and
    d_ff = 4 * d_model: token and position embeddings, n_layer blocks (two LayerNorms with
    gain and bias, qkv and proj, fc and proj, all with biases), a final LayerNorm, and a
    vocab_size x d_model head only when it is not tied to the token embedding."""
    raise NotImplementedError("exercise 01: write gpt_param_count")


def state_bytes_per_param(recipe: str, zero_stage: int, dp: int) -> float:
    """Bytes of model state (params + grads + optimizer) ONE GPU holds per model parameter,
    training with AdamW under `recipe` and ZeRO `zero_stage` over `dp` data-parallel ranks.

    recipe: "fp32"             params 4, grads 4, optimizer 8 (m, v)
            "bf16_mixed"       params 2, grads 2, optimizer 12 (fp32 master, m, v)
            "bf16_fp32_accum"  params 2, grads 2 + 4 (fp32 accumulation buffer), optimizer 12
    ZeRO stage 1 shards the optimizer state over dp ranks, stage 2 also the gradients,
    stage 3 also the parameters (assume the parameter count divides evenly)."""
    raise NotImplementedError("exercise 01: write state_bytes_per_param")


def min_gpus_zero3(n_params: int, recipe: str, gpu_bytes: float) -> int:
    """The smallest number of data-parallel GPUs dp for which the ZeRO-3 model state per GPU,
    ceil(n_params / dp) parameters' worth, fits in gpu_bytes (activations ignored)."""
    raise NotImplementedError("exercise 01: write min_gpus_zero3")


def activation_bytes_per_layer(batch: int, seq: int, d_model: int, n_head: int) -> int:
    """Bytes one layer of the course GPT saves for backward in fp32 (naive attention, no
    dropout, d_ff = 4 * d_model): the per-token tensors, the attention weights, the bool
    causal mask (seq x seq, one per layer) and the LayerNorm statistics (two norms, each an
    fp32 mean and rstd per token)."""
    raise NotImplementedError("exercise 01: write activation_bytes_per_layer")


def training_flops(n_params: float, n_tokens: float) -> float:
    """Total training FLOPs by the 6 * P * D rule."""
    raise NotImplementedError("exercise 01: write training_flops")


def gpu_days(total_flops: float, peak_flops: float, mfu: float) -> float:
    """GPU-days of work: days one GPU running at mfu * peak_flops FLOP/s needs for total_flops
    (divide by the number of GPUs for the wall-clock days of a perfectly scaled run)."""
    raise NotImplementedError("exercise 01: write gpu_days")
