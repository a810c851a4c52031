"""Exercise 11: predict one optimizer step's time, term by term. Fill in `step_time_dp_tp`, then
run the check cells of ex11_step_time.ipynb. Each check prints PASS when your code is right.

The inputs your model needs, all imported below:

    flops_per_token(config, seq)          the training FLOPs of one token (notebook 01)
    collective_time(link, op, nbytes, n)  seconds of one collective `op` ("all_reduce", ...) of
                                          nbytes over n ranks on a link (notebook 02's alpha-beta
                                          cost, or a measured table on a calibrated cluster)
    per_gpu_memory(config, batch, seq, recipe, zero_stage, dp, tp, pp)["params_on_gpu"]
                                          how many parameters one device holds
    RECIPES[recipe].grad                  bytes of one gradient element
    cluster.link(size, stride)            the link a group of `size` ranks `stride` apart crosses
    cluster.achievable_flops, cluster.layer_overhead, cluster.overlap   (see the docstring)
"""

from course_lib.comm.measured import collective_time  # noqa: F401
from course_lib.estimate import RECIPES, flops_per_token, per_gpu_memory  # noqa: F401


def step_time_dp_tp(config, cluster, dp: int, tp: int, micro_batch: int, m: int = 1, pp: int = 1, v: int = 1,
                    seq: int | None = None, recipe: str = "bf16_mixed") -> dict:
    """Predicted seconds of one optimizer step of `config` on `cluster`, by term.

    The layout: dp * tp * pp devices, numbered tp innermost, then dp, then pp (notebook 10's
    mesh). Each data-parallel replica runs m micro-batches of `micro_batch` sequences of `seq`
    tokens (default config.block_size) through pp pipeline stages of n_layer / pp layers,
    scheduled by 1F1B (v = 1) or by interleaved 1F1B with v model chunks per rank (notebook 06).
    No ZeRO, no recomputation. Activations and their gradients travel as 4-byte elements
    for recipe "fp32", else 2-byte ones.

    Return a dict of seconds with these keys:

        compute     the step's model FLOPs, shared evenly by all devices, at the cluster's
                    achievable FLOP/s
        overhead    the fixed cost of launching this rank's layers: cluster.layer_overhead per
                    layer and micro-batch, counting the embedding, head and loss together as
                    one more layer
        tp          Megatron's tensor-parallel all-reduces (notebook 05's f and g) in this
                    rank's layers over the whole step: they sit on the critical path. Leave out
                    the embedding's, the head's and the loss's
        dp_total    the data-parallel all-reduce of this device's gradients, once per step
        dp_exposed  how much of dp_total the step waits for. It can run only beside backward
                    work that comes after the gradients are final (earlier micro-batches run
                    without synchronising, notebook 03), and only for the fraction
                    cluster.overlap of that work. Derive how long that backward work is
        bubble      the seconds this rank spends idle under the schedule while the pipeline
                    fills and drains (0 without a pipeline). Notebook 06 gives the idle
                    fraction of the step; derive the seconds from this rank's busy time
                    (compute + overhead + tp)
        total       the step: compute + overhead + tp + dp_exposed + bubble
    """
    raise NotImplementedError("exercise 11: write step_time_dp_tp")
