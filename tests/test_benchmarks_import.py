"""Every benchmark imports: a renamed or removed library name fails here, in seconds. `make
bench-quick` runs each at its smallest size (before a stop that touches them; CI leaves it out
for time), and `make bench` measures."""

import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCH.glob("bench_*.py")), ids=lambda p: p.stem)
def test_the_benchmark_imports_and_has_a_main(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # benchmarks/ is not a package: they import summary, rounds
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs its imports and definitions, not main (its __name__ is not __main__)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
    sys.modules.pop(spec.name, None)
