"""Exercise 00: your first collective. Fill in the two functions, then run the check cells
of ex00_all_reduce.ipynb. Each check prints PASS when your code is right."""

import torch
import torch.distributed as dist

from course_lib import run_on_ranks


def all_reduce_sum(value: float) -> float:
    """Inside rank code: return the sum of `value` over all ranks.

    Hint: put the value in a tensor and use one torch.distributed collective.
    """
    raise NotImplementedError("exercise 00: write all_reduce_sum")


def rank_ordered_sums(values: list[float]) -> list[float]:
    """In the parent: start len(values) ranks; rank r contributes values[r] to
    `all_reduce_sum`. Return every rank's result, in rank order."""
    raise NotImplementedError("exercise 00: write rank_ordered_sums")
