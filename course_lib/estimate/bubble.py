"""The pipeline bubble of each schedule: the idle fraction of a step, as a formula.

With p stages, m micro-batches and every stage taking t_F + t_B per micro-batch, GPipe and
1F1B keep each rank busy m(t_F + t_B) out of a step of (m + p - 1)(t_F + t_B):

    bubble = (p - 1) / (m + p - 1)                        (GPipe, 1F1B; Huang et al., 2019)
    bubble = (p - 1) / (v m + p - 1)                      (interleaved, v chunks; Narayanan et al., 2021)

ZB-H1 (Qi et al., 2023) splits the backward into B and W and defers W. With t_F = t_B = t_W = t
every rank is busy 3 m t; for m >= p a rank idles (p - 1) t (Table 2), for m < p the step is
the first micro-batch's F chain and B chain (2(p - 1) t) plus the 2m + 1 slots of the rest,
(2m + 2p - 1) t in all (course_lib.parallel.pp.schedules.simulate agrees for p <= 9, m < 3p):

    bubble = (p - 1) / (3 m + p - 1)                      m >= p
    bubble = (2 p - m - 1) / (2 m + 2 p - 1)              m <  p

ZB-V and DualPipeV put 2 chunks per rank in a V; with equal chunk times every rank idles p - 1
chunk-times in a step of 6 m chunk-times of work (the course's schedules' simulation, for m >= p):

    bubble = (p - 1) / (6 m + p - 1)                      m >= p (half of ZB-H1's idle time)

PipeDream-2BW never flushes: over N steps 1F1B's fill and drain happen once, (p - 1) / (N m + p - 1),
which a step of a long run sees as 0.

Pure formulas: course_lib.parallel.pp.bubble measures the bubble of real runs against them.
"""

from __future__ import annotations

from course_lib.dims import V_SCHEDULES, check_pipeline_choice


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """(p - 1) / (v m + p - 1): GPipe and 1F1B (v = 1), interleaved 1F1B (v chunks)."""
    return (p - 1) / (v * m + p - 1)


def zero_bubble_fraction(p: int, m: int) -> float:
    """ZB-H1 with t_F = t_B = t_W: (p - 1) / (3 m + p - 1) for m >= p, else (2p - m - 1) / (2m + 2p - 1)."""
    if m < p:
        return (2 * p - m - 1) / (2 * m + 2 * p - 1)
    return (p - 1) / (3 * m + p - 1)


def v_bubble_fraction(p: int, m: int) -> float:
    """ZB-V and DualPipeV with equal chunk times, m >= p: (p - 1) / (6 m + p - 1)."""
    if m < p:
        raise ValueError(f"microbatches={m} < pp={p}: the V schedules' bubble has a closed form for m >= p only "
                         f"(course_lib.parallel.pp.bubble simulates the schedule for fewer)")
    return (p - 1) / (6 * m + p - 1)


def formula_for(schedule: str, p: int, m: int, v: int = 1, steps: int | None = None) -> float:
    """The bubble formula of a named schedule (course_lib.dims.SCHEDULES); pipedream_2bw over
    `steps` steps (None: a step of a long run, 0)."""
    check_pipeline_choice(schedule, p, m, v)
    if schedule == "zero_bubble":
        return zero_bubble_fraction(p, m)
    if schedule in V_SCHEDULES:
        return v_bubble_fraction(p, m)
    if schedule == "pipedream_2bw":
        return 0.0 if steps is None else bubble_fraction(p, steps * m)
    return bubble_fraction(p, m, v if schedule == "interleaved_1f1b" else 1)
