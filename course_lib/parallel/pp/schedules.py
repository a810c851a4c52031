"""Pipeline schedules as data: for every rank, the ordered list of actions it runs.

An action is F (forward), B (backward) or W (weight gradient) of one micro-batch j on one
of the rank's model chunks c. With p ranks and v chunks per rank there are S = p*v stages;
chunk c of rank r is stage s = c*p + r (Megatron's interleaving: rank r holds stages
r, r+p, r+2p, ...), or with the V placement of zbv and dualpipev (actions.py, v_schedules.py)
stages r and 2p-1-r. A micro-batch's activation goes stage s -> s+1, its gradient s+1 -> s:

    F(j, s) needs F(j, s-1)                      (the activation it consumes)
    B(j, s) needs F(j, s) and B(j, s+1)          (its own graph and the output gradient)
    W(j, s) needs B(j, s)                        (the output gradient the weights need)

Schedules without W run the full backward in B. With W (zero bubble) B computes only the
input gradient, which is all the previous stage waits for, and W the weight gradients.

Sends never block (isend) and each rank waits only in a receive, so a schedule runs without
deadlock exactly when every rank can run its list in order under those dependencies, which is
what `simulate` checks. `check_schedule` adds: every action exactly once, and (optionally)
a cap on the micro-batches in flight (forward done, activations not yet released).
"""

from __future__ import annotations

from course_lib._validate import check_int
from course_lib.dims import SCHEDULES, V_SCHEDULES, check_virtual_stages  # the rule book's vocabulary and V rule
from course_lib.parallel.pp.actions import Action, Schedule, ScheduleError, rank_of, stage_of
from course_lib.parallel.pp.v_schedules import dualpipev, zbv


def _check_counts(p, m, v=1):
    for name, value in (("n_ranks", p), ("n_microbatches", m), ("virtual_stages", v)):
        check_int(name, value, rule="an int >= 1")


def gpipe(p: int, m: int) -> Schedule:
    """All m forwards, then all m backwards (Huang et al., 2019). m=1 is naive model parallel."""
    _check_counts(p, m)
    acts = [[Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)] for _ in range(p)]
    return Schedule("gpipe", p, m, 1, acts)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (Narayanan et al., 2019/2021): rank r runs w = min(p-r-1, m) warm-up forwards,
    then alternates one forward and one backward, then drains the last w backwards. At most
    p - r micro-batches are in flight on rank r, whatever m is. m < p also works: the
    warm-up then covers every micro-batch (it degenerates to GPipe)."""
    _check_counts(p, m)
    acts = []
    for r in range(p):
        w = min(p - r - 1, m)
        ranks = [Action("F", j) for j in range(w)]
        for j in range(m - w):
            ranks += [Action("F", w + j), Action("B", j)]
        ranks += [Action("B", j) for j in range(m - w, m)]
        acts.append(ranks)
    return Schedule("1f1b", p, m, 1, acts)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al., 2021): v chunks per rank. Forwards go
    through the chunks in rounds of p micro-batches: the k-th forward of a rank is micro-batch
    (k // pv)*p + k % p on chunk (k // p) % v; the k-th backward the same micro-batch on chunk
    v-1 - (k // p) % v. Warm-up: (v-1)*p + 2*(p-r-1) forwards. Needs m to be a multiple of p."""
    _check_counts(p, m, v)
    if m % p:
        raise ValueError(f"n_microbatches={m} must be a multiple of the {p} ranks for interleaved_1f1b "
                         f"(micro-batches enter the chunks in rounds of p)")
    total = m * v

    def fwd(k):
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    acts = []
    for r in range(p):
        w = min((v - 1) * p + 2 * (p - r - 1), total)
        ranks = [fwd(k) for k in range(w)]
        for i in range(total - w):
            ranks += [fwd(w + i), bwd(i)]
        ranks += [bwd(i) for i in range(total - w, total)]
        acts.append(ranks)
    return Schedule("interleaved_1f1b", p, m, v, acts)


