"""The pipeline bubble measured from a run's timeline, against the formulas (course_lib.estimate.bubble).

With p stages, m micro-batches and every stage taking t_F + t_B per micro-batch, GPipe and
1F1B keep each rank busy m(t_F + t_B) out of a step that lasts (m + p - 1)(t_F + t_B): the
first micro-batch needs p - 1 stage-times to reach the last rank, and the last gradient needs
as long to come back. The idle fraction of the step (the bubble) is therefore

    bubble = (p - 1) / (m + p - 1)                        (GPipe, 1F1B; Huang et al., 2019)

Interleaving v chunks per rank shrinks the fill and drain to (p - 1)/v stage-times:

    bubble = (p - 1) / (v m + p - 1)                      (Narayanan et al., 2021)

ZB-H1 splits the backward into B and W and defers W (schedules.zero_bubble). Qi et al. (2023,
Table 2) give the idle time per rank as (p - 1)(T_F + T_B - T_W) against 1F1B's
(p - 1)(T_F + T_B + T_W), with the same peak activation memory p M_B. With t_F = t_B = t_W = t
that is (p - 1) t in a step of 3 m t + (p - 1) t:

    bubble = (p - 1) / (3 m + p - 1)      for m >= p      (Qi et al., 2023)

(and (2p - m - 1)/(2m + 2p - 1) for m < p, from the schedule's own simulation).

ZB-V and DualPipeV (v_schedules.py) put 2 chunks per rank in a V; with t_F = t_B = t_W per chunk
every rank idles p - 1 chunk-times in a step of 6m chunk-times of work:

    bubble = (p - 1) / (6 m + p - 1)      for m >= p      (half of ZB-H1's idle time)

(checked against the schedules' simulation; Qi et al., 2024 call ZB-V's bubble near zero with
1F1B's memory). PipeDream-2BW never flushes: over N steps of m micro-batches 1F1B's fill and
drain happen once, (p - 1)/(N m + p - 1).

Measured: on each rank, 1 - (time in F, B or W) / (the step's span from the first action of
any rank to the last), averaged over the ranks.
"""

from __future__ import annotations

# the formulas live with the other formulas (course_lib.estimate); measured here against them
from course_lib.dims import V_SCHEDULES
from course_lib.estimate.bubble import bubble_fraction, zero_bubble_fraction  # noqa: F401
from course_lib.estimate.bubble import formula_for as _estimate_formula_for
from course_lib.estimate.bubble import v_bubble_fraction as _estimate_v_bubble
from course_lib.model import GPT
from course_lib.observe.timeline import Timeline
from course_lib.parallel.pp.runner import plan_pipeline, run_schedule
from course_lib.parallel.pp.schedules import make_schedule, schedule_events
from course_lib.parallel.pp.stage import build_stage
from course_lib.parallel.pp.training import check_pipeline
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device

COMPUTE = ("forward", "backward", "weight-grad")


def v_bubble_fraction(p: int, m: int, schedule: str = "zbv") -> float:
    """ZB-V's and DualPipeV's bubble with equal chunk times: (p - 1) / (6m + p - 1) for m >= p;
    for m < p (no steady state) the schedule's own simulation, as for ZB-H1."""
    if m >= p:
        return _estimate_v_bubble(p, m)
    return measured_bubble(schedule_events(make_schedule(schedule, p, m, 2)))


def formula_for(schedule: str, p: int, m: int, v: int = 1, steps: int = 1) -> float:
    """The bubble formula of a named schedule (course_lib.dims.SCHEDULES); pipedream_2bw over
    `steps` steps (one fill and one drain for the whole run)."""
    if schedule in V_SCHEDULES:
        return v_bubble_fraction(p, m, schedule)
    return _estimate_formula_for(schedule, p, m, v, steps)


