"""V-shaped schedules: two chunks per rank, placed in a V (actions.py), backward split into B and W.

    zbv        ZB-V (Qi et al., 2024, "Pipeline parallelism with controllable memory"; first in
               Qi et al., 2023, section 6): every rank holds at most 1F1B's peak, p micro-batches'
               worth of activations (2p chunk graphs). Its bubble is zero at t_F = t_B = t_W in the
               authors' terms, with the optimizer step post-validated (Qi et al., 2023, section 4:
               each stage steps at once and rolls back if the global-norm clip or the inf/NaN check
               says so); under the course's synchronous end of step (a global-norm clip across the
               stages) it is (p-1)/(6m+p-1), the warm-up stagger.
    dualpipev  DualPipeV: DeepSeek's DualPipe (DeepSeek-AI, 2024, DeepSeek-V3 report, section 3.2.1)
               cut in half onto a V by Qi, Wan, Huang and Lin (Sea AI Lab, 2025; credited in the
               DualPipe README): in the steady state each rank runs the forward of one micro-batch
               overlapped with the backward of another, as one F&B unit, and holds one more
               micro-batch than ZB-V (p + 1, 2p + 2 chunks). A simplified variant of torch's
               ScheduleDualPipeV, which writes DeepSeek's phases out by hand (warm-up forwards, a
               B/W-split stretch, the F&B pairs, a cool-down that splits B from W in its second
               half); here the pairs come from the list scheduler below.

Both lists are built by the same list scheduler, written for this course (not the papers'
hand-drawn layouts; the simulator then checks the result like any other schedule). It plays
the schedule on an idealised clock where every F, B and W of one chunk takes one tick, and at
each tick every idle rank picks, among the actions whose inputs have arrived:

    F first (it fills the pipe), then B, then W (it fills what would otherwise be idle time);
    but one short of the memory cap, W first (it frees memory), then F, then B.

F and B take the oldest micro-batch, the deeper stage on a tie; an F waits while the rank holds
`cap` chunks whose W has not run. dualpipev: when an F and a B (of another micro-batch) can both
start, they go together as one overlapped F&B pair and the W of that B follows at once. (This
rule reproduces ZB-V's published shape: 2(p-r)-1 warm-up forwards on rank r, then F, B, W in
turn; and with equal times the simulated bubble is (p-1)/(6m+p-1) for every p <= 12, m >= p:
(p-1) idle chunk-times per rank, half of ZB-H1's (p-1) stage-times.)

Memory counts a chunk from its F to its W (after B only the stash of inputs and output
gradients remains, less than the graph: in_flight(until="W")). On the CPU ranks of this course
an overlapped pair runs F then B on one thread: nothing overlaps. What DualPipe overlaps on
GPUs is one micro-batch's communication (the experts' all-to-all, the pipeline's send/recv)
with the other's compute; the simulator times a pair as t_F + t_B starting when both can start,
so on the ideal clock (equal times, free messages) DualPipeV only ties with ZB-V. Off it (messages
that cost time, a W longer or shorter than F) DualPipeV comes out at or below ZB-V: its cap of
2p + 2 chunks is slack that lets a rank run ahead of a late neighbour (the same list scheduler
with ZB-V's cap of 2p gives ZB-V's bubble; checked at p = 4, m = 8).
"""

from __future__ import annotations

from course_lib._validate import check_int
from course_lib.dims import V_SCHEDULES  # noqa: F401 (the V schedules' names, once, in the rule book)
from course_lib.parallel.pp.actions import Action, Schedule, ScheduleError, rank_of, stage_of


def _check_counts(p, m):
    for name, value in (("n_ranks", p), ("n_microbatches", m)):
        check_int(name, value, rule="an int >= 1")


