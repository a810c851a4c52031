"""run_on_ranks: results, output, failures, timeouts, mismatches, bad input, pool reuse."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from course_lib import RankError, RankTimeout, run_on_ranks
from course_lib.observe.checks import CollectiveMismatch
from course_lib.runtime import rank_device, threads_per_rank
from course_lib.runtime.pool import live_pools


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_results_come_back_in_rank_order(world_size):
    assert run_on_ranks(rank_and_size, world_size=world_size, timeout_s=60) == [(r, world_size) for r in range(world_size)]


def test_closures_lambdas_and_arguments_travel():
    offset = 10

    def add(x, *, scale):
        return (dist.get_rank() + offset + x) * scale

    assert run_on_ranks(add, 1, world_size=2, scale=2, timeout_s=60) == [22, 24]
    assert run_on_ranks(lambda: torch.ones(2) * dist.get_rank(), world_size=2)[1].tolist() == [1.0, 1.0]


def test_all_reduce_sums_across_ranks():
    def f():
        t = torch.tensor([float(dist.get_rank() + 1)], device=rank_device())  # NCCL: the rank's device
        dist.all_reduce(t)
        return t.item()

    assert run_on_ranks(f, world_size=4) == [10.0] * 4


def test_output_is_grouped_by_rank_in_rank_order(capsys):
    def noisy():
        r = dist.get_rank()
        time.sleep(0.05 * (3 - r))  # higher ranks finish first: order must not depend on it
        print(f"hello {r}")
        print(f"bye {r}")

    run_on_ranks(noisy, world_size=4)
    out = capsys.readouterr().out.splitlines()
    assert out == [line for r in range(4) for line in (f"[rank {r}] hello {r}", f"[rank {r}] bye {r}")]


def test_pool_is_reused_and_each_call_is_reseeded():
    pids1 = run_on_ranks(os.getpid, world_size=2)
    draws1 = run_on_ranks(lambda: torch.rand(3).tolist(), world_size=2)
    pids2 = run_on_ranks(os.getpid, world_size=2)
    draws2 = run_on_ranks(lambda: torch.rand(3).tolist(), world_size=2)
    assert pids1 == pids2
    assert len(set(pids1)) == 2 and os.getpid() not in pids1
    assert draws1 == draws2  # same RNG state at the start of every call
    assert draws1[0] != draws1[1]  # but different per rank


def _make_groups_and_count():
    from course_lib.runtime.groups import live_groups

    threads = len(os.listdir("/proc/self/task"))
    for _ in range(5):
        dist.new_group([0, 1])
    return threads, len(live_groups()), len(os.listdir("/proc/self/task"))


def _count_now():
    from course_lib.runtime.groups import live_groups

    return len(live_groups()), len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_a_calls_process_groups_and_their_threads_end_with_it():
    # gloo groups own native threads that take CPU from later runs (course_lib.runtime.groups):
    # a pool that kept every call's groups slowed the planner's benchmark by its last layouts
    made = run_on_ranks(_make_groups_and_count, world_size=2)
    after = run_on_ranks(_count_now, world_size=2)
    for (threads_before, groups, threads_with), (groups_after, threads_after) in zip(made, after):
        assert groups == 5 and threads_with > threads_before  # the groups and their threads existed
        assert groups_after == 0 and threads_after == threads_before  # and are gone when the next call starts


def _dtensor_sum_on_a_fresh_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu")  # a new group every call
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    return x.sum().full_tensor().item()  # sum of shards: a Partial output, then an all-reduce


def test_a_new_mesh_of_the_same_layout_works_after_the_old_ones_groups_are_destroyed():
    # DTensor caches an operator's output spec, mesh included, by input specs; a DeviceMesh
    # equals any other of the same ranks and names whatever groups it holds. With the old
    # groups destroyed and the cache kept, the second call all-reduced on the first call's mesh:
    # "Could not resolve the process group registered under the name N" (bench_composed, round 2)
    for _ in range(2):
        assert run_on_ranks(_dtensor_sum_on_a_fresh_mesh, world_size=2) == [6.0, 6.0]


def test_threads_are_shared_out():
    got = run_on_ranks(torch.get_num_threads, world_size=2)
    assert got == [threads_per_rank(2)] * 2
    assert threads_per_rank(64) == 1


def test_exception_names_rank_and_traceback_and_pool_recovers():
    def fail_on_rank_2():
        if dist.get_rank() == 2:
            raise ValueError("boom on two")
        dist.barrier()  # the others are stuck waiting for rank 2
        return "ok"

    # The caller learns at once, not after timeout_s: with timeout_s far beyond pytest's own
    # timeout (300 s, pyproject), a pool that waited for the stuck ranks would hang the test until
    # pytest stops it. No wall-clock assert: how long 4 ranks take to start depends on the load.
    with pytest.raises(RankError) as info:
        run_on_ranks(fail_on_rank_2, world_size=4, timeout_s=3600)
    assert list(info.value.failures) == [2]
    assert "ValueError: boom on two" in str(info.value) and "rank 2" in str(info.value)
    assert run_on_ranks(rank_and_size, world_size=4) == [(r, 4) for r in range(4)]


def test_stuck_rank_times_out_naming_the_stuck_ranks():
    def rank_0_skips_the_barrier():
        if dist.get_rank() != 0:
            dist.barrier()
        return dist.get_rank()

    with pytest.raises(RankTimeout) as info:
        run_on_ranks(rank_0_skips_the_barrier, world_size=3, timeout_s=5)
    assert info.value.stuck_ranks == [1, 2]
    assert "timeout_s=5" in str(info.value)
    assert run_on_ranks(rank_and_size, world_size=3) == [(0, 3), (1, 3), (2, 3)]


def test_dead_rank_is_reported():
    def die():
        if dist.get_rank() == 1:
            os._exit(3)
        return 0

    with pytest.raises(RankError, match="exit"):
        run_on_ranks(die, world_size=2, timeout_s=30)
    assert run_on_ranks(rank_and_size, world_size=2) == [(0, 2), (1, 2)]


def test_mismatched_shapes_raise_instead_of_wrong_numbers():
    def mismatched():
        t = torch.ones(3 + dist.get_rank())
        dist.all_reduce(t)
        return t.tolist()

    with pytest.raises(RankError) as info:
        run_on_ranks(mismatched, world_size=2, timeout_s=30)
    text = str(info.value)
    assert CollectiveMismatch.__name__ in text and "shape=[3]" in text and "shape=[4]" in text


def test_mismatched_ops_raise():
    def mismatched():
        t = torch.ones(4)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
        return t.tolist()

    with pytest.raises(RankError, match="all_reduce.*\n.*broadcast|broadcast.*\n.*all_reduce"):
        run_on_ranks(mismatched, world_size=2, timeout_s=30)


def test_point_to_point_between_some_ranks_does_not_upset_the_checks():
    def pipeline_like():
        r = dist.get_rank()
        if r == 0:
            dist.send(torch.ones(2, device=rank_device()), dst=1)
        elif r == 1:
            buf = torch.zeros(2, device=rank_device())
            dist.recv(buf, src=0)
        t = torch.ones(2, device=rank_device())
        dist.all_reduce(t)
        return t.tolist()

    assert run_on_ranks(pipeline_like, world_size=3) == [[3.0, 3.0]] * 3


def test_unpicklable_result_is_a_rank_error():
    with pytest.raises(RankError):
        run_on_ranks(lambda: (x for x in range(3)), world_size=2)  # generators cannot be pickled


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size=0 must be between 1 and 64"),
    ({"world_size": 1000}, "world_size=1000 must be between 1 and 64"),
    ({"world_size": 2.5}, "world_size=2.5 must be an int"),
    ({"backend": "mpi"}, "backend='mpi' is unknown"),
    ({"timeout_s": 0}, "timeout_s=0 must be a positive"),
])
def test_bad_input_is_rejected_before_any_process_starts(kwargs, message):
    before = live_pools()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_on_ranks(rank_and_size, **kwargs)
    assert live_pools() == before


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="this machine has GPUs")
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank"):
        run_on_ranks(rank_and_size, world_size=2, backend="nccl")


def test_the_default_backend_is_gloo_and_auto_is_gloo_on_cpu():
    assert run_on_ranks(lambda: dist.get_backend(), world_size=2) == ["gloo"] * 2  # even with GPUs
    expected = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    assert run_on_ranks(lambda: dist.get_backend(), world_size=2, backend="auto") == [expected] * 2


def test_interrupting_the_caller_stops_the_ranks_and_the_next_call_works():
    """Ctrl-C / "interrupt kernel" while ranks are busy: no hang, no orphaned ranks."""
    import signal
    import threading

    pids = run_on_ranks(os.getpid, world_size=2)
    # SIGINT is what a kernel interrupt sends; Python turns it into KeyboardInterrupt only under
    # its default handler, and a process started in the background by a shell without job
    # control (`cmd &` in a script) inherits SIGINT ignored. Install the default handler so the
    # test exercises the pool, not how the test run was launched.
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_on_ranks(time.sleep, 30, world_size=2, timeout_s=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, saved)
    for pid in pids:  # the interrupted pool's processes are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run_on_ranks(rank_and_size, world_size=2) == [(0, 2), (1, 2)]


def test_every_forkserver_preload_name_imports():
    """multiprocessing skips a preload name that fails to import without a word: the ranks
    would silently lose their warm start. Every name must import."""
    import importlib

    from course_lib.runtime.pool import FORKSERVER_PRELOAD

    assert "course_lib.runtime.worker" in FORKSERVER_PRELOAD
    for name in FORKSERVER_PRELOAD:
        importlib.import_module(name)


def _rank_and_world():
    return dist.get_rank(), dist.get_world_size()


def test_a_port_taken_before_rank_0_listens_is_replaced_by_another(monkeypatch):
    """free_port() can only find a port that was free a moment ago; when another program takes it
    first, rank 0 cannot listen (EADDRINUSE) and the group starts again on a fresh port."""
    import socket

    from course_lib.runtime import pool

    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("0.0.0.0", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    ports = iter([taken])
    real = pool.free_port
    tried = []

    def free_port():
        port = next(ports, None) or real()
        tried.append(port)
        return port

    monkeypatch.setattr(pool, "free_port", free_port)
    pool.shutdown_pools()
    try:
        assert run_on_ranks(_rank_and_world, world_size=2, timeout_s=60) == [(0, 2), (1, 2)]
    finally:
        blocker.close()
        pool.shutdown_pools()
    assert tried[0] == taken and len(tried) == 2 and tried[1] != taken
