"""Exercise 11's checkers: a learner's step-time model of a dp x tp (x pp) layout.

    check_no_pipeline(fn)      every term of six dp x tp layouts of two published models: four on
                               large clusters, two on two 8-GPU nodes where the groups' strides
                               decide which link they cross, with a fixed cost per layer
    check_pipeline(fn)         the bubble under 1F1B and interleaved 1F1B (a property, then values)
    check_exposed_dp(fn)       the part of the data-parallel all-reduce backward does not hide
    check_measured(fn)         the two-core calibration: the four measured dp x tp runs, ordered
    REFUSED                    where the answer lives (load_student's refuse)

`fn` is the learner's `step_time_dp_tp(config, cluster, dp, tp, micro_batch, m, pp, v, seq,
recipe)`, returning a dict of seconds (TERMS). No expected value is stored: each is evaluated at
check time (`expected_terms`) from the same building blocks the learner is given
(flops_per_token, per_gpu_memory, collective_time, cluster.link), so the check follows them if
the course's numbers change. A term that differs is matched against the plausible mistakes
(MISTAKES, the same formula with one choice changed): when one fits, the message names it; the
learner's value is shown, the expected one never.
"""

from __future__ import annotations

import math
from dataclasses import replace

from course_lib.comm.measured import collective_time
from course_lib.estimate import GPT3_175B, LLAMA3_70B, RECIPES, flops_per_token, per_gpu_memory
from course_lib.estimate.clusters import gpu_cluster
from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.measure.validation import load_validation

# The step-time model, the planner built on it and the comparison with measured runs all hold
# this exercise's answer, and so does this module: where it lives, named once; a re-export of them
# (course_lib.estimate.plan) and any helper that wraps them is refused by derivation
# (course_lib/grading/refusal.py).
REFUSED = ("course_lib.estimate.step_time", "course_lib.estimate.planner", "course_lib.estimate.planner_figures",
           "course_lib.measure.validation", "course_lib.grading.ex11_step_time")

TERMS = ("compute", "overhead", "tp", "dp_total", "dp_exposed", "bubble", "total")
# The same formulas evaluated in another order differ by float64 rounding, a few 1e-16 relative
# per operation; 1e-9 is far above that and far below the smallest modelling slip (a left-out
# all-reduce changes a term by more than 0.1%).
RTOL = 1e-9
ATOL = 1e-12  # seconds: lets a term that is exactly 0 be 0.0 or -0.0; every nonzero term is > 1e-3 s

A100_1024 = ("A100 SXM 80 GB", 1024)
H100_512 = ("H100 SXM 80 GB", 512)

# A fixed cost per layer and micro-batch for the layouts that test the overhead term (the GPU
# clusters' own is 0): 20 microseconds, a few kernel launches, large enough that a layer or a
# micro-batch counted wrong moves the total by more than RTOL
LAYER_OVERHEAD = 20e-6
H100_16 = ("H100 SXM 80 GB", 16)  # two nodes of 8: a group of 4 ranks 4 apart crosses InfiniBand
# (model, cluster, seq, layout) for check_no_pipeline: the first four put every group of more than
# 8 ranks on InfiniBand whatever its stride; the last two sit on two nodes, where the data-parallel
# group (ranks tp apart) crosses nodes and the tensor-parallel one (adjacent ranks) does not
NO_PIPELINE = (
    ("GPT-3 175B", A100_1024, 2048, dict(dp=128, tp=8, micro_batch=1, m=12)),
    ("GPT-3 175B", A100_1024, 2048, dict(dp=512, tp=2, micro_batch=2, m=1)),
    ("Llama-3 70B", H100_512, 4096, dict(dp=64, tp=8, micro_batch=2, m=4)),
    ("Llama-3 70B", H100_512, 4096, dict(dp=256, tp=2, micro_batch=1, m=2)),
    ("Llama-3 70B", H100_16, 4096, dict(dp=4, tp=4, micro_batch=1, m=4)),
    ("Llama-3 70B", H100_16, 4096, dict(dp=8, tp=2, micro_batch=2, m=2)),
)
PIPELINE = ((8, 1), (16, 1), (64, 1), (16, 2))  # GPT-3 175B on 1024 A100, dp16 tp8 pp8: (m, v)
EXPOSED = ((1.0, 8, 1), (1.0, 1, 8), (0.25, 8, 1))  # Llama-3 70B on 512 H100, dp64 tp8: (overlap, micro_batch, m)
MEASURED = {  # the stored 8-rank calibration, fp32, 16 sequences of 32 tokens
    "DDP dp8": dict(dp=8, tp=1, micro_batch=2), "dp4 x tp2": dict(dp=4, tp=2, micro_batch=4),
    "dp2 x tp4": dict(dp=2, tp=4, micro_batch=8), "TP tp8": dict(dp=1, tp=8, micro_batch=16)}