def zero_bubble(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023, section 2.1): the backward is split into B (input gradient: what
    the previous stage waits for) and W (weight gradient: nobody waits for it until the
    optimizer). F and B run in 1F1B's order (p - r - 1 warm-up forwards on rank r), so each
    rank holds at most p - r whole graphs, as in 1F1B, and B travels back without waiting for
    any W. The W's start later the fewer warm-up forwards a rank has: rank r keeps up to
    r = p - 1 - (its warm-up) W's pending, runs the oldest after a B that would leave r + 1,
    and the rest at the end, where they fill 1F1B's drain. So every rank holds at most p
    micro-batches whose W has not run: p - r graphs plus r stashes (each Linear's input and
    output gradient, less than a graph). Rank 0 defers none: its peak is 1F1B's, p graphs
    (Table 2: peak memory p M_B for both).

    With t_F = t_B = t_W and m >= p every rank idles (p - 1) t_B where 1F1B idles
    (p - 1)(t_F + t_B + t_W) (Table 2: (p - 1)(T_F + T_B - T_W) against (p - 1)(T_F + T_B + T_W)):
    the bubble is (p - 1)/(3m + p - 1), about a third of 1F1B's (p - 1)/(m + p - 1) for m >> p."""
    _check_counts(p, m)
    acts = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order, next_w = [Action("F", j) for j in range(warmup)], 0

        def backward(j):
            nonlocal next_w
            order.append(Action("B", j))
            if j + 1 - next_w > r:  # r + 1 W's would be pending: run the oldest now
                order.append(Action("W", next_w))
                next_w += 1

        for j in range(m - warmup):
            order.append(Action("F", warmup + j))
            backward(j)
        for j in range(m - warmup, m):
            backward(j)
        order += [Action("W", j) for j in range(next_w, m)]
        acts.append(order)
    return Schedule("zero_bubble", p, m, 1, acts)


