"""benchmarks/bench_async_tp.py's smoke run (--tiny: 2 gloo ranks, one d32 block, one round): the
report's structure, and the check that async and plain TP trained alike before anything is timed.
No time or ratio of times is asserted."""

import importlib.util
import pathlib
import re
import sys

import cloudpickle
import pytest

from course_lib.tolerances import adamw_loss_atol

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file


@pytest.fixture
def bench(monkeypatch):
    """The benchmark as a module (benchmarks/ is not a package), its summary's dry-run flag restored after."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("_bench_async_tp_smoke", BENCH / "bench_async_tp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # its rank functions travel by value, as under __main__
    summary = sys.modules["summary"]
    was = summary._dry_run
    yield module
    summary.dry_run(was)
    cloudpickle.unregister_pickle_by_value(module)
    sys.modules.pop(spec.name, None)


def test_tiny_run_reports_every_variant_and_equal_losses(bench, capsys):
    assert bench.main(["--tiny", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 gloo ranks" in out and "d32: d_model=32 n_layer=1 n_head=4" in out and "1 rounds" in out, out
    same = re.search(r"^d32: async and plain losses over 3 steps, largest difference (\S+) \(tolerance (\S+)\): same$",
                     out, re.M)
    assert same and float(same.group(1)) <= float(same.group(2)) == float(f"{adamw_loss_atol(3e-3):.1e}"), out
    for name in ("SP d32", "async SP d32"):  # one row per variant: its median step and quartiles, in ms
        assert re.search(rf"^{name}\s+\d+\.\d\s+\d+\.\d-\d+\.\d$", out, re.M), out
    assert re.search(r"^  async TP / plain SP TP, d32\s+\d+\.\d{3}x .*\(quick: not judged\)$", out, re.M), out


def _async_off_by(delta):
    from course_lib.parallel.tp.training import train_tensor_parallel

    def train(config, cfg, sequence_parallel=False, async_tp=False):
        result = train_tensor_parallel(config, cfg, sequence_parallel, async_tp=async_tp)
        if async_tp:  # as if a chunk had been dropped: the losses move
            result.train_losses = [x + delta for x in result.train_losses]
        return result
    return train


def test_async_losses_that_differ_are_refused_before_timing(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench, "train_tensor_parallel", _async_off_by(2 * adamw_loss_atol(3e-3)))
    monkeypatch.setattr(bench, "run_rounds", lambda *a, **k: pytest.fail("timed a run whose losses differ"))
    assert bench.main(["--tiny", "--no-record"]) == 1
    out = capsys.readouterr().out
    assert "(tolerance 7.0e-05): DIFFERENT" in out and "not timed" in out, out
