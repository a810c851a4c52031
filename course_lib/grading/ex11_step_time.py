"""Exercise 11's checkers: a learner's step-time model of a dp x tp (x pp) layout.

    check_no_pipeline(fn)      every term of four dp x tp layouts of two published models
    check_pipeline(fn)         the bubble under 1F1B and interleaved 1F1B (a property, then values)
    check_exposed_dp(fn)       the part of the data-parallel all-reduce backward does not hide
    check_measured(fn)         the two-core calibration: the four measured dp x tp runs, ordered
    REFUSED                    the library names that already hold the answer (load_student's refuse)

`fn` is the learner's `step_time_dp_tp(config, cluster, dp, tp, micro_batch, m, pp, v, seq,
recipe)`, returning a dict of seconds (TERMS). The expected values below are literals, computed
once, not recomputed here: see EXPECTED's comment.
"""

from __future__ import annotations

import math
from dataclasses import replace

from course_lib.estimate import GPT3_175B, LLAMA3_70B
from course_lib.estimate.clusters import gpu_cluster
from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.measure.validation import load_validation

# The step-time model, the planner built on it and the comparison with measured runs all hold
# this exercise's answer: where it lives, named once; a re-export of them (course_lib.estimate.plan)
# and any helper that wraps them is refused by derivation (course_lib/grading/refusal.py).
REFUSED = ("course_lib.estimate.step_time", "course_lib.estimate.planner", "course_lib.estimate.planner_figures",
           "course_lib.measure.validation")

TERMS = ("compute", "overhead", "tp", "dp_total", "dp_exposed", "bubble", "total")
# The same formulas evaluated in another order differ by float64 rounding, a few 1e-16 relative
# per operation; 1e-9 is far above that and far below the smallest modelling slip (a left-out
# all-reduce changes a term by more than 0.1%). The literals keep 12 significant digits.
RTOL = 1e-9
ATOL = 1e-12  # seconds: lets a term that is exactly 0 be 0.0 or -0.0; every nonzero term is > 1e-3 s

A100_1024 = ("A100 SXM 80 GB", 1024)
H100_512 = ("H100 SXM 80 GB", 512)

# Expected seconds, computed once (2026-11-26) by exercises/solutions/ex11_step_time.py on these
# inputs (course_lib.estimate's flops_per_token and per_gpu_memory, course_lib.comm's alpha-beta
# links and the calibration stored in course_lib/assets/planner_validation.json), rounded to 12
# significant digits. They agree with the course's full model (course_lib.estimate.step_time):
# compute exactly; tp, dp and the bubble within a few percent, as the full model also counts
# the embedding's, head's and loss's all-reduces, DDP's buckets and the pipeline's sends;
# tests/test_grading_ex11.py checks both.
EXPECTED = {
    # (model, cluster, seq, layout) -> terms
    ("GPT-3 175B", A100_1024, 2048, (("dp", 128), ("tp", 8), ("micro_batch", 1), ("m", 12))): {
        "compute": 14.1308511872, "overhead": 0.0, "tp": 1.54645069824, "dp_total": 3.4705572448,
        "dp_exposed": 2.68550995662, "bubble": 0.0, "total": 18.362811842},
    ("GPT-3 175B", A100_1024, 2048, (("dp", 512), ("tp", 2), ("micro_batch", 2), ("m", 1))): {
        "compute": 9.42056745811, "overhead": 0.0, "tp": 0.13115301888, "dp_total": 13.948746233,
        "dp_exposed": 7.66836792756, "bubble": 0.0, "total": 17.2200884045},
    ("Llama-3 70B", H100_512, 4096, (("dp", 64), ("tp", 8), ("micro_batch", 2), ("m", 4))): {
        "compute": 2.48064109095, "overhead": 0.0, "tp": 0.721866023822, "dp_total": 0.6952339296,
        "dp_exposed": 0.281793747775, "bubble": 0.0, "total": 3.48430086255},
    ("Llama-3 70B", H100_512, 4096, (("dp", 256), ("tp", 2), ("micro_batch", 1), ("m", 2))): {
        "compute": 2.48064109095, "overhead": 0.0, "tp": 0.0992837176889, "dp_total": 2.8137267936,
        "dp_exposed": 1.98684642995, "bubble": 0.0, "total": 4.56677123859},
}
PIPELINE = {  # GPT-3 175B on 1024 A100, dp16 tp8 pp8, micro-batches of 1 sequence: (m, v) -> terms
    (8, 1): {"compute": 1.17757093226, "overhead": 0.0, "tp": 0.12887089152, "dp_total": 0.423344112,
             "dp_exposed": 0.325213200978, "bubble": 1.14313659581, "total": 2.77479162057},
    (16, 1): {"compute": 2.35514186453, "overhead": 0.0, "tp": 0.25774178304, "dp_total": 0.423344112,
              "dp_exposed": 0.325213200978, "bubble": 1.14313659581, "total": 4.08123344436},
    (64, 1): {"compute": 9.42056745811, "overhead": 0.0, "tp": 1.03096713216, "dp_total": 0.423344112,
              "dp_exposed": 0.325213200978, "bubble": 1.14313659581, "total": 11.9198843871},
    (16, 2): {"compute": 2.35514186453, "overhead": 0.0, "tp": 0.25774178304, "dp_total": 0.423344112,
              "dp_exposed": 0.325213200978, "bubble": 0.571568297905, "total": 3.50966514645},
}
EXPOSED = {  # Llama-3 70B on 512 H100, dp64 tp8, 8 sequences per replica: (overlap, micro_batch, m) -> terms
    (1.0, 8, 1): {"compute": 2.48064109095, "tp": 0.681546023822, "dp_total": 0.6952339296, "dp_exposed": 0.0,
                  "total": 3.16218711477},
    (1.0, 1, 8): {"compute": 2.48064109095, "tp": 0.775626023822, "dp_total": 0.6952339296,
                  "dp_exposed": 0.488513838687, "total": 3.74478095346},
    (0.25, 8, 1): {"compute": 2.48064109095, "tp": 0.681546023822, "dp_total": 0.6952339296,
                   "dp_exposed": 0.281793747775, "total": 3.44398086255},
}
MEASURED = {  # the stored 8-rank calibration, fp32, 16 sequences of 32 tokens: label -> (layout, terms)
    "DDP dp8": (dict(dp=8, tp=1, micro_batch=2), {
        "compute": 0.0204344226488, "overhead": 0.0346075836738, "tp": 0.0, "dp_total": 0.0153006285472,
        "dp_exposed": 0.0153006285472, "bubble": 0.0, "total": 0.0703426348698}),
    "dp4 x tp2": (dict(dp=4, tp=2, micro_batch=4), {
        "compute": 0.0204344226488, "overhead": 0.0346075836738, "tp": 0.0622292906644,
        "dp_total": 0.00794905726988, "dp_exposed": 0.00794905726988, "bubble": 0.0, "total": 0.125220354257}),
    "dp2 x tp4": (dict(dp=2, tp=4, micro_batch=8), {
        "compute": 0.0204344226488, "overhead": 0.0346075836738, "tp": 0.225923221335,
        "dp_total": 0.00254375790741, "dp_exposed": 0.00254375790741, "bubble": 0.0, "total": 0.283508985565}),
    "TP tp8": (dict(dp=1, tp=8, micro_batch=16), {
        "compute": 0.0204344226488, "overhead": 0.0346075836738, "tp": 0.484548963556, "dp_total": 0.0,
        "dp_exposed": 0.0, "bubble": 0.0, "total": 0.539590969879}),
}
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


