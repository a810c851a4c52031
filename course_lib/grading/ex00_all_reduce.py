"""Checkers of exercise 00 (a first all-reduce, ranks started from the parent, and the mean of
numbers spread unevenly over the ranks in one collective call).

    check_all_reduce_sum(student)   2 ranks, 1.5 and 2.5: every rank gets the sum, as a float, in
                                    exactly one collective call
    check_rank_ordered_sums(student)  1, 3 and 4 ranks: one result per rank, each the sum
    check_global_mean(student)      2, 3 and 4 ranks holding different counts (one holds none):
                                    every rank returns the mean of all the numbers, the same on
                                    every rank, in exactly one collective call

The numbers are binary fractions with short mantissas: their sums and these means are exact in
float32 and float64 in any order, so every comparison is exact. The expected values are computed
here from the inputs, never stored.
"""

from __future__ import annotations

import torch.distributed as dist

from course_lib.grading import CheckFailed, passed
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import run_on_ranks

REFUSE = ("course_lib.grading.ex00_all_reduce",)


def _traced(fn, per_rank):
    with CommTracer() as tracer:
        result = fn(per_rank[dist.get_rank()])
    return result, sum(op["calls"] for op in tracer.summary().values())


def _is_float(x) -> bool:
    return isinstance(x, float)


def check_all_reduce_sum(student) -> None:
    values = [1.5, 2.5]
    results = run_on_ranks(_traced, student.all_reduce_sum, values, world_size=2, timeout_s=60)
    got = [r[0] for r in results]
    if not all(_is_float(g) for g in got):
        raise CheckFailed(f"all_reduce_sum returned {got!r} (in student.py): return a Python float (tensor.item())")
    if got != [sum(values)] * 2:
        raise CheckFailed(f"2 ranks contributing {values}: all_reduce_sum returned {got} (in student.py): every rank "
                          "must get the sum of every rank's value")
    passed("2 ranks: every rank gets 1.5 + 2.5")
    calls = [r[1] for r in results]
    if calls != [1, 1]:
        raise CheckFailed(f"all_reduce_sum made {calls} collective calls on the two ranks (in student.py): one each")
    passed("2 ranks: one collective call per rank")


def check_rank_ordered_sums(student) -> None:
    for values in ([7.0], [1.0, -2.0, 0.25], [1.0, 2.0, 3.0, 4.0]):
        got = student.rank_ordered_sums(values)
        if not isinstance(got, list) or len(got) != len(values):
            raise CheckFailed(f"rank_ordered_sums({values}) returned {got!r} (in student.py): a list with one result "
                              "per rank, in rank order")
        if got != [sum(values)] * len(values):
            raise CheckFailed(f"rank_ordered_sums({values}) returned {got} (in student.py): each rank's result must "
                              "be the sum over all ranks")
        passed(f"{len(values)} rank{'s' if len(values) > 1 else ''}")


def check_global_mean(student) -> None:
    cases = ([[1.0, 2.0, 3.0], [5.0]], [[4.0], [], [0.5, 0.5, 1.0]], [[2.0, 2.0], [2.0, 6.0], [1.0], [3.0, 3.0, 1.0]])
    for per_rank in cases:
        n = len(per_rank)
        label = f"{n} ranks holding {[len(v) for v in per_rank]} numbers"
        results = run_on_ranks(_traced, student.global_mean, per_rank, world_size=n, timeout_s=60)
        got = [r[0] for r in results]
        if not all(_is_float(g) for g in got):
            raise CheckFailed(f"{label}: global_mean returned {got!r} (in student.py): return a Python float")
        everything = [v for values in per_rank for v in values]
        if got != [sum(everything) / len(everything)] * n:
            means = [sum(v) / len(v) for v in per_rank if v]
            hint = (" That is the mean of the ranks' means: a rank holding more numbers must weigh more."
                    if got and got[0] == sum(means) / len(means) else "")
            raise CheckFailed(f"{label}: global_mean returned {got} (in student.py): every rank must return the mean "
                              f"of all the ranks' numbers together.{hint}")
        calls = [r[1] for r in results]
        if calls != [1] * n:
            raise CheckFailed(f"{label}: global_mean made {calls} collective calls on the ranks (in student.py): "
                              "exactly one each. What can travel together in one tensor?")
        passed(f"{label}: every rank returns the mean of all of them, in one collective call")
