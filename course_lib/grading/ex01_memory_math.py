"""Checkers of exercise 01 (model-state bytes with ZeRO's padded shards, the offload lower bound,
two layouts for Llama-3 70B, the days to train).

    check_state_bytes(student)      every recipe, ZeRO stages 0-3, four (n_params, dp) pairs of
                                    which three leave dp not dividing n_params (one with fewer
                                    parameters than ranks): the answers are stored as digests of
                                    the reference solution's, never as readable numbers
    check_needs_offload(student)    nine cases, some exactly at the limit, some with another
                                    bytes_per_param (a digest of the reference answers)
    check_plan(label, plan, n_gpus, allow_offload)  the rules a layout must obey, judged by the
                                    course's estimator (as the exercise says: many plans pass)
    check_training_days(student)    6 P D / (N peak MFU) seconds in days, evaluated here at check
                                    time, and how the days scale with each argument
    breakdown(plan)                 the busiest GPU's memory for a plan (for the learner's search)

REFUSE keeps the course's estimator out of student.py: it holds parts 1, 2 and 5's answers.
"""

from __future__ import annotations

from course_lib import estimate, units
from course_lib.grading import CheckFailed, passed
from course_lib.grading.stored import check_digest

REFUSE = ("course_lib.estimate", "course_lib.grading.ex01_memory_math")

H100 = units.from_spec_gb(80)          # the spec sheet's 80 GB = 80e9 bytes = 74.5 GiB
BUDGET = 0.9 * H100                    # leave 10% for the CUDA context, buffers, fragmentation
HOST_MEMORY = 2 * 10**12               # CPU memory of one 8-GPU node (e.g. a DGX H100: 2 TB)
MODEL = estimate.LLAMA3_70B
KEYS = {"dp", "tp", "pp", "zero_stage", "recompute", "offload"}

# (n_params, dp): 8 divides 8000; 64 does not divide 1,000,000,007 nor 70,600,000,001; 5 < 8.
SIZES = [(8000, 8), (1_000_000_007, 64), (5, 8), (70_600_000_001, 64)]
# recipe -> digest({"stage,n,dp": bytes}) of exercises/solutions/ex01_memory_math.py's answers over SIZES x stages.
STATE_DIGESTS = {
    "fp32": "63032d3c6d1af8a1ca8a3ec7928b7d711b94856522afbb8dea1c2db9434d7f1d",
    "bf16_mixed": "6b0e4d1fcd7705f807e0f297ecb4fb5d04968d1775770c737991d5ea9535510a",
    "bf16_fp32_accum": "933936aed0065fdeab5b57245f79b5f83926adc432a6a7a97cef6b29883e06d4",
    "bf16_autocast": "63032d3c6d1af8a1ca8a3ec7928b7d711b94856522afbb8dea1c2db9434d7f1d",
}
STATE_HINT = ("what does each buffer (parameters, gradients, optimizer state) take per parameter in this recipe "
              "(notebook 01 §2), which of them does each ZeRO stage shard, and how many whole elements does a "
              "padded shard hold?")

# (n_params, n_gpus, gpu_bytes, bytes_per_param); digest of the reference answers, in this order.
OFFLOAD_CASES = [(8e9, 8, 16e9, 16), (70.6e9, 8, 80e9, 16), (70.6e9, 64, 80e9, 16), (405.9e9, 64, 80e9, 16),
                 (4e9, 1, 80e9, 20), (4e9, 1, 80e9, 21), (5e9, 1, 80e9, 16), (5.000001e9, 1, 80e9, 16),
                 (8.03e9, 1, 80e9, 16)]
OFFLOAD_DIGEST = "6b4b2e2e984696e4487dbc9061558a2972fb7877215720d271dbd53dc9e4f143"


def check_state_bytes(student) -> None:
    for recipe, expected in STATE_DIGESTS.items():
        got = {}
        for stage in range(4):
            for n, dp in SIZES:
                value = student.state_bytes_per_gpu(n, recipe, stage, dp)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise CheckFailed(f"state_bytes_per_gpu({n:,}, {recipe!r}, {stage}, {dp}) returned {value!r} "
                                      "(in student.py): a GPU holds whole elements, so return an int number of bytes")
                got[f"{stage},{n},{dp}"] = value
        check_digest(f"{recipe}: bytes per GPU for ZeRO 0-3, {len(SIZES)} sizes, dp not always dividing them",
                     got, expected, hint=STATE_HINT)