def _match(label: str, got: dict, expected: dict):
    for term, want in expected.items():
        if not math.isclose(got[term], want, rel_tol=RTOL, abs_tol=ATOL):
            raise CheckFailed(f"{label}: {term} = {got[term]:.6g} s, expected {want:.6g} s\n"
                              f"  ({HINTS[term]})")
    passed(f"{label}: {', '.join(expected)}")


def check_no_pipeline(fn):
    """Four dp x tp layouts, no pipeline, bf16: every term."""
    for (model, (gpu, n), seq, layout), expected in EXPECTED.items():
        kw = dict(layout)
        got = _call(fn, MODELS[model], gpu_cluster(gpu, n), seq, **kw)
        _match(f"{model} on {n} {gpu.split()[0]}, dp={kw['dp']} tp={kw['tp']}, {_batches(kw['m'], kw['micro_batch'])}",
               got, expected)


def check_pipeline(fn):
    """GPT-3 175B cut into 8 stages: first a property (more micro-batches, a smaller share of the
    step idle), then every term for 1F1B at m = 8, 16, 64 and interleaved 1F1B with v = 2."""
    cluster = gpu_cluster(*A100_1024)
    got = {key: _call(fn, GPT3_175B, cluster, 2048, dp=16, tp=8, pp=8, micro_batch=1, m=key[0], v=key[1])
           for key in PIPELINE}
    share = [got[(m, 1)]["bubble"] / got[(m, 1)]["total"] for m in (8, 16, 64)]
    if not (share[0] > share[1] > share[2] > 0):
        raise CheckFailed(f"the bubble's share of the step at m = 8, 16, 64 is "
                          f"{', '.join(f'{s:.3f}' for s in share)}: it must be positive and fall as m grows")
    passed("the bubble's share of the step falls as the micro-batches grow in number")
    for (m, v), expected in PIPELINE.items():
        _match(f"pp=8, m={m}" + (f", interleaved v={v}" if v > 1 else ", 1F1B"), got[(m, v)], expected)


def check_exposed_dp(fn):
    """Llama-3 70B, dp64 tp8: with no overlap everything is exposed (a property); then the same 8
    sequences per replica as 1 micro-batch of 8 and as 8 of 1, and with overlap 1/4."""
    h100 = gpu_cluster(*H100_512)
    none = _call(fn, LLAMA3_70B, replace(h100, overlap=0.0), 4096, dp=64, tp=8, micro_batch=8, m=1)
    if not math.isclose(none["dp_exposed"], none["dp_total"], rel_tol=RTOL, abs_tol=ATOL):
        raise CheckFailed(f"with cluster.overlap = 0 nothing hides the all-reduce: dp_exposed = "
                          f"{none['dp_exposed']:.6g} s must equal dp_total = {none['dp_total']:.6g} s")
    passed("overlap 0: the whole data-parallel all-reduce is exposed")
    for (overlap, mb, m), expected in EXPOSED.items():
        got = _call(fn, LLAMA3_70B, replace(h100, overlap=overlap), 4096, dp=64, tp=8, micro_batch=mb, m=m)
        _match(f"overlap {overlap:g}, {_batches(m, mb)}", got, expected)


def check_measured(fn):
    """The 8-rank calibration of notebook 11, section 4 (fp32): every term of the four dp x tp
    runs, then the order of your predictions against the order the runs were measured in."""
    data = load_validation()
    measured = {r["label"]: r["measured"] for r in data["runs"]}
    predicted = {}
    for label, (layout, expected) in MEASURED.items():
        got = _call(fn, data["config"], data["cluster"], data["seq"], "fp32", **layout)
        _match(f"{label} on the calibrated ranks", got, expected)
        predicted[label] = got["total"]
    check_equal("the four runs from fastest to slowest: predicted = measured",
                sorted(predicted, key=predicted.get), sorted(predicted, key=measured.get))
