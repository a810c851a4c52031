"""The profiling helper: a trace per rank, the timeline read back from it, MFU."""

import json

import pytest

from course_lib.measure.profile import profile_on_ranks
from course_lib.observe.profile import classify, mfu, step_mfu, trace_timeline
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.train import TrainConfig, TrainResult


def test_profiles_a_strategy_and_reads_its_collectives_back(tiny_config, tmp_path):
    cfg = TrainConfig(steps=2, batch_size=4, progress=False)
    results, paths = profile_on_ranks(train_data_parallel, tiny_config, cfg, world_size=2, out_dir=tmp_path,
                                      timeout_s=120)
    assert [p.split("/")[-1] for p in paths] == ["rank0.json", "rank1.json"]
    assert all(len(r.train_losses) == 2 for r in results)
    for path in paths:
        assert "traceEvents" in json.loads(open(path).read())  # a Chrome/Perfetto trace
        events = trace_timeline(path)
        assert [e[1] for e in events] == sorted(e[1] for e in events)
        names = {e[0] for e in events if e[3] == "communication"}
        assert any("all_reduce" in n for n in names), names  # DDP's gradient all-reduce
        assert {"compute", "backward"} <= {e[3] for e in events}
        # top level only: no two compute events of the timeline overlap (an ordering the reader
        # guarantees in the trace's microseconds, not a duration; + 1e-9 s for their float rounding
        # when converted to seconds, ~1e-16 relative of timestamps up to ~1e6 s)
        main = [e for e in events if e[3] != "communication"]
        assert all(a[2] <= b[1] + 1e-9 for a, b in zip(main, main[1:]))


def test_classify_and_mfu():
    assert classify("gloo:all_reduce") == "communication" and classify("aten::mm") == "compute"
    assert classify("autograd::engine::evaluate_function: MmBackward0") == "backward"
    assert mfu(4e12, 2.0, 2, 1e12) == 1.0  # made-up seconds: a formula, exact in float64
    assert step_mfu(TrainResult(step_seconds=[1.0, 2.0]), 1e12, 1, 1e12) == [1.0, 0.5]
    with pytest.raises(ValueError, match="seconds=0"):
        mfu(1.0, 0, 1, 1.0)
    with pytest.raises(ValueError, match="n_devices=0"):
        mfu(1.0, 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="no step_seconds"):
        step_mfu(TrainResult(), 1.0, 1, 1.0)
    with pytest.raises(ValueError, match="train_fn=3"):
        profile_on_ranks(3, world_size=2, out_dir="/tmp/unused")
