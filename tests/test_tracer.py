"""CommTracer counts, merge helper, timeline and mesh layout."""

import pytest
import torch
import torch.distributed as dist

from course_lib import CommTracer, Timeline, make_mesh, merge_summaries, mesh_groups, run_on_ranks
from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.observe.timeline import merge_timelines
from course_lib.runtime.device import rank_device


def traced_mix(numel):
    """A fixed mix of ops on every rank; returns this rank's summary."""
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.ones(numel, device=rank_device())
    with CommTracer() as tracer:
        dist.all_reduce(t)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        out = torch.empty(n * numel, device=rank_device())
        all_gather_single(out, t)
        shard = torch.empty(numel, device=rank_device())
        reduce_scatter_single(shard, torch.ones(n * numel, device=rank_device()))
        if r == 0:
            dist.send(torch.ones(5, dtype=torch.float64, device=rank_device()), dst=1)
        elif r == 1:
            dist.recv(torch.empty(5, dtype=torch.float64, device=rank_device()), src=0)
        ops = [dist.P2POp(dist.isend, t, (r + 1) % n),
               dist.P2POp(dist.irecv, torch.empty(numel, device=rank_device()), (r - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    outside = torch.ones(1, device=rank_device())
    dist.all_reduce(outside)  # after the block: must not be counted
    return tracer.summary()


def test_counts_and_bytes_follow_the_documented_rules():
    n, numel = 3, 10
    per_rank = run_on_ranks(traced_mix, numel, world_size=n)
    s = 4 * numel  # bytes of one float32 tensor
    for r, summary in enumerate(per_rank):
        assert summary["all_reduce"] == {"calls": 2, "bytes_sent": 2 * s, "bytes_recv": 2 * s}
        assert summary["broadcast"] == {"calls": 1, "bytes_sent": s if r == 0 else 0, "bytes_recv": 0 if r == 0 else s}
        gather_op = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        assert summary[gather_op] == {"calls": 1, "bytes_sent": s, "bytes_recv": n * s}
        scatter_op = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        assert summary[scatter_op] == {"calls": 1, "bytes_sent": n * s, "bytes_recv": s}
        assert summary["isend"] == {"calls": 1, "bytes_sent": s, "bytes_recv": 0}
        assert summary["irecv"] == {"calls": 1, "bytes_sent": 0, "bytes_recv": s}
    assert per_rank[0]["send"] == {"calls": 1, "bytes_sent": 40, "bytes_recv": 0} and "recv" not in per_rank[0]
    assert per_rank[1]["recv"] == {"calls": 1, "bytes_sent": 0, "bytes_recv": 40} and "send" not in per_rank[1]
    assert "send" not in per_rank[2] and "recv" not in per_rank[2]

    merged = merge_summaries(per_rank)
    assert merged["send"]["calls"] == [1, 0, 0]
    assert merged["all_reduce"]["bytes_sent"] == [2 * s] * n


def test_tracer_restores_the_original_functions():
    def f():
        before = dist.all_reduce
        with CommTracer():
            inside = dist.all_reduce
        return before is dist.all_reduce and inside is not before

    assert run_on_ranks(f, world_size=2) == [True, True]


def test_tracer_feeds_the_timeline():
    def f():
        tl = Timeline()
        with tl.span("compute"):
            torch.ones(100, device=rank_device()).sum()
        with CommTracer(timeline=tl):
            dist.all_reduce(torch.ones(4, device=rank_device()))
        return tl.events

    per_rank = run_on_ranks(f, world_size=2)
    for events in per_rank:
        assert [(e[0], e[3]) for e in events] == [("compute", "compute"), ("all_reduce", "comm")]
    merged = merge_timelines(per_rank)
    assert min(e[2] for e in merged) == 0.0
    assert all(e[3] >= e[2] for e in merged)


def test_timeline_rejects_backwards_events():
    with pytest.raises(ValueError, match="ends"):
        Timeline().add("x", 2.0, 1.0)


def test_mesh_groups_put_tensor_parallel_innermost():
    g = mesh_groups(8, dp=2, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs, message", [
    ({"dp": 2, "tp": 3}, r"pp\*dp\*ep\*tp = 1\*2\*1\*3 = 6 must equal world_size=4"),
    ({"dp": 0, "tp": 4}, "dp=0 must be a positive int"),
])
def test_mesh_bad_degrees(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mesh_groups(4, **kwargs)


def test_make_mesh_groups_match_the_layout():
    def f():
        mesh = make_mesh(dp=2, tp=2)
        return [dist.get_process_group_ranks(mesh[d].get_group()) for d in ("dp", "tp")]

    got = run_on_ranks(f, world_size=4)
    layout = mesh_groups(4, dp=2, tp=2)
    for r, (dp_group, tp_group) in enumerate(got):
        assert dp_group in layout["dp"] and r in dp_group
        assert tp_group in layout["tp"] and r in tp_group


@pytest.mark.gloo_only("receives from any source (src=None) on purpose, which gloo has and NCCL refuses: "
                        "the tracer names the sender it learns from gloo")
def test_records_name_the_group_and_the_peer():
    def f():
        evens = dist.new_group([0, 2])
        r = dist.get_rank()
        with CommTracer() as tracer:
            if r in (0, 2):
                dist.all_reduce(torch.ones(3, device=rank_device()), group=evens)
            if r == 0:
                dist.send(torch.ones(1, device=rank_device()), dst=3)
            if r == 3:
                dist.recv(torch.ones(1, device=rank_device()))  # from any source: the tracer records who sent
        return [(rec.op, rec.group_ranks, rec.peer, rec.dtype, rec.numel) for rec in tracer.records]

    got = run_on_ranks(f, world_size=4)
    assert got[0] == [("all_reduce", (0, 2), None, "float32", 3), ("send", (0, 1, 2, 3), 3, "float32", 1)]
    assert got[1] == []
    assert got[2] == [("all_reduce", (0, 2), None, "float32", 3)]
    assert got[3] == [("recv", (0, 1, 2, 3), 0, "float32", 1)]


def _layer_order():
    from course_lib.observe import patching

    seen = []

    class Spy:
        ops = frozenset({"all_reduce", "all_gather_single", "all_gather_into_tensor"})

        def __init__(self, name):
            self.name = name

        def around(self, op, args, call):
            seen.append((self.name, op))
            return call()

    outer, inner = Spy("outer"), Spy("inner")
    patching.add_layer(outer)
    patching.add_layer(inner)
    try:
        with CommTracer() as tracer:
            dist.all_reduce(torch.ones(2, device=rank_device()))
            # torch's all_gather_into_tensor is built on all_gather_single: one call, seen once
            dev = rank_device()
            all_gather_single(torch.empty(2 * dist.get_world_size(), device=dev), torch.ones(2, device=dev))
    finally:
        patching.remove_layer(outer)
        patching.remove_layer(inner)
    return seen, [r.op for r in tracer.records], dist.all_reduce is patching.real("all_reduce")


def test_patching_composes_layers_in_order_and_sees_nested_calls_once():
    """Layers run in order; nobody sees the checks' fingerprint exchange (it calls torch's own
    function); a call torch makes inside a call is not seen again."""
    for seen, traced, restored in run_on_ranks(_layer_order, world_size=2):
        gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        assert seen == [("outer", "all_reduce"), ("inner", "all_reduce"), ("outer", gather), ("inner", gather)]
        assert traced == ["all_reduce", gather]
        assert not restored  # the checks layer is still in place after the others left