def make_schedule(name: str, n_ranks: int, n_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule called `name` (one of SCHEDULES) for p ranks, m micro-batches, v chunks."""
    _check_counts(n_ranks, n_microbatches, virtual_stages)
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} must be one of {SCHEDULES}")
    if name == "pipedream_2bw":
        raise ValueError("schedule='pipedream_2bw' has no per-step action list: it never flushes, so it runs "
                         "across steps (course_lib.parallel.pp.pipedream.run_2bw)")
    check_virtual_stages(name, virtual_stages)
    if name in V_SCHEDULES:
        return zbv(n_ranks, n_microbatches) if name == "zbv" else dualpipev(n_ranks, n_microbatches)
    if name == "gpipe":
        return gpipe(n_ranks, n_microbatches)
    if name == "1f1b":
        return one_f_one_b(n_ranks, n_microbatches)
    if name == "zero_bubble":
        return zero_bubble(n_ranks, n_microbatches)
    return interleaved_1f1b(n_ranks, n_microbatches, virtual_stages)


def _stage(sched: Schedule, rank: int, chunk: int) -> int:
    return stage_of(sched.placement, sched.n_ranks, rank, chunk)


def _dependencies(sched: Schedule, rank: int, act: Action) -> list[tuple[str, int, int]]:
    """(kind, microbatch, stage) of the actions `act` waits for."""
    s, last = _stage(sched, rank, act.chunk), sched.n_stages - 1
    if act.kind == "F":
        return [("F", act.microbatch, s - 1)] if s > 0 else []
    if act.kind == "B":
        return [("F", act.microbatch, s)] + ([("B", act.microbatch, s + 1)] if s < last else [])
    return [("B", act.microbatch, s)]


def _check_actions(sched: Schedule) -> None:
    p, m, v = sched.n_ranks, sched.n_microbatches, sched.virtual_stages
    if len(sched.actions) != p:
        raise ScheduleError(f"the schedule has {len(sched.actions)} action lists for {p} ranks")
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "B")
    for r, acts in enumerate(sched.actions):
        seen = set()
        for a in acts:
            if not isinstance(a, Action) or a.kind not in kinds or not (0 <= a.microbatch < m) \
                    or not (0 <= a.chunk < v):
                raise ScheduleError(f"rank {r}: {a!r} is not an action of kind {kinds} with microbatch in "
                                    f"[0, {m}) and chunk in [0, {v})")
            if a in seen:
                raise ScheduleError(f"rank {r} runs {a} twice")
            seen.add(a)
        missing = [Action(k, j, c) for c in range(v) for j in range(m) for k in kinds
                   if Action(k, j, c) not in seen]
        if missing:
            raise ScheduleError(f"rank {r} never runs {', '.join(map(str, missing[:6]))}"
                                + (" ..." if len(missing) > 6 else ""))
        for i in sched.pairs(r):  # an overlapped pair: an F, then a B of another micro-batch
            if not (0 <= i < len(acts) - 1 and acts[i].kind == "F" and acts[i + 1].kind == "B"
                    and acts[i].microbatch != acts[i + 1].microbatch) or i + 1 in sched.pairs(r):
                raise ScheduleError(f"rank {r}: overlapped index {i} must start an F followed by a B of "
                                    f"another micro-batch")
    if sched.placement == "v" and v != 2:
        raise ScheduleError(f"placement 'v' needs exactly 2 chunks per rank, the schedule has {v}")


def simulate(sched: Schedule, t_forward: float = 1.0, t_backward: float = 1.0, t_weight: float = 1.0,
             t_comm: float = 0.0) -> list[list[tuple[Action, float, float]]]:
    """Run the lists on an idealised machine: F, B, W of a whole micro-batch on one rank take
    t_forward, t_backward, t_weight (a chunk takes 1/v of that; B without a W schedule takes
    t_backward + t_weight), a message t_comm. Returns per rank [(action, start, end)].
    Raises ScheduleError if the ranks deadlock, naming what each stuck rank waits for."""
    _check_actions(sched)
    p, v = sched.n_ranks, sched.virtual_stages
    dur = {"F": t_forward / v, "W": t_weight / v,
           "B": (t_backward if sched.split_backward else t_backward + t_weight) / v}
    end: dict[tuple[str, int, int], tuple[float, int]] = {}  # (kind, j, stage) -> (end time, rank)
    out: list[list] = [[] for _ in range(p)]
    pos, free = [0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(sched.actions[r]):
                # an overlapped F&B pair starts when both can, and runs F then B as one unit
                unit = sched.actions[r][pos[r]:pos[r] + (2 if pos[r] in sched.pairs(r) else 1)]
                deps = [d for act in unit for d in _dependencies(sched, r, act)]
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d][0] + (t_comm if end[d][1] != r else 0.0) for d in deps])
                for act in unit:
                    free[r] = start + dur[act.kind]
                    end[(act.kind, act.microbatch, _stage(sched, r, act.chunk))] = (free[r], r)
                    out[r].append((act, start, free[r]))
                    start = free[r]
                pos[r] += len(unit)
                progress = True
    stuck = [(r, sched.actions[r][pos[r]]) for r in range(p) if pos[r] < len(sched.actions[r])]
    if stuck:
        waits = []
        for r, act in stuck:
            need = [d for d in _dependencies(sched, r, act) if d not in end]
            waits.append(f"rank {r} at {act} waits for "
                         + ", ".join(f"{k}{j} of stage {s} (rank {rank_of(sched.placement, p, s)})"
                                     for k, j, s in need))
        raise ScheduleError("deadlock: " + "; ".join(waits))
    return out


def in_flight(sched: Schedule, until: str = "B") -> list[int]:
    """Per rank, the most micro-batch chunks whose forward has run and whose B has not: each
    holds its whole autograd graph. until="W": those whose W has not run either (a deferred W
    keeps a stash, less than a graph; without W in the schedule, B ends the micro-batch)."""
    if until not in ("B", "W"):
        raise ValueError(f"until={until!r} must be 'B' or 'W'")
    end = "W" if until == "W" and sched.split_backward else "B"
    peaks = []
    for acts in sched.actions:
        live = peak = 0
        for a in acts:
            live += (a.kind == "F") - (a.kind == end)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def check_schedule(sched: Schedule, max_in_flight: int | None = None) -> Schedule:
    """Raise ScheduleError unless every rank runs each of its actions exactly once, all ranks
    finish (no deadlock) and, given max_in_flight, no rank holds more micro-batches in flight.
    Returns the schedule, so `run_schedule(..., check_schedule(s), ...)` reads naturally."""
    simulate(sched)
    if max_in_flight is not None:
        for r, peak in enumerate(in_flight(sched)):
            if peak > max_in_flight:
                raise ScheduleError(f"rank {r} holds {peak} micro-batches in flight, more than "
                                    f"max_in_flight={max_in_flight}")
    return sched


def schedule_events(sched: Schedule, **times) -> list[list[tuple[str, float, float, str]]]:
    """The simulated run as Timeline events per rank, for plot_gantt next to a real run."""
    cat = {"F": "forward", "B": "backward", "W": "weight-grad"}
    return [[(str(a), s, e, cat[a.kind]) for a, s, e in rank] for rank in simulate(sched, **times)]
