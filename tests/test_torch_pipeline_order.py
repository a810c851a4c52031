"""torch.distributed.pipelining's action lists, read without running, beside the course's
(course_lib/parallel/pp/torch_order.py, notebook 06 section 14): the translation of torch's
actions into ours, the comparison, and the agreements and differences the notebook states."""

import pytest

from course_lib.parallel.pp import Action, ScheduleError, check_schedule, in_flight, make_schedule, schedule_events
from course_lib.parallel.pp.bubble import formula_for, measured_bubble
from course_lib.parallel.pp.p2p_plan import plan_messages
from course_lib.parallel.pp.torch_order import (TORCH_NAMES, check_lowered, comm_counts, compare, to_course,
                                                torch_lacks, torch_order, traced_order)
from course_lib.parallel.pp.viz import messages_per_step

P, M = 4, 8
V = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}


def needs(name):
    why = torch_lacks(name)
    if why:
        pytest.skip(why)


def traced(name, p, m):
    try:
        return to_course(name, p, m, traced_order(name, p, m))
    except RuntimeError as e:  # an older torch whose loop needs more of a stage: the sentence says so
        pytest.skip(str(e))


def both(name, p=P, m=M):
    needs(name)
    ours = make_schedule(name, p, m, V[name])
    theirs = to_course(name, p, m, torch_order(name, p, m))
    return ours, theirs, compare(ours, theirs)


def torch_action(text):
    from torch.distributed.pipelining.schedules import _Action

    return _Action.from_str(text)


def test_the_translation_of_each_kind():
    needs("zbv")
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _Action

    pair = _Action(-1, OVERLAP_F_B, None, (torch_action("0F1"), torch_action("3B0")))
    # p = 2 in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    order = [[torch_action(t) for t in ("0UNSHARD", "3UNSHARD", "0F0", "0SEND_F0")] + [pair]
             + [torch_action(t) for t in ("3I1", "3W1", "0RECV_B0", "0B0")],
             [torch_action("1F0"), torch_action("2I0")]]
    sched = to_course("zbv", 2, 2, order)
    assert [str(a) for a in sched.actions[0]] == ["F0", "F1", "B0.1", "W0.1", "B1.1", "W1.1", "B0", "W0"]
    assert sched.pairs(0) == {1} and sched.pairs(1) == set() and sched.placement == "v"
    assert [str(a) for a in sched.actions[1]] == ["F0", "B0.1"]  # stage 2 is rank 1's second chunk
    # without any I or W in the lists, torch's B is our B alone
    one = to_course("1f1b", 2, 1, [[torch_action("0F0"), torch_action("0B0")], [torch_action("1F0"), torch_action("1B0")]])
    assert [[str(a) for a in r] for r in one.actions] == [["F0", "B0"], ["F0", "B0"]]
    with pytest.raises(ValueError, match="runs stage 1"):
        to_course("1f1b", 2, 1, [[torch_action("1F0")], []])


def test_compare_names_the_first_difference():
    ours = make_schedule("1f1b", 2, 2)
    swapped = make_schedule("gpipe", 2, 2)  # rank 1: F0 F1 B0 B1 against 1F1B's F0 B0 F1 B1
    cmp = compare(ours, swapped)
    assert cmp[0].agree and not cmp[1].agree
    assert (cmp[1].first, cmp[1].ours, cmp[1].theirs, cmp[1].same_actions) == (1, "B0", "F1", True)
    assert str(cmp[1]) == "rank 1: the same actions, first difference at position 1: ours B0, torch's F1"


@pytest.mark.parametrize("name", ["gpipe", "interleaved_1f1b"])
@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (4, 12)])
def test_gpipe_and_interleaved_are_our_lists_exactly(name, p, m):
    ours, theirs, cmp = both(name, p, m)
    assert all(c.agree for c in cmp), [str(c) for c in cmp]
    assert theirs.actions == ours.actions


