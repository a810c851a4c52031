"""Exercise 10, reference solution: the step time of a DP x TP (x PP) layout."""

from course_lib.comm.measured import collective_time
from course_lib.estimate import RECIPES, flops_per_token, per_gpu_memory


def step_time_dp_tp(config, cluster, dp: int, tp: int, micro_batch: int, m: int = 1, pp: int = 1,
                    seq: int | None = None, recipe: str = "bf16_mixed") -> dict:
    """compute + fixed overhead + tp all-reduces + exposed dp all-reduce + the 1F1B bubble (see the stub)."""
    seq = config.block_size if seq is None else seq
    e = 4 if recipe == "fp32" else 2
    devices = dp * tp * pp
    tokens = dp * m * micro_batch * seq
    compute = flops_per_token(config, seq) * tokens / (devices * cluster.achievable_flops)
    overhead = (config.n_layer // pp + 1) * m * cluster.layer_overhead
    activation = micro_batch * seq * config.d_model * e
    tp_time = 4 * (config.n_layer // pp) * m * collective_time(cluster.link(tp, 1), "all_reduce", activation, tp)
    params = per_gpu_memory(config, micro_batch, seq, recipe, 0, dp, tp, pp)["params_on_gpu"]
    dp_total = collective_time(cluster.link(dp, tp), "all_reduce", params * RECIPES[recipe].grad, dp)
    dp_exposed = max(0.0, dp_total - cluster.overlap * (2 / 3) * compute / m)
    f = (pp - 1) / (m + pp - 1)
    bubble = (compute + overhead + tp_time) * f / (1 - f)
    return {"compute": compute, "overhead": overhead, "tp": tp_time, "dp_total": dp_total, "dp_exposed": dp_exposed,
            "bubble": bubble, "total": compute + overhead + tp_time + dp_exposed + bubble}
