"""Exercise 11, reference solution: the step time of a DP x TP (x PP) layout."""

from course_lib.comm.measured import collective_time
from course_lib.estimate import RECIPES, flops_per_token, per_gpu_memory


def step_time_dp_tp(config, cluster, dp: int, tp: int, micro_batch: int, m: int = 1, pp: int = 1, v: int = 1,
                    seq: int | None = None, recipe: str = "bf16_mixed") -> dict:
    """compute + fixed overhead + tp all-reduces + exposed dp all-reduce + the bubble (see the stub)."""
    seq = config.block_size if seq is None else seq
    e = 4 if recipe == "fp32" else 2
    devices = dp * tp * pp
    tokens = dp * m * micro_batch * seq
    compute = flops_per_token(config, seq) * tokens / (devices * cluster.achievable_flops)
    layers = config.n_layer // pp  # this rank's layers, over its v chunks
    overhead = (layers + 1) * m * cluster.layer_overhead
    # Megatron's f and g: two all-reduces of the residual stream forward, two backward, per layer
    activation = micro_batch * seq * config.d_model * e
    tp_time = 4 * layers * m * collective_time(cluster.link(tp, 1), "all_reduce", activation, tp)
    # tp innermost: a dp group's ranks sit tp apart
    params = per_gpu_memory(config, micro_batch, seq, recipe, 0, dp, tp, pp)["params_on_gpu"]
    dp_total = collective_time(cluster.link(dp, tp), "all_reduce", params * RECIPES[recipe].grad, dp)
    # backward is 2/3 of the FLOPs (notebook 01: 2 per parameter and token forward, 4 backward);
    # the gradients are final only in the last micro-batch's backward, so only that one hides them
    last_backward = (2 / 3) * compute / m
    dp_exposed = max(0.0, dp_total - cluster.overlap * last_backward)
    busy = compute + overhead + tp_time
    # the schedule idles a fraction f = (pp - 1) / (v m + pp - 1) of the whole step, so the step
    # is busy / (1 - f) and the bubble busy * f / (1 - f) = busy * (pp - 1) / (v m)
    bubble = busy * (pp - 1) / (v * m)
    return {"compute": compute, "overhead": overhead, "tp": tp_time, "dp_total": dp_total, "dp_exposed": dp_exposed,
            "bubble": bubble, "total": busy + dp_exposed + bubble}
