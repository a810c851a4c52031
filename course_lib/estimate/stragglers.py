"""Stragglers: the wall time of a run in which some ranks are slower, for a run that meets every
step (DDP) and one that meets every H steps (LocalSGD, DiLoCo). Formulas only: pure Python.

Rank r spends c_r + d_r(t) seconds on its step t (compute c_r, an extra delay d_r(t): a slow
GPU, a noisy neighbour), and a meeting costs sync seconds once everyone it waits for is there.

    synchronous step (DDP, every step)  T_step(t) = max_r (c_r + d_r(t)) + comm
    a round of H steps (DiLoCo)         T_round   = max_r sum_{t in round} (c_r + d_r(t)) + sync
    a run                               T         = sum over rounds (DDP: H = 1, sync = comm)

so with a *constant* delay d on one rank both pay H (c + d) per H steps: meeting less often
saves syncs (H - 1 of every H), not the slow rank's time. Meeting less often helps when the
delays vary (a max of sums is at most the sum of maxes: a rank slow at one step and fast at the
next catches up within the round), and a quorum helps with a rank that stays slow:

    quorum q (of R replicas)            T_round = the q-th smallest of the R replicas' sums + sync

the round ends when q replicas are done and the others' work of that round is dropped (they
take the averaged model and go on); q = R is the plain max. The model prices the time only:
whether the run still learns as well is the algorithm's question (Douillard et al. 2023 report
DiLoCo robust to replicas becoming unavailable during training).
"""

from __future__ import annotations

from collections.abc import Sequence

from course_lib._validate import check_int


def _per_rank(name: str, value, ranks: int) -> list[float]:
    values = [value] * ranks if isinstance(value, (int, float)) and not isinstance(value, bool) else list(value)
    if len(values) != ranks or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                                       for v in values):
        raise ValueError(f"{name}={value!r} must be a number >= 0 or one per rank ({ranks}), each >= 0")
    return [float(v) for v in values]


def _delays(delays_s: Sequence[Sequence[float]]) -> list[list[float]]:
    rows = [list(r) for r in delays_s]
    if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("delays_s must be one list per rank of one delay per step, all of the same length >= 1")
    if any(not isinstance(d, (int, float)) or isinstance(d, bool) or d < 0 for r in rows for d in r):
        raise ValueError("every delay in delays_s must be a number >= 0 (seconds)")
    return rows


def constant_delays(ranks: int, slow_rank: int, delay_s: float, steps: int) -> list[list[float]]:
    """delays_s with rank `slow_rank` late by delay_s at every one of `steps` steps, the others never."""
    check_int("ranks", ranks, rule="an int >= 1")
    check_int("steps", steps, rule="an int >= 1")
    check_int("slow_rank", slow_rank, minimum=0, maximum=ranks - 1, rule=f"an int in [0, {ranks})")
    if not (isinstance(delay_s, (int, float)) and delay_s >= 0):
        raise ValueError(f"delay_s={delay_s!r} must be >= 0")
    return [[float(delay_s) if r == slow_rank else 0.0] * steps for r in range(ranks)]


def synchronous_step_seconds(compute_s, delays_s: Sequence[float], comm_s: float = 0.0) -> float:
    """One step that waits for every rank: max_r (c_r + d_r) + comm. delays_s: one per rank."""
    d = _per_rank("delays_s", delays_s, len(delays_s))
    c = _per_rank("compute_s", compute_s, len(d))
    return max(ci + di for ci, di in zip(c, d)) + _per_rank("comm_s", comm_s, 1)[0]


def round_seconds(compute_s, delays_s: Sequence[Sequence[float]], sync_s: float = 0.0,
                  quorum: int | None = None) -> float:
    """One round (the steps of delays_s, one list per replica): the q-th smallest over replicas of
    sum_t (c_r + d_r(t)), plus sync_s. quorum None: every replica (q = R, the max)."""
    rows = _delays(delays_s)
    c = _per_rank("compute_s", compute_s, len(rows))
    q = len(rows) if quorum is None else quorum
    check_int("quorum", q, maximum=len(rows), rule=f"an int in [1, {len(rows)}] (the replicas)")
    sums = sorted(len(r) * ci + sum(r) for ci, r in zip(c, rows))
    return sums[q - 1] + _per_rank("sync_s", sync_s, 1)[0]


def wall_seconds(compute_s, delays_s: Sequence[Sequence[float]], inner_steps: int = 1, sync_s: float = 0.0,
                 quorum: int | None = None) -> float:
    """The whole run: rounds of H = inner_steps steps (the last may be shorter and still ends with
    a sync), each round_seconds. H = 1 with sync_s = the all-reduce time is DDP."""
    rows = _delays(delays_s)
    check_int("inner_steps", inner_steps, rule="an int >= 1")
    steps = len(rows[0])
    return sum(round_seconds(compute_s, [r[t:t + inner_steps] for r in rows], sync_s, quorum)
               for t in range(0, steps, inner_steps))