MODELS = {"GPT-3 175B": GPT3_175B, "Llama-3 70B": LLAMA3_70B}
# where to look when a term is wrong (a question, not the answer)
HINTS = {"compute": "how many tokens does the whole step process, and on how many devices?",
         "overhead": "how many layers does this rank run, in how many micro-batches?",
         "tp": "how many all-reduces per layer and micro-batch (forward and backward), of how many bytes, "
               "over which link?",
         "dp_total": "how many gradients does one device hold, and which ranks form its data-parallel group?",
         "dp_exposed": "which backward work runs after the gradients are final, and how long is it?",
         "bubble": "notebook 06's bubble fraction is a share of which time: the busy time or the whole step?",
         "total": "the total is the sum of the terms the step waits for"}



def expected_terms(config, cluster, dp, tp, micro_batch, m=1, pp=1, v=1, seq=None, recipe="bf16_mixed", *,
                   dp_stride=None, tp_stride=1, per_micro_batch=True, rank_layers=True, extra_layer=1,
                   tp_calls=4, hide_with="last", bubble_of="step", chunks=True) -> dict:
    """The terms of the stub's docstring, evaluated now. The keywords after `*` are the choices a
    model makes; their defaults are the right ones, MISTAKES lists the plausible wrong ones."""
    seq = config.block_size if seq is None else seq
    e = 4 if recipe == "fp32" else 2
    devices = dp * tp * pp
    compute = flops_per_token(config, seq) * dp * m * micro_batch * seq / (devices * cluster.achievable_flops)
    layers = config.n_layer // pp if rank_layers else config.n_layer
    overhead = (layers + extra_layer) * (m if per_micro_batch else 1) * cluster.layer_overhead
    activation = micro_batch * seq * config.d_model * e
    tp_link = cluster.link(tp, dp if tp_stride is None else tp_stride)
    tp_time = tp_calls * layers * m * collective_time(tp_link, "all_reduce", activation, tp)
    params = per_gpu_memory(config, micro_batch, seq, recipe, 0, dp, tp, pp)["params_on_gpu"]
    dp_link = cluster.link(dp, tp if dp_stride is None else dp_stride)
    dp_total = collective_time(dp_link, "all_reduce", params * RECIPES[recipe].grad, dp)
    backward = (2 / 3) * compute / (m if hide_with == "last" else 1)
    dp_exposed = dp_total if hide_with == "nothing" else max(0.0, dp_total - cluster.overlap * backward)
    busy = compute + overhead + tp_time
    vm = (v if chunks else 1) * m
    bubble = busy * (pp - 1) / vm if bubble_of == "step" else busy * (pp - 1) / (vm + pp - 1)
    return {"compute": compute, "overhead": overhead, "tp": tp_time, "dp_total": dp_total, "dp_exposed": dp_exposed,
            "bubble": bubble, "total": busy + dp_exposed + bubble}


