# Instructor-only cases for `python -m course_lib.grading.grade SUBMISSIONS --hidden exercises/hidden/cases.py`.
# `make release` leaves this folder out of the learner's copy. Each cell, headed by its exercise,
# runs after that exercise's own cells with `student`, the notebook's names and HIDDEN_SEED (the
# grader's --seed): the sizes are drawn from it, so a learner cannot tune code to the copy's sizes.

# %% ex00_all_reduce
import random

_rng = random.Random(HIDDEN_SEED)
_n = _rng.randint(2, 5)
_values = [_rng.randint(-64, 64) / 8 for _ in range(_n)]  # multiples of 1/8: every order of summing is exact
check_close(f"hidden: {_n} ranks, seed {HIDDEN_SEED}", student.rank_ordered_sums(_values), [sum(_values)] * _n,
            rtol=0, atol=0)

# %% ex02_ring_all_reduce
import random

import torch
import torch.distributed as dist

_rng = random.Random(HIDDEN_SEED)
_n, _numel = _rng.randint(2, 5), _rng.randint(1, 23)  # sizes N may not divide, and ones below N


def _hidden_ring(numel):
    x = torch.arange(numel, dtype=torch.float64) * (dist.get_rank() + 1)  # small integers: sums exact
    expected = x.clone()
    dist.all_reduce(expected)
    return torch.equal(student.ring_all_reduce(x), expected)


check_equal(f"hidden: N={_n}, {_numel} elements, seed {HIDDEN_SEED}: equals dist.all_reduce",
            run_on_ranks(_hidden_ring, _numel, world_size=_n, timeout_s=60), [True] * _n)
