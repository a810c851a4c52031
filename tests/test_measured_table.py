"""measure_table's `between`: the compute run before each timed call, and what is taken off.

The clock and the calls are replaced by a counter that advances by fixed amounts (a call 1/4,
the compute 1), so what the table keeps is exact: a measured time would be the machine's."""

import torch.distributed as dist

from course_lib.runtime import rank_device, run_on_ranks

CALL, COMPUTE, ITERS = 0.25, 1.0, 6


def _table(spaced: bool, slow_rank: int | None = None):
    """slow_rank: that rank's compute takes 2 COMPUTE, and every call waits for it, as a
    collective waits for its last rank (the others' calls last COMPUTE longer)."""
    from course_lib.comm import measured

    clock = {"now": 0.0, "between": 0, "calls": 0, "in_loop": False}
    compute = 2 * COMPUTE if dist.get_rank() == slow_rank else COMPUTE
    wait = 0.0 if slow_rank is None or not spaced else 2 * COMPUTE - compute

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock["now"]

    def fake_call(op, group, peer, shard, recv, full):
        clock["now"] += CALL + (wait if clock["in_loop"] else 0.0)
        clock["calls"] += 1

    def between():
        clock["now"] += compute
        clock["between"] += 1
        # per cell, measure_table runs ITERS stretches alone, then ITERS in its timed loop
        clock["in_loop"] = clock["between"] % (2 * ITERS) not in range(1, ITERS + 1)

    real_time, real_call = measured.time, measured._call
    measured.time, measured._call = FakeTime, fake_call
    try:
        table = measured.measure_table([64, 4096], [2], ops=("all_reduce", "send"), iters=ITERS, rounds=2,
                                       device=rank_device(), between=between if spaced else None)
    finally:
        measured.time, measured._call = real_time, real_call
    dist.barrier()
    return table, clock["between"], clock["calls"]


def test_compute_between_calls_is_run_before_each_call_and_taken_off():
    cells, rounds = 2 * 2, 2  # (all_reduce, send) x 2 sizes, each round
    per_cell_calls = 1 + ITERS  # a warm-up call, then the timed ones
    for table, betweens, calls in run_on_ranks(_table, True, world_size=2, timeout_s=60):
        # once per timed call, and as often again alone (the time taken off)
        assert betweens == 2 * ITERS * cells * rounds
        assert calls == per_cell_calls * cells * rounds
        # only the calls' own time is kept: a send's round trip is two messages
        assert table["all_reduce"]["2"] == [[64, 4096], [CALL, CALL]]
        assert table["send"]["2"] == [[64, 4096], [CALL / 2, CALL / 2]]


def test_without_between_the_calls_run_back_to_back():
    for table, betweens, _ in run_on_ranks(_table, False, world_size=2, timeout_s=60):
        assert betweens == 0
        assert table["all_reduce"]["2"] == [[64, 4096], [CALL, CALL]]


def test_what_is_taken_off_is_the_slowest_ranks_stretch():
    """The step-time model prices compute at the slowest rank's pace (calibrate.paced_seconds),
    so a call's price is what the slowest rank's loop adds to its own stretch: CALL. Rank 0,
    whose stretch is short, waits inside every call for rank 1; its own loop less its own
    stretch would be CALL + COMPUTE, the wait counted twice."""
    for table, _, _ in run_on_ranks(_table, True, 1, world_size=2, timeout_s=60):
        assert table["all_reduce"]["2"] == [[64, 4096], [CALL, CALL]]
        assert table["send"]["2"] == [[64, 4096], [CALL / 2, CALL / 2]]
