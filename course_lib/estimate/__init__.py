"""Formulas for memory, FLOPs and time (notebook 01 onwards): pure Python, no process started.
What runs ranks to check them (calibration, measured memory, validation) is course_lib.measure,
which sits above this package.

    params.py       model shapes (GPT, Llama-like, MoE), presets, exact parameter counts
    memory.py       model state by precision recipe and ZeRO stage (per-parameter stage 3 and
                    HSDP too); activations
    compute.py      FLOPs per token, 6PD, time to train, GPUs needed
    per_gpu.py      everything above on the busiest GPU of a dp x ep x cp x tp x pp layout;
                    zero_units / composed_zero_memory: ZeRO-2/3 composed with pp and tp
    calculator.py   the per-GPU memory and time-to-train calculator (figure; calculator_widget.py: widget)
    cluster.py      Cluster: devices, links, measured rates
    traffic/        each mesh axis's collectives of one step, as records (notebook 10 sums their
                    bytes, the step-time model prices them)
    step_time.py    the step-time model of a layout (course_lib.dims.ParallelDims) on a cluster
                    (notebook 11), memory per rank
    context.py      context parallelism (notebook 09): causal work per rank, the ring's exposed
                    time, cp_costs (the widget's activations and bytes per rank)
    planner.py      the search over layouts, ranked by predicted step time, with its explanation
    clusters.py     GPU clusters and published runs (LONG_CONTEXT: Llama 3's 128K stage,
                    published_estimate: the estimator on one of them)
    planner_figures.py   the planner's figures and widget

Every function stays importable as `course_lib.estimate.<name>`. Bytes are printed in IEC
units (`fmt_bytes` is `course_lib.units.fmt_bytes`: GiB = 2**30 bytes); `GB` (10**9 bytes) is
only for quoting a spec sheet (an "80 GB" GPU holds 80 * GB bytes = 74.5 GiB).
"""

from course_lib.estimate.compute import flops_per_token, fmt_duration, gpus_needed, training_flops, training_time
from course_lib.estimate.memory import (ATTENTION, RECIPES, RECOMPUTE, ZERO_STAGES, Recipe, activation_bytes,
                                        model_state_bytes, per_param_memory)
from course_lib.estimate.params import (COURSE_GPT, GPT3_175B, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, PRESETS,
                                        LlamaLikeConfig, MoEConfig, param_breakdown, param_count)
from course_lib.estimate.per_gpu import per_gpu_memory
from course_lib.units import GB, GiB, fmt_bytes

__all__ = ["LlamaLikeConfig", "MoEConfig", "param_breakdown", "param_count", "Recipe", "model_state_bytes",
           "per_param_memory", "activation_bytes", "flops_per_token", "training_flops", "training_time", "gpus_needed",
           "per_gpu_memory", "fmt_bytes", "fmt_duration", "GB", "GiB", "COURSE_GPT", "GPT3_175B", "LLAMA3_8B",
           "LLAMA3_70B", "LLAMA3_405B", "PRESETS", "RECIPES", "ZERO_STAGES", "RECOMPUTE", "ATTENTION"]
