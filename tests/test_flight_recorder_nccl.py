"""The flight recorder on NCCL (issue 46, point 4): an NCCL call returns as soon as it is queued on
the GPU's stream, so the recorder keeps each entry "issued" until the call's Work object or a
CUDA event recorded after it says the communication ended (course_lib/observe/flight_recorder).

No GPU here: on gloo ranks the test tells the recorder the group is NCCL's (its
`_returns_early`), hands it stand-ins for the event and the Work object whose completion the
test controls, and makes rank 0's second all_reduce return at once without rank 1 ever entering
it, as NCCL's enqueue does. The analysis must name rank 1; with gloo's rule (completed when the
call returns, the old behaviour on NCCL) it finds no stuck call at all."""

import json
import pathlib
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.observe import flight_recorder as fr
from course_lib.observe.flight_recorder import FlightRecorder, analyse, load_dumps

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file


class _Ends:
    """A stand-in for a CUDA event (query) or a Work object (is_completed): ended when told."""

    def __init__(self, ended: bool):
        self.ended = ended

    def query(self) -> bool:
        return self.ended

    def is_completed(self) -> bool:
        return self.ended


class _AsOnNccl:
    """In a rank: the recorder's backend test answers `nccl`; each blocking call's stream event
    comes from `events` (restored on exit: a pool worker runs other tests' code afterwards)."""

    def __init__(self, nccl: bool, events):
        self.nccl, self.events = nccl, events

    def __enter__(self):
        self.saved = fr._returns_early, fr._stream_marker
        fr._returns_early = lambda group: self.nccl
        fr._stream_marker = lambda: self.events.pop(0)
        return self

    def __exit__(self, *exc):
        fr._returns_early, fr._stream_marker = self.saved
        return False


def _skipped_collective(dump_dir, nccl):
    """all_reduce #1 on both ranks (a real gloo call, its event ended); rank 0 then issues #2, which
    returns at once and whose event never ends, and rank 1 never enters it. Each rank dumps."""
    rank, t = dist.get_rank(), torch.ones(2, device=rank_device())  # NCCL: on the rank's device
    with _AsOnNccl(nccl, [_Ends(True), _Ends(False)]), FlightRecorder() as rec:
        dist.all_reduce(t)
        if rank == 0:  # what NCCL's all_reduce does on the CPU side: queue it, return None
            rec.around("all_reduce", {"tensor": t, "group": None, "async_op": False}, lambda: None)
        rec.dump(pathlib.Path(dump_dir) / f"rank_{rank}.json")
    return t.tolist()


def test_a_stuck_nccl_collective_stays_issued_and_the_analysis_names_the_rank_that_skipped_it(tmp_path):
    assert run_on_ranks(_skipped_collective, str(tmp_path), True, world_size=2, timeout_s=60) == [[2.0, 2.0]] * 2
    dumps = load_dumps(tmp_path)
    assert [(e["seq"], e["state"]) for e in dumps[0]] == [(1, "completed"), (2, "issued")]
    assert [(e["seq"], e["state"]) for e in dumps[1]] == [(1, "completed")]
    assert analyse(dumps).splitlines()[0] == (
        "rank 1 never entered all_reduce #2 on group [0, 1] that rank 0 waits in "
        "(its last call: all_reduce #1 on group [0, 1], completed)")


def test_with_gloos_rule_the_same_run_shows_no_stuck_call(tmp_path):
    """What the recorder saw on NCCL before: a call marked completed when Python returned."""
    run_on_ranks(_skipped_collective, str(tmp_path), False, world_size=2, timeout_s=60)
    dumps = load_dumps(tmp_path)
    assert [e["state"] for e in dumps[0]] == ["completed", "completed"]
    assert analyse(dumps) == "no rank is stuck in a call"


def _work_polled():
    """An async_op=True call's Work: issued until is_completed(), then completed at the next poll."""
    work, t = _Ends(False), torch.ones(1, device=rank_device())
    with _AsOnNccl(True, []), FlightRecorder() as rec:
        assert rec.around("all_reduce", {"tensor": t, "group": None, "async_op": True}, lambda: work) is work
        states = [rec.entries[-1]["state"]]
        rec.poll()
        states.append(rec.entries[-1]["state"])  # its work has not ended
        work.ended = True
        rec.poll()
        states.append(rec.entries[-1]["state"])
        return states, "completed_at" in rec.entries[-1]


def test_an_async_work_object_is_polled_from_the_rank_not_called_back():
    assert run_on_ranks(_work_polled, world_size=2, timeout_s=60) == [(["issued", "issued", "completed"], True)] * 2


def _watchdog_dumps(dump_dir):
    """The watchdog dumps by itself once the NCCL call has been pending stuck_after_s."""
    rank, t = dist.get_rank(), torch.ones(2, device=rank_device())
    path = pathlib.Path(dump_dir) / f"rank_{rank}.json"
    with _AsOnNccl(True, [_Ends(True), _Ends(False)]), FlightRecorder(dump_dir, stuck_after_s=0.2, poll_s=0.05) as rec:
        dist.all_reduce(t)
        if rank == 1:
            return None
        rec.around("all_reduce", {"tensor": t, "group": None, "async_op": False}, lambda: None)
        deadline = time.monotonic() + 60  # ends when the file appears; 60 s only turns a broken watchdog into an error
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return [e["state"] for e in json.loads(path.read_text())["entries"]]


def test_the_watchdog_dumps_a_pending_nccl_call_by_itself(tmp_path):
    assert run_on_ranks(_watchdog_dumps, str(tmp_path), world_size=2, timeout_s=120)[0] == ["completed", "issued"]


def _gloo_groups_keep_gloos_rule():
    return fr._returns_early(None), fr._returns_early(dist.new_group([0, 1]))


def test_a_gloo_group_returns_when_its_communication_ends():
    assert run_on_ranks(_gloo_groups_keep_gloos_rule, world_size=2, timeout_s=60) == [(False, False)] * 2


@pytest.mark.parametrize("ended", [True, False])
def test_ended_reads_events_and_works(ended):
    assert fr._ended([_Ends(True), _Ends(ended)]) is ended
