"""Tests for course_lib.parallel.tp.overlap, notebook 05's measurement of asynchronous TP.

lanes() tiles a step exactly (pure). On real gloo ranks at tp = 2 and 4, mlp_on_rank's MLP
(sequence parallel, plain or async) gives the same output and gradients both ways; the async
one's traffic is point-to-point only (plus the bias gradient's all-reduce both have) and its
bytes are the ring bytes of the collectives it replaces, 5 (p-1)/p M for forward + backward;
the timer sees every blocking call and every wait (counts against the tracer's), its main lane
tiles the timed step and its link spans lie inside it. No times are asserted.
"""

import pytest
import torch

from course_lib import run_on_ranks
from course_lib.parallel.tp.overlap import lanes, mlp_on_rank, plot_ring_steps

from _tolerances import assert_close_fp32_sums

B, S, D = 2, 16, 32


def test_lanes_fill_the_gaps_as_compute():
    main, link = lanes([("wait", 2.0, 3.0, "comm"), ("all_reduce", 5.0, 6.0, "comm")], [("send/recv", 1.0, 3.0, "send/recv")],
                       0.0, 7.0)
    assert main == [("compute", 0.0, 2.0, "compute"), ("wait", 2.0, 3.0, "comm"), ("compute", 3.0, 5.0, "compute"),
                    ("all_reduce", 5.0, 6.0, "comm"), ("compute", 6.0, 7.0, "compute")]
    assert link == [("send/recv", 1.0, 3.0, "send/recv")]


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_plain_and_async(tp):
    res = {a: run_on_ranks(mlp_on_rank, a, B, S, D, 2, world_size=tp, backend="gloo", timeout_s=120) for a in (False, True)}
    message = B * S * D * 4  # bytes of the (B, S, D) fp32 activation entering fc and leaving proj
    for r in range(tp):
        plain, asy = res[False][r], res[True][r]
        # the same matmuls, their sums split into ring chunks: fp32 rounding of another order
        assert_close_fp32_sums(asy["output"], plain["output"])
        for got, want in zip(asy["grads"], plain["grads"]):
            assert_close_fp32_sums(got, want)
        # async: only point-to-point, plus the row-parallel bias's gradient all-reduce both runs have
        assert set(asy["traffic"]) == {"isend", "irecv", "all_reduce"}
        assert asy["traffic"]["all_reduce"] == plain["traffic"]["all_reduce"]
        ring = ((tp - 1) * plain["traffic"]["all_gather_single"]["bytes_sent"]  # n-1 shards pass each link
                + (tp - 1) * plain["traffic"]["reduce_scatter_single"]["bytes_sent"] // tp)  # (n-1)/n of the input
        assert asy["traffic"]["isend"]["bytes_sent"] == ring == 5 * (tp - 1) * message // tp
        assert asy["traffic"]["irecv"]["bytes_recv"] == ring
        for out, waits in ((plain, sum(s["calls"] for s in plain["traffic"].values())),
                           (asy, asy["traffic"]["isend"]["calls"] + asy["traffic"]["irecv"]["calls"] + 1)):
            main, link = out["lanes"]
            assert sum(e[3] == "comm" for e in main) == waits  # every blocking call or wait seen
            assert all(a[2] == b[1] for a, b in zip(main, main[1:]))  # the lane tiles the step
            assert out["exposed"][-1] == pytest.approx(sum(e[2] - e[1] for e in main if e[3] == "comm"))
            assert all(main[0][1] <= e[1] <= e[2] <= main[-1][2] for e in link)
        assert not plain["lanes"][1] and len(asy["lanes"][1]) >= 3 * (tp - 1)


def test_ring_picture_has_a_lane_per_rank_and_link():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    plot_ring_steps(ax, 3)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 0 link", "rank 1", "rank 1 link",
                                                            "rank 2", "rank 2 link"]
    assert sum("x0 @" in t.get_text() for t in ax.texts) == 3  # every rank multiplies chunk 0 once
    plt.close(fig)