# The plausible mistakes, each one choice of expected_terms changed, and what to say when a
# learner's term equals it (a term that fits none gets HINTS' question)
MISTAKES = (
    (dict(dp_stride=1), "your data-parallel all-reduce crosses the link of a group of adjacent ranks: in the mesh "
                        "tp is innermost, so which ranks form a data-parallel group, and how far apart are they?"),
    (dict(tp_stride=None), "your tensor-parallel all-reduce crosses the link of ranks dp apart: with tp innermost, "
                           "a tensor-parallel group's ranks are adjacent"),
    (dict(per_micro_batch=False), "your fixed cost is counted once per step: every micro-batch launches this "
                                  "rank's layers again"),
    (dict(rank_layers=False), "your fixed cost counts every layer of the model: a pipeline rank launches only "
                              "its own layers"),
    (dict(extra_layer=0), "your fixed cost leaves out the embedding, head and loss (counted together as one more "
                          "layer)"),
    (dict(rank_layers=False, extra_layer=0), "your fixed cost counts every layer of the model and leaves out the "
                                             "embedding, head and loss"),
    (dict(tp_calls=2), "your tensor-parallel time counts two all-reduces per layer: f and g each add one forward "
                       "and one backward"),
    (dict(hide_with="all"), "your all-reduce hides behind the whole step's backward: the gradients are final only "
                            "during the last micro-batch's backward"),
    (dict(hide_with="nothing"), "your data-parallel all-reduce is all exposed: backward after the gradients are "
                                "final hides the fraction cluster.overlap of it"),
    (dict(bubble_of="busy"), "your bubble takes notebook 06's fraction of the busy time: it is a fraction of the "
                             "whole step, which includes the bubble itself"),
    (dict(chunks=False), "your bubble ignores the interleaved schedule's v chunks per rank"),
)

def _batches(m: int, mb: int) -> str:
    return f"{m} micro-batch{'es' if m > 1 else ''} of {mb} sequence{'s' if mb > 1 else ''}"


def _call(fn, config, cluster, seq, recipe="bf16_mixed", **layout) -> dict:
    got = fn(config, cluster, seq=seq, recipe=recipe, **layout)
    if not isinstance(got, dict) or sorted(got) != sorted(TERMS):
        raise CheckFailed(f"step_time_dp_tp must return a dict with the keys {TERMS}, got "
                          f"{sorted(got) if isinstance(got, dict) else type(got).__name__}")
    total = got["compute"] + got["overhead"] + got["tp"] + got["dp_exposed"] + got["bubble"]
    if not math.isclose(got["total"], total, rel_tol=RTOL, abs_tol=ATOL):
        raise CheckFailed(f"total = {got['total']:.6g} s is not compute + overhead + tp + dp_exposed + bubble "
                          f"= {total:.6g} s")
    return got


def _match(label: str, got: dict, args: tuple, kw: dict, terms=TERMS):
    """Each of `terms` of the learner's dict against expected_terms(*args, **kw), evaluated now."""
    want = expected_terms(*args, **kw)
    for term in terms:
        if math.isclose(got[term], want[term], rel_tol=RTOL, abs_tol=ATOL):
            continue
        why = HINTS[term]
        for choice, message in MISTAKES:
            wrong = expected_terms(*args, **kw, **choice)[term]
            if not math.isclose(wrong, want[term], rel_tol=RTOL, abs_tol=ATOL) and \
                    math.isclose(got[term], wrong, rel_tol=RTOL, abs_tol=ATOL):
                why = message
                break
        raise CheckFailed(f"{label}: your {term} = {got[term]:.6g} s is not this layout's (in student.py's "
                          f"step_time_dp_tp)\n  ({why})")
    passed(f"{label}: {', '.join(terms)}")


def check_no_pipeline(fn):
    """Six dp x tp layouts, no pipeline, bf16: every term (a fixed cost per layer on the two-node ones)."""
    for model, (gpu, n), seq, kw in NO_PIPELINE:
        cluster = gpu_cluster(gpu, n)
        if n <= 16:
            cluster = replace(cluster, layer_overhead=LAYER_OVERHEAD)
        got = _call(fn, MODELS[model], cluster, seq, **kw)
        where = f"{n} {gpu.split()[0]}" + (f" (2 nodes, {LAYER_OVERHEAD * 1e6:g} us a layer)" if n <= 16 else "")
        _match(f"{model} on {where}, dp={kw['dp']} tp={kw['tp']}, {_batches(kw['m'], kw['micro_batch'])}", got,
               (MODELS[model], cluster, kw["dp"], kw["tp"], kw["micro_batch"], kw["m"]), dict(seq=seq))


