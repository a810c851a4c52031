"""torch.distributed.pipelining's own action lists, read without running, beside the course's.

torch's schedules are data too: each builds a per-rank list of `_Action`s (stage index, kind,
micro-batch), `pipeline_order`, and the multi-stage ones lower it to `pipeline_order_with_comms`
(sends, receives, FSDP's unshard/reshard, the gradient reduction). torch's own visualiser,
`torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`, builds a schedule on a mock
stage and returns those lists: no process group, no rank, no tensor. Its kinds, in ours:

    torch                               the course (actions.py)
    F   forward                         F
    I   input gradient (BACKWARD_INPUT) B of a schedule that splits the backward
    W   weight gradient                 W
    B   whole backward (FULL_BACKWARD)  B; with a split backward B then W at once (as ours writes it)
    OVERLAP_F_B (F; B)                  F, B (W) marked as one overlapped pair (Schedule.overlapped)
    SEND_F RECV_F SEND_B RECV_B         the messages p2p_plan.py batches (not compute: left out)
    UNSHARD RESHARD REDUCE_GRAD         FSDP's gather and free of a stage, the gradient reduction

A stage index becomes (rank, chunk) by the placement: "loop" for interleaving (stage c*p + r),
"v" for ZB-V and DualPipeV (stages r and 2p-1-r). GPipe and 1F1B are single-stage schedules: their
`pipeline_order` is a list torch writes beside the loop its `step` runs, so `traced_order` also
runs that loop on a recording stand-in stage whose messages are empty (no ranks, no tensors).

These are private torch APIs (torch 2.13 here; the course supports 2.8+): `torch_lacks` says in
one sentence what an older torch misses, and the tests skip with that sentence.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass

from course_lib.dims import V_SCHEDULES
from course_lib.parallel.pp.actions import Action, Schedule, rank_of

# the course's name -> torch's (get_schedule_class); the five schedules both ship
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
               "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
SINGLE_STAGE = ("gpipe", "1f1b")
COMPUTE = ("F", "I", "W", "B", "OVERLAP_F_B")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")


def torch_lacks(schedule: str) -> str | None:
    """None when this torch can list `schedule` without running; else one sentence saying why not."""
    import torch

    if schedule not in TORCH_NAMES:
        raise ValueError(f"schedule={schedule!r} must be one of {tuple(TORCH_NAMES)}")
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
        from torch.distributed.pipelining.schedules import get_schedule_class
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.distributed.pipelining._schedule_visualizer ({e})."
    if "with_comms" not in inspect.signature(get_schedule_ops).parameters:
        return f"torch {torch.__version__}'s get_schedule_ops cannot lower a schedule (no with_comms)."
    try:
        get_schedule_class(TORCH_NAMES[schedule])
    except ValueError:
        return f"torch {torch.__version__} has no Schedule{TORCH_NAMES[schedule]}."
    return None


def placement_of(schedule: str) -> str:
    return "v" if schedule in V_SCHEDULES else "loop"


def torch_order(schedule: str, p: int, m: int, with_comms: bool = False) -> list[list]:
    """torch's per-rank `_Action` lists for `schedule` at p ranks and m micro-batches, its idle
    steps (None) dropped: `pipeline_order`, or with_comms the lowered `pipeline_order_with_comms`
    (multi-stage schedules only: torch's lowering needs a list of stages)."""
    reason = torch_lacks(schedule)
    if reason:
        raise RuntimeError(reason)
    if with_comms and schedule in SINGLE_STAGE:
        raise ValueError(f"torch lowers only multi-stage schedules with its comms pass, not {schedule!r}")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(TORCH_NAMES[schedule], p, m, with_comms=with_comms)
    return [[a for a in rank if a is not None] for rank in ops]


class _RecordingStage:
    """Stands in for a PipelineStage in torch's single-stage loop: no messages, no tensors; each
    forward_one_chunk / backward_one_chunk is written down."""

    def __init__(self, stage_index: int, num_stages: int):
        from torch.distributed.pipelining.schedules import _Action, _ComputationType

        self.stage_index, self.num_stages, self.ran = stage_index, num_stages, []
        self.is_first, self.is_last, self.has_backward = stage_index == 0, stage_index == num_stages - 1, True
        self.submod, self._action, self._kind = None, _Action, _ComputationType
        self.output_chunks = []

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.ran.append(self._action(self.stage_index, self._kind.FORWARD, mb))

    def backward_one_chunk(self, mb, *args, **kwargs):
        self.ran.append(self._action(self.stage_index, self._kind.FULL_BACKWARD, mb))

    def _no_ops(self, *args, **kwargs):
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops

    def clear_runtime_states(self):
        pass

    def perform_reduce_grad(self, *args, **kwargs):
        pass


def traced_order(schedule: str, p: int, m: int) -> list[list]:
    """What torch's ScheduleGPipe / Schedule1F1B `step` runs on each rank, in order: its loop
    (`_step_microbatches`) run on a recording stage with empty message lists (no process group)."""
    if schedule not in SINGLE_STAGE:
        raise ValueError(f"traced_order runs torch's single-stage loops {SINGLE_STAGE}, not {schedule!r}")
    reason = torch_lacks(schedule)
    if reason:
        raise RuntimeError(reason)
    from torch.distributed.pipelining.schedules import get_schedule_class

    import torch

    out = []
    for rank in range(p):
        stage = _RecordingStage(rank, p)
        try:
            sched = get_schedule_class(TORCH_NAMES[schedule])(stage, m)
            # as if shapes were already inferred (no loss_fn: _has_backward is False, so nothing to set up)
            sched._stage_forward_initialized, sched._stage_backward_initialized = True, sched._has_backward
            sched._step_microbatches()
        except (AttributeError, TypeError) as e:  # another torch's loop needs more of a stage
            raise RuntimeError(f"torch {torch.__version__}'s Schedule{TORCH_NAMES[schedule]} loop does not run on "
                               f"a recording stage ({e}).") from e
        out.append(stage.ran)
    return out


def _kind(a) -> str:
    return a.computation_type.value


def to_course(schedule: str, p: int, m: int, order: list[list], name: str | None = None) -> Schedule:
    """torch's compute actions as a course Schedule (kinds and chunks translated, comms left out;
    see the module docstring). Not checked: run check_schedule on it."""
    placement = placement_of(schedule)
    split = any(_kind(a) in ("I", "W") for rank in order for a in rank)
    acts, pairs = [[] for _ in range(p)], [set() for _ in range(p)]

    def put(rank, a):
        s, kind = a.stage_index, _kind(a)
        if rank_of(placement, p, s) != rank:
            raise ValueError(f"torch's rank {rank} runs stage {s}, which the {placement!r} placement puts "
                             f"on rank {rank_of(placement, p, s)}")
        chunk = (0 if s < p else 1) if placement == "v" else s // p
        if kind == "B" and split:
            acts[rank] += [Action("B", a.microbatch_index, chunk), Action("W", a.microbatch_index, chunk)]
        else:
            acts[rank].append(Action({"I": "B"}.get(kind, kind), a.microbatch_index, chunk))

    for rank, actions in enumerate(order):
        for a in actions:
            kind = _kind(a)
            if kind == "OVERLAP_F_B":
                if [_kind(x) for x in a.sub_actions] != ["F", "B"]:
                    raise ValueError(f"an overlapped pair of rank {rank} is not (F; B): {a}")
                pairs[rank].add(len(acts[rank]))
                for x in a.sub_actions:
                    put(rank, x)
            elif kind in COMPUTE:
                put(rank, a)
            elif kind not in COMMS:
                raise ValueError(f"torch's action {a} on rank {rank} has a kind this map does not know")
    v = 2 if placement == "v" else max(1, max(a.stage_index for rank in order for a in rank if a.stage_index >= 0)
                                       // p + 1)
    return Schedule(name or f"torch {schedule}", p, m, v, acts, placement=placement,
                    overlapped=pairs if any(pairs) else [])


@dataclass(frozen=True)
class RankComparison:
    """One rank's two lists: `first` is the index of the first action where they differ (None when
    the lists are equal), `ours` / `theirs` the actions there ('-' past a list's end)."""

    rank: int
    first: int | None
    ours: str
    theirs: str
    same_actions: bool  # the same actions, perhaps in another order
    same_pairs: bool  # the same overlapped F&B pairs

    @property
    def agree(self) -> bool:
        return self.first is None and self.same_pairs

    def __str__(self):
        if self.agree:
            return f"rank {self.rank}: the same"
        if self.first is None:
            return f"rank {self.rank}: the same order, other F&B pairs"
        what = "the same actions" if self.same_actions else "other actions"
        return f"rank {self.rank}: {what}, first difference at position {self.first}: ours {self.ours}, torch's {self.theirs}"


def _pairs(sched: Schedule, r: int) -> set[str]:
    return {f"{sched.actions[r][i]}&{sched.actions[r][i + 1]}" for i in sched.pairs(r)}


def compare(ours: Schedule, theirs: Schedule) -> list[RankComparison]:
    """Rank by rank: the same compute actions in the same order, or the first difference."""
    if (ours.n_ranks, ours.placement) != (theirs.n_ranks, theirs.placement):
        raise ValueError(f"{ours.name} and {theirs.name} have other ranks or placements")
    out = []
    for r in range(ours.n_ranks):
        a, b = [str(x) for x in ours.actions[r]], [str(x) for x in theirs.actions[r]]
        first = next((i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]), None)
        out.append(RankComparison(r, first, a[first] if first is not None and first < len(a) else "-",
                                  b[first] if first is not None and first < len(b) else "-",
                                  Counter(a) == Counter(b), _pairs(ours, r) == _pairs(theirs, r)))
    return out


def comm_counts(order: list[list]) -> list[Counter]:
    """Per rank, how many actions of each kind the lowered list holds (pairs counted as one)."""
    return [Counter(_kind(a) for a in rank) for rank in order]


def check_lowered(order: list[list]) -> list[str]:
    """Checks of a lowered list (torch_order(..., with_comms=True)), returned as the sentences that
    hold: every send comes after the compute that made its tensor, on the same rank, and every
    receive before the compute that consumes it; each stage is gathered (UNSHARD) before its first
    compute and freed (RESHARD) after its last; its REDUCE_GRAD follows its last backward.
    Raises ValueError naming the first action out of place."""
    for rank, actions in enumerate(order):
        done = []  # an overlapped pair's two halves in place of the pair
        for a in actions:
            done += list(a.sub_actions) if a.sub_actions else [a]
        at = {(x.stage_index, {"I": "B"}.get(_kind(x), _kind(x)), x.microbatch_index): i for i, x in enumerate(done)}
        compute = {}  # stage -> indices of its compute actions
        for i, x in enumerate(done):
            if _kind(x) in COMPUTE:
                compute.setdefault(x.stage_index, []).append(i)
        for i, x in enumerate(done):
            kind, s = _kind(x), x.stage_index
            if kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                k = at.get((s, kind[-1], x.microbatch_index))  # F, or B (I or a whole B)
                bad = k is None or (k > i if kind.startswith("SEND") else k < i)
            elif kind == "UNSHARD":
                bad = i > min(compute[s])
            elif kind == "RESHARD":
                bad = i < max(compute[s])
            elif kind == "REDUCE_GRAD":
                bad = i < max(j for j in compute[s] if _kind(done[j]) in ("I", "W", "B"))
            else:
                continue
            if bad:
                raise ValueError(f"rank {rank}: {x} is out of place (position {i} among {len(done)})")
    return ["every send follows the compute that made its tensor, every receive precedes the compute "
            "that consumes it", "each stage is gathered (UNSHARD) before its first compute and freed "
            "(RESHARD) after its last, and reduces its gradients (REDUCE_GRAD) after its last backward"]