@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (3, 6)])
def test_1f1b_torch_runs_our_order_and_its_list_differs_only_by_the_stated_shift(p, m):
    ours, theirs, cmp = both("1f1b", p, m)
    for name in ("1f1b", "gpipe"):
        assert traced(name, p, m).actions == make_schedule(name, p, m).actions  # what torch's step runs is ours, exactly
    assert all(c.agree for c in cmp[:-1])
    last = ours.actions[p - 1]
    shifted = [Action(a.kind, a.microbatch + (a.kind == "F"), a.chunk) for a in last]
    assert theirs.actions[p - 1] in (last, shifted)  # the notebook's sentence covers both cases
    if theirs.actions[p - 1] == shifted:  # torch 2.13: the list names micro-batch m, which does not exist
        with pytest.raises(ScheduleError, match=f"F{m} is not an action"):
            check_schedule(theirs)


def test_zbv_other_order_same_actions_bubble_and_peak():
    ours, theirs, cmp = both("zbv")
    check_schedule(theirs)
    assert cmp[0].agree and all(c.same_actions for c in cmp)
    assert any(not c.agree for c in cmp)  # the notebook explains a difference: it must exist
    for sched in (ours, theirs):
        assert abs(measured_bubble(schedule_events(sched)) - formula_for("zbv", P, M)) < 1e-12  # float64 only
        assert max(in_flight(sched, until="W")) == 2 * P


def test_dualpipev_the_differences_the_notebook_states():
    ours, theirs, cmp = both("dualpipev")
    check_schedule(theirs)
    assert all(c.same_actions and not c.agree for c in cmp)
    assert all(theirs.pairs(r) for r in range(P))  # torch's overlapped pairs arrive as F&B pairs
    for sched in (ours, theirs):
        assert abs(measured_bubble(schedule_events(sched)) - formula_for("dualpipev", P, M)) < 1e-12  # float64 only
    peak_ours, peak_torch = max(in_flight(ours, until="W")), max(in_flight(theirs, until="W"))
    assert peak_torch < peak_ours <= 2 * P + 2

    def whole(sched, r):
        acts = sched.actions[r]
        return sum(a.kind == "B" and i + 1 < len(acts) and acts[i + 1] == Action("W", a.microbatch, a.chunk)
                   for i, a in enumerate(acts))

    assert all(whole(ours, r) < whole(theirs, r) for r in range(P))


def test_the_lowered_list_has_our_messages_in_place():
    needs("zbv")
    lowered = torch_order("zbv", P, M, with_comms=True)
    counts = comm_counts(lowered)
    sends = sum(c["SEND_F"] + c["SEND_B"] for c in counts)
    ours = sum(op == "send" for batches in plan_messages(make_schedule("zbv", P, M, 2)).batches
               for _, batch in batches for op, _, _ in batch)
    assert sends == sum(c["RECV_F"] + c["RECV_B"] for c in counts) == messages_per_step(P, M, 2, "v") == ours == 96
    assert all(c["UNSHARD"] == c["RESHARD"] == c["REDUCE_GRAD"] == 2 for c in counts)
    assert len(check_lowered(lowered)) == 2
    # a send moved in front of the compute that makes its tensor is caught
    broken = [list(r) for r in lowered]
    i = next(i for i, a in enumerate(broken[1]) if str(a) == "1SEND_F0")
    broken[1].insert(0, broken[1].pop(i))
    with pytest.raises(ValueError, match="1SEND_F0"):
        check_lowered(broken)


def test_refusals():
    with pytest.raises(ValueError, match="must be one of"):
        torch_lacks("zero_bubble")
    needs("1f1b")
    with pytest.raises(ValueError, match="multi-stage"):
        torch_order("1f1b", P, M, with_comms=True)
    with pytest.raises(ValueError, match="single-stage"):
        traced_order("zbv", P, M)
    assert set(TORCH_NAMES) == set(V)