def check_pipeline(fn):
    """GPT-3 175B cut into 8 stages, a fixed cost of 20 us per layer: first a property (more
    micro-batches, a smaller share of the step idle), then every term for 1F1B at m = 8, 16, 64
    and interleaved 1F1B with v = 2."""
    cluster = replace(gpu_cluster(*A100_1024), layer_overhead=LAYER_OVERHEAD)
    got = {key: _call(fn, GPT3_175B, cluster, 2048, dp=16, tp=8, pp=8, micro_batch=1, m=key[0], v=key[1])
           for key in PIPELINE}
    share = [got[(m, 1)]["bubble"] / got[(m, 1)]["total"] for m in (8, 16, 64)]
    if not (share[0] > share[1] > share[2] > 0):
        raise CheckFailed(f"the bubble's share of the step at m = 8, 16, 64 is "
                          f"{', '.join(f'{s:.3f}' for s in share)}: it must be positive and fall as m grows")
    passed("the bubble's share of the step falls as the micro-batches grow in number")
    for m, v in PIPELINE:
        _match(f"pp=8, m={m}" + (f", interleaved v={v}" if v > 1 else ", 1F1B") + f", {LAYER_OVERHEAD * 1e6:g} us a layer",
               got[(m, v)], (GPT3_175B, cluster, 16, 8, 1, m, 8, v), dict(seq=2048))


def check_exposed_dp(fn):
    """Llama-3 70B, dp64 tp8: with no overlap everything is exposed (a property); then the same 8
    sequences per replica as 1 micro-batch of 8 and as 8 of 1, and with overlap 1/4."""
    h100 = gpu_cluster(*H100_512)
    none = _call(fn, LLAMA3_70B, replace(h100, overlap=0.0), 4096, dp=64, tp=8, micro_batch=8, m=1)
    if not math.isclose(none["dp_exposed"], none["dp_total"], rel_tol=RTOL, abs_tol=ATOL):
        raise CheckFailed(f"with cluster.overlap = 0 nothing hides the all-reduce: dp_exposed = "
                          f"{none['dp_exposed']:.6g} s must equal dp_total = {none['dp_total']:.6g} s")
    passed("overlap 0: the whole data-parallel all-reduce is exposed")
    for overlap, mb, m in EXPOSED:
        cluster = replace(h100, overlap=overlap)
        got = _call(fn, LLAMA3_70B, cluster, 4096, dp=64, tp=8, micro_batch=mb, m=m)
        _match(f"overlap {overlap:g}, {_batches(m, mb)}", got, (LLAMA3_70B, cluster, 64, 8, mb, m), dict(seq=4096),
               terms=("compute", "tp", "dp_total", "dp_exposed", "total"))


def check_measured(fn):
    """The 8-rank calibration of notebook 11, section 4 (fp32): every term of the four dp x tp
    runs, then the order of your predictions against the order the runs were measured in."""
    data = load_validation()
    measured = {r["label"]: r["measured"] for r in data["runs"]}
    predicted = {}
    for label, layout in MEASURED.items():
        got = _call(fn, data["config"], data["cluster"], data["seq"], "fp32", **layout)
        _match(f"{label} on the calibrated ranks", got,
               (data["config"], data["cluster"], layout["dp"], layout["tp"], layout["micro_batch"]),
               dict(seq=data["seq"], recipe="fp32"))
        predicted[label] = got["total"]
    check_equal("the four runs from fastest to slowest: predicted = measured",
                sorted(predicted, key=predicted.get), sorted(predicted, key=measured.get))
