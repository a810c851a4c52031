"""Exercise 10: the step time of a DP x TP (x PP) layout. Fill in `step_time_dp_tp`, then run
the check cells of ex10_step_time.ipynb. Each check prints PASS when your code is right.

Tools you may use (all imported below): `flops_per_token(config, seq)` (training FLOPs per
token), `collective_time(link, "all_reduce", nbytes, n)` (one all-reduce of nbytes over n ranks
on a link: the alpha-beta ring formula on a LinkModel, the measured time on a calibrated
table), `per_gpu_memory(config, batch, seq, recipe, zero_stage, dp, tp, pp)["params_on_gpu"]`
(the parameters one device holds), `RECIPES[recipe].grad` (bytes per gradient element) and
`cluster.link(size, stride)` (the link a group of `size` ranks `stride` apart crosses).
"""

from course_lib.comm.measured import collective_time  # noqa: F401
from course_lib.estimate import RECIPES, flops_per_token, per_gpu_memory  # noqa: F401


def step_time_dp_tp(config, cluster, dp: int, tp: int, micro_batch: int, m: int = 1, pp: int = 1,
                    seq: int | None = None, recipe: str = "bf16_mixed") -> dict:
    """Seconds of one optimizer step: {"compute", "overhead", "tp", "dp_total", "dp_exposed", "bubble",
    "total"}.

    The layout: dp * tp * pp devices (tp innermost, then dp, then pp), m micro-batches of
    `micro_batch` sequences of `seq` tokens (default config.block_size) per replica, so the
    global batch is dp * m * micro_batch sequences. Activations and gradients travel with
    e = 4 bytes per element for recipe "fp32", else 2.

        compute     all the step's training FLOPs / (devices * cluster.achievable_flops)
        overhead    the fixed cost of this rank's layers: (n_layer / pp + 1) * m *
                    cluster.layer_overhead (the +1: embedding, head and loss, one layer's worth)
        tp          4 ring all-reduces per layer of this rank (n_layer / pp of them) and per
                    micro-batch, each of one activation micro_batch * seq * d_model * e bytes,
                    over the tp group (tp ranks, stride 1); on the critical path
        dp_total    one ring all-reduce of this device's gradients (params_on_gpu * grad bytes)
                    over the dp group (dp ranks, stride tp)
        dp_exposed  what backward does not hide: max(0, dp_total - overlap * backward / m),
                    backward being 2/3 of compute and overlap = cluster.overlap (only the last
                    micro-batch's backward runs after the gradients are final)
        bubble      1F1B's idle time: busy * f / (1 - f), busy = compute + overhead + tp,
                    f = (pp - 1) / (m + pp - 1)
        total       compute + overhead + tp + dp_exposed + bubble
    """
    raise NotImplementedError("exercise 10: write step_time_dp_tp")
