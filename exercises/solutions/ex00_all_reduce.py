"""Reference solution for exercise 00 (kept apart from the learner's stubs)."""

import torch
import torch.distributed as dist

from course_lib import run_on_ranks


def all_reduce_sum(value: float) -> float:
    """Inside rank code: return the sum of `value` over all ranks."""
    t = torch.tensor([value], dtype=torch.float64)  # float64: sums of floats stay exact here
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item()


def rank_ordered_sums(values: list[float]) -> list[float]:
    """Rank r contributes values[r]; every rank's result comes back in rank order."""
    return run_on_ranks(lambda: all_reduce_sum(values[dist.get_rank()]), world_size=len(values))


def global_mean(values: list[float]) -> float:
    """Inside rank code: the mean of every rank's values together, in one collective call."""
    t = torch.tensor([sum(values), len(values)], dtype=torch.float64)  # sum and count travel together
    dist.all_reduce(t)
    return (t[0] / t[1]).item()
