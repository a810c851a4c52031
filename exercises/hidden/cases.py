# Instructor-only cases for `python -m course_lib.grading.grade SUBMISSIONS --hidden exercises/hidden/cases.py`.
# `make release` leaves this folder out of the learner's copy. Each cell, headed by its exercise,
# runs after that exercise's own cells with `student`, the notebook's names and HIDDEN_SEED (the
# grader's --seed): the sizes are drawn from it, so a learner cannot tune code to the copy's sizes.

# %% ex00_all_reduce
import random

from course_lib.grading import check_close

_rng = random.Random(HIDDEN_SEED)
_n = _rng.randint(2, 5)
_values = [_rng.randint(-64, 64) / 8 for _ in range(_n)]  # multiples of 1/8: every order of summing is exact
check_close(f"hidden: {_n} ranks, seed {HIDDEN_SEED}", student.rank_ordered_sums(_values), [sum(_values)] * _n,
            rtol=0, atol=0)

# %% ex02_ring_all_reduce
import random

import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.grading import check_equal

_rng = random.Random(HIDDEN_SEED)
_n, _numel = _rng.randint(2, 5), _rng.randint(1, 23)  # sizes N may not divide, and ones below N


def _hidden_ring(numel):
    x = torch.arange(numel, dtype=torch.float64) * (dist.get_rank() + 1)  # small integers: sums exact
    expected = x.clone()
    dist.all_reduce(expected)
    return torch.equal(student.ring_all_reduce(x), expected)


check_equal(f"hidden: N={_n}, {_numel} elements, seed {HIDDEN_SEED}: equals dist.all_reduce",
            run_on_ranks(_hidden_ring, _numel, world_size=_n, timeout_s=60), [True] * _n)

# %% ex11_step_time
import random
from dataclasses import replace as _replace

from course_lib.estimate import LLAMA3_70B as _LLAMA
from course_lib.estimate.clusters import gpu_cluster as _gpu_cluster

_rng = random.Random(HIDDEN_SEED)
_tp, _pp = _rng.choice([1, 2, 4, 8]), _rng.choice([1, 2, 4])  # 64 heads, 80 layers: every choice divides
_dp, _m, _mb = _rng.choice([1, 2, 4]), _rng.randint(1, 8), _rng.choice([1, 2])
_cluster = _replace(_gpu_cluster("H100 SXM 80 GB", 32), layer_overhead=ex11.LAYER_OVERHEAD,
                    overlap=_rng.choice([0.0, 0.5, 1.0]))  # 4 nodes of 8: the strides decide the links
_got = ex11._call(student.step_time_dp_tp, _LLAMA, _cluster, 4096, dp=_dp, tp=_tp, pp=_pp, micro_batch=_mb, m=_m)
ex11._match(f"hidden: dp={_dp} tp={_tp} pp={_pp}, {_m} x {_mb} on 32 H100, overlap {_cluster.overlap:g}, seed {HIDDEN_SEED}",
            _got, (_LLAMA, _cluster, _dp, _tp, _mb, _m, _pp), dict(seq=4096))

# %% ex12_reshard
import random

import torch

_rng = random.Random(HIDDEN_SEED)
_numel, _old, _new = _rng.randint(1, 64), _rng.randint(1, 9), _rng.randint(1, 9)  # units below the world too
_s_old, _s_new = -(-_numel // _old), -(-_numel // _new)
_label = f"hidden: {_numel} elements, {_old} -> {_new} ranks, seed {HIDDEN_SEED}"
_errors = [e for r in range(_new) for e in grade.plan_errors(_label, grade._plan(student, _numel, _old, _new, r)[1],
                                                             _numel, _old, _new, r, _s_old, _s_new)]
_watched = grade._watched(grade._offset_shards(_numel, _old, _s_old, torch.int64, grade.PAD))
_out = [t.tolist() for t in student.reshard_flat(_watched, _numel, _new)]
_want = [t.tolist() for t in grade._offset_shards(_numel, _new, _s_new, torch.int64, 0)]
from course_lib.grading import check_equal  # noqa: E402

check_equal(f"{_label}: the read plans break no rule, the new shards hold each element at its offset",
            (_errors, _out), ([], _want))
grade.check_reads(_label, student, _watched, _numel, _new)

# %% ex13_diloco
import random

_rng = random.Random(HIDDEN_SEED)
_n = _rng.randint(2, 4)
# 3 to 5 rounds, each with a random non-empty quorum (often with replicas missing)
_quorums = [tuple(sorted(_rng.sample(range(_n), _rng.randint(1, _n)))) for _ in range(_rng.randint(3, 5))]
grade.made_up_rounds(student, _n, _quorums, label=f"hidden: {_n} replicas, quorums {_quorums}, seed {HIDDEN_SEED}")

# %% ex09_context_parallel
import random

_rng = random.Random(HIDDEN_SEED)
_cp = _rng.randint(2, 4)
_t = _rng.randint(2 * _cp, 10 * _cp)  # 2cp divides it or not
checks.check_layout(student, layouts=[(_t, _cp), (_t + 1, _cp), (_rng.randint(16, 99), _rng.randint(5, 8))])
checks.check_ring(student, cases=((_t, _cp),))
