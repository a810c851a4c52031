"""Exercise 00: your first collective. Fill in the three functions, then run the check cells
of ex00_all_reduce.ipynb. Each check prints PASS when your code is right."""

import torch
import torch.distributed as dist

from course_lib import run_on_ranks


def all_reduce_sum(value: float) -> float:
    """Inside rank code: return the sum of `value` over all ranks, as a Python float.

    Hint: put the value in a tensor and use one torch.distributed collective.
    """
    raise NotImplementedError("exercise 00: write all_reduce_sum")


def rank_ordered_sums(values: list[float]) -> list[float]:
    """In the parent: start len(values) ranks; rank r contributes values[r] to
    `all_reduce_sum`. Return every rank's result, in rank order."""
    raise NotImplementedError("exercise 00: write rank_ordered_sums")


def global_mean(values: list[float]) -> float:
    """Inside rank code: `values` are this rank's numbers (ranks may hold different counts,
    some none at all; at least one rank holds some). Return the mean of ALL the ranks' numbers
    together, as a Python float, the same on every rank, using exactly one torch.distributed
    collective call per rank."""
    raise NotImplementedError("exercise 00: write global_mean")