def measured_bubble(per_rank_events: list[list[tuple]], per_rank: bool = False):
    """The idle fraction of compute events (categories forward/backward/weight-grad) in
    Timeline events [(name, start, end, category)] per rank: mean over ranks, or the list."""
    compute = [[e for e in events if e[3] in COMPUTE] for events in per_rank_events]
    if not any(compute):
        raise ValueError("the timeline has no forward/backward/weight-grad events")
    t0 = min(e[1] for events in compute for e in events)
    t1 = max(e[2] for events in compute for e in events)
    fractions = [1 - sum(e[2] - e[1] for e in events) / (t1 - t0) for events in compute]
    return fractions if per_rank else sum(fractions) / len(fractions)


def last_step(events: list[tuple], n_actions: int) -> list[tuple]:
    """The events of the last step of a multi-step run: its final n_actions compute events
    and the communication between them."""
    compute = [e for e in events if e[3] in COMPUTE]
    start = compute[-n_actions][1]
    return [e for e in events if e[1] >= start]


def time_schedules(model_config, runs, micro_batch: int = 2, action_seconds: dict | None = None,
                   seed: int = 0, group=None, repeats: int = 2) -> list[dict]:
    """Rank code: for each (schedule, m, v) in runs, one warm-up step and `repeats` timed steps
    of run_schedule; returns per run {"events": this rank's Timeline events of each timed
    step, "peak_bytes": its peak saved-activation bytes, "loss": the mean loss}.
    The batch is m * micro_batch sequences (fixed micro-batch size, so memory compares)."""
    import torch

    dev, out, stages = rank_device(), [], {}
    for schedule, m, v in runs:
        placement = "v" if schedule in V_SCHEDULES else "loop"
        if (v, placement) not in stages:
            stages[(v, placement)] = build_stage(GPT(model_config, seed=seed).to(dev), group, v, placement)
        stage = stages[(v, placement)]
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, model_config.vocab_size, (m * micro_batch, model_config.block_size + 1), generator=gen)
        x, y = idx[:, :-1].to(dev), idx[:, 1:].to(dev)
        timed, plan = [], plan_pipeline(schedule, stage.n_ranks, v, m)  # built once, run every step
        for k in range(repeats + 1):
            tl = Timeline(device=dev) if k else None  # spans wait for the rank's GPU (course_lib.clock)
            loss = run_schedule(stage, x, y, plan, m, timeline=tl, action_seconds=action_seconds)
            stage.zero_grad(set_to_none=True)
            if k:
                timed.append(tl.events)
        out.append({"events": timed, "peak_bytes": stage.last_peak_activation_bytes, "loss": loss})
    return out


def measure_schedules(world_size: int, model_config, runs, micro_batch: int = 2,
                      action_seconds: dict | None = None, timeout_s: float = 120, repeats: int = 2) -> list[dict]:
    """Parent side: validate every run, time them all on `world_size` ranks in one call, and
    return per run {"schedule", "p", "m", "v", "events" (per rank), "peak_bytes" (per rank),
    "bubble" (measured), "formula", "loss"}. Of the `repeats` timed steps the one with the
    smallest bubble is kept: on a shared machine the others were disturbed more."""
    runs = [tuple(r) + (1,) * (3 - len(r)) for r in runs]
    for schedule, m, v in runs:
        check_pipeline(model_config, world_size, schedule, m, m * micro_batch, v)
    per_rank = run_on_ranks(time_schedules, model_config, runs, micro_batch, action_seconds, 0, None, repeats,
                            world_size=world_size, timeout_s=timeout_s)
    out = []
    for i, (schedule, m, v) in enumerate(runs):
        steps = [[per_rank[r][i]["events"][k] for r in range(world_size)] for k in range(repeats)]
        events = min(steps, key=measured_bubble)
        out.append({"schedule": schedule, "p": world_size, "m": m, "v": v, "events": events,
                    "peak_bytes": [per_rank[r][i]["peak_bytes"] for r in range(world_size)],
                    "bubble": measured_bubble(events), "formula": formula_for(schedule, world_size, m, v),
                    "loss": per_rank[0][i]["loss"]})
    return out