def check_needs_offload(student) -> None:
    got = [student.needs_offload(*case) for case in OFFLOAD_CASES]
    if not all(isinstance(g, bool) for g in got):
        raise CheckFailed(f"needs_offload returned {got!r} (in student.py): True or False")
    check_digest(f"needs_offload on {len(OFFLOAD_CASES)} cases (some exactly at the limit)", got, OFFLOAD_DIGEST,
                 hint="the best case spreads every byte of state evenly over all the GPUs; state that exactly "
                      "fills the GPUs still fits; bytes_per_param is an argument")


def breakdown(plan: dict) -> dict:
    """The estimator's bytes on the busiest GPU for a plan of the exercise's keys (micro-batch 1 of
    4,096 tokens, bf16 mixed precision, Llama-3 70B)."""
    return estimate.per_gpu_memory(MODEL, 1, 4096, "bf16_mixed", **plan)


def check_plan(label: str, plan, n_gpus: int, allow_offload: bool) -> None:
    try:
        _check_plan(label, plan, n_gpus, allow_offload)
    except CheckFailed as failure:
        raise CheckFailed(f"{failure} (the plan returned by student.py)") from None
    passed(f"{label}: fits")


def _check_plan(label: str, plan, n_gpus: int, allow_offload: bool) -> None:
    if not isinstance(plan, dict) or set(plan) != KEYS:
        raise CheckFailed(f"{label}: return a dict with exactly the keys {sorted(KEYS)}, got {plan!r}")
    if plan["dp"] * plan["tp"] * plan["pp"] != n_gpus:
        raise CheckFailed(f"{label}: dp * tp * pp = {plan['dp'] * plan['tp'] * plan['pp']} must use all {n_gpus} GPUs")
    if not allow_offload and plan["offload"] != "none":
        raise CheckFailed(f"{label}: offload={plan['offload']!r}, but this plan must keep everything on the GPUs")
    if n_gpus > 8 and 8 % plan["tp"]:
        raise CheckFailed(f"{label}: tp={plan['tp']} must divide 8: tensor parallelism stays inside one node")
    try:
        m = breakdown(plan)
    except ValueError as err:
        raise CheckFailed(f"{label}: the estimator rejects this layout: {err}") from None
    parts = ", ".join(f"{k} {units.fmt_bytes(m[k])}" for k in ("params", "grads", "optimizer", "activations"))
    if m["total"] > BUDGET:
        raise CheckFailed(f"{label}: the busiest GPU needs {units.fmt_bytes(m['total'])} ({parts}), "
                          f"more than the budget of {units.fmt_bytes(BUDGET)}")
    offloaded = m["cpu_offload"] * n_gpus
    if offloaded > HOST_MEMORY * (n_gpus // 8):
        raise CheckFailed(f"{label}: {units.fmt_bytes(offloaded)} offloaded is more than the nodes' CPU memory")


def check_training_days(student) -> None:
    base = (70.6e9, 15e12, 64, 989e12, 0.4)
    for args in (base, (70.6e9, 15e12, 8, 989e12, 0.4), (8.03e9, 2e12, 512, 312e12, 0.55)):
        n_params, n_tokens, n_gpus, peak, mfu = args
        flops, rate, day = 6 * n_params * n_tokens, n_gpus * peak * mfu, 24 * 3600  # FLOPs, FLOP/s, s per day
        got = student.training_days(*args)
        # float64, the same operations in another order: ~1e-16 relative
        if not isinstance(got, (int, float)) or abs(got - flops / rate / day) > 1e-9 * (flops / rate / day):
            raise CheckFailed(f"training_days{args} returned {got!r}, which is not the answer (in student.py): the "
                              "6 P D rule counts FLOPs; the GPUs together deliver how many FLOP/s; and a day is how "
                              "many seconds?")
    passed("training_days: 3 cases, by the 6 P D rule")
    days = student.training_days(*base)
    for i, (name, power) in enumerate((("parameters", 1), ("tokens", 1), ("GPUs", -1), ("peak", -1), ("MFU", -1))):
        args = list(base)
        args[i] *= 2
        if abs(student.training_days(*args) / days - 2.0**power) > 1e-9:  # float64 reordering, as above
            raise CheckFailed(f"training_days: doubling the {name} should multiply the days by {2.0**power:g} "
                              "(in student.py)")
    passed("training_days scales with parameters and tokens, inversely with GPUs, peak and MFU")