def _v_list_schedule(name: str, p: int, m: int, cap: int, overlap: bool) -> Schedule:
    S = 2 * p
    stages = [(stage_of("v", p, r, 1), stage_of("v", p, r, 0)) for r in range(p)]  # deeper stage first
    done: dict[tuple[str, int, int], int] = {}  # (kind, j, stage) -> tick it ends
    next_f, next_b = [0] * S, [0] * S  # per stage, the next micro-batch to run F / B (in order)
    pending_w = [[] for _ in range(p)]  # per rank, (j, stage) whose B ran and W has not
    live, free = [0] * p, [0] * p
    acts, pairs = [[] for _ in range(p)], [set() for _ in range(p)]

    def ready(key, t):
        return key in done and done[key] <= t

    def run(r, kind, j, s, t):
        acts[r].append(Action(kind, j, 0 if s == stages[r][1] else 1))
        done[(kind, j, s)] = t + 1
        if kind == "F":
            next_f[s] += 1
            live[r] += 1
        elif kind == "B":
            next_b[s] += 1
            pending_w[r].append((j, s))
        else:
            live[r] -= 1

    total, t = 3 * S * m, 0
    while len(done) < total:
        if t > 4 * total:
            raise ScheduleError(f"{name}: the list scheduler stalled at p={p}, m={m}")
        for r in range(p):
            if free[r] > t:
                continue
            bs = [(next_b[s], -s, s) for s in stages[r] if next_b[s] < next_f[s]
                  and (s == S - 1 or ready(("B", next_b[s], s + 1), t))]
            fs = [(next_f[s], -s, s) for s in stages[r] if next_f[s] < m and live[r] < cap
                  and (s == 0 or ready(("F", next_f[s], s - 1), t))]
            if overlap and bs and fs and min(fs)[0] != min(bs)[0]:
                (jf, _, sf), (jb, _, sb) = min(fs), min(bs)
                pairs[r].add(len(acts[r]))
                run(r, "F", jf, sf, t)
                run(r, "B", jb, sb, t + 1)
                pending_w[r].pop()  # the pair's backward is whole: its W runs right after it
                run(r, "W", jb, sb, t + 2)
                free[r] = t + 3
                continue
            # one short of the cap: W first (it frees memory), else F first (it fills the pipe)
            for kind in ("W", "F", "B") if live[r] >= cap - 1 else ("F", "B", "W"):
                if kind == "B" and bs:
                    run(r, "B", *min(bs)[::2], t)
                elif kind == "F" and fs:
                    run(r, "F", *min(fs)[::2], t)
                elif kind == "W" and pending_w[r]:
                    run(r, "W", *pending_w[r].pop(0), t)
                else:
                    continue
                free[r] = t + 1
                break
        t += 1
    assert all(rank_of("v", p, s) == r for r in range(p) for s in stages[r])
    return Schedule(name, p, m, 2, acts, placement="v", overlapped=pairs if overlap else [])


def zbv(p: int, m: int) -> Schedule:
    """ZB-V on p ranks (2p stages in a V), m micro-batches; at most 2p chunks whose W has not run
    per rank (1F1B's peak of p micro-batches). With t_F = t_B = t_W and m >= p the bubble is
    (p-1)/(6m+p-1) (bubble.v_bubble_fraction), half of ZB-H1's idle time, for the same memory."""
    _check_counts(p, m)
    return _v_list_schedule("zbv", p, m, cap=2 * p, overlap=False)


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV on p ranks (2p stages in a V), m micro-batches: ZB-V's rule, except that an F
    and a B of another micro-batch that can both start go together as an overlapped F&B pair
    whose backward is whole (its W right after it, as in DualPipe's steady state; W is split off
    only outside the pairs, to fill bubbles), with one more micro-batch in flight (at most 2p + 2
    chunks per rank; DeepSeek-V3 report, Table 2: PP + 1 micro-batches' activations). Needs
    m >= 2p, as torch's ScheduleDualPipeV does: with fewer micro-batches than stages there is no
    steady state to overlap in."""
    _check_counts(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipev needs n_microbatches >= 2 * n_ranks = {2 * p} (one per stage of the V), "
                         f"got {m}")
    return _v_list_schedule("dualpipev", p, m, cap=2 * p + 2, overlap=True)
