"""One per-parameter ZeRO-3 step measured side by side (course_lib.measure.torch_memtracker, notebook 08):
the formula, the course's own measurement, torch's MemTracker on the course's model and FSDPMemTracker
on torch's FSDP2 agree byte for byte on parameters and gradients, and differ on optimizer state and
activations by exactly the parts the notebook names."""

import sys

import cloudpickle
import pytest

from course_lib.data import CharDataset
from course_lib.measure.torch_memtracker import format_three_ways, memory_three_ways, memtracker_missing
from course_lib.model import GPTConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])
MISSING = memtracker_missing()
needs_api = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
RUN = dict(backend="gloo", check_collectives=False, timeout_s=300)


def config(**kw):
    # 97 rows in the embedding and an MLP width of 63: shards need padding rows on 2 and 4 ranks
    return GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=2, d_ff=63, block_size=16, **kw)


def check_columns(rows):
    for r in rows:
        f, c, m, parts = r["formula"], r["course"], r["memtracker"], r["parts"]
        for k in ("params", "grads", "optimizer"):
            assert f[k] == c[k], (r["rank"], k, f[k], c[k])  # formula = course, exactly
        assert m["params"] == c["params"] and m["grads"] == c["grads"]  # MemTracker = course, exactly
        assert parts["step counters"] > 0 and m["optimizer"] == c["optimizer"] + parts["step counters"]
        assert parts["loss total weight"] == 4 and c["activations"] == f["activations"] + parts["loss total weight"]
        assert parts["gathered after forward"] == parts["gathered after forward (formula)"] > 0
        assert m["activations"] == c["activations"] + parts["gathered after forward"] + parts["loss"]
        assert r["other"] > 0  # the batch, registered with track_external
        assert r["peak"] >= sum(m[k] for k in ("params", "activations"))  # the peak is a maximum over the step
        t = r["fsdp2"]  # torch's FSDP2 under FSDPMemTracker
        assert t["params"] == f["params"] and t["grads"] == f["grads"]  # padded storages, every rank
        assert t["optimizer"] == 2 * t["local"] + parts["step counters"]  # m, v of the unpadded rows
        assert t["activations"] == c["activations"] + parts["loss"]
        assert t["gathered after forward"] == parts["gathered after forward (formula)"]
        assert t["inputs"] > 0


@needs_api
@pytest.mark.parametrize("world_size", [2, 4])
def test_three_columns_agree(world_size):
    rows = memory_three_ways(config(), world_size, 8, **RUN)
    assert [r["rank"] for r in rows] == list(range(world_size))
    check_columns(rows)
    first = {k: v for k, v in rows[0].items() if k not in ("rank", "fsdp2")}
    assert all({k: v for k, v in r.items() if k not in ("rank", "fsdp2")} == first for r in rows)  # padded: same
    assert rows[0]["fsdp2"]["local"] == rows[0]["formula"]["params"]  # rank 0's chunks are full: c rows each
    assert rows[-1]["fsdp2"]["local"] < rows[-1]["formula"]["params"]  # the last rank's are short (unpadded)
    text = format_three_ways(rows[0])
    assert "MemTracker" in text and f"{rows[0]['memtracker']['activations']:,}" in text


@needs_api
def test_a_wrong_column_fails():
    """The checks above catch a column off by one element: they compare bytes exactly."""
    rows = memory_three_ways(config(), 2, 4, **RUN)
    check_columns(rows)
    for col, k in (("formula", "params"), ("course", "grads"), ("memtracker", "optimizer"),
                   ("memtracker", "activations"), ("fsdp2", "params"), ("fsdp2", "optimizer"),
                   ("fsdp2", "gathered after forward")):
        broken = [dict(r, **{col: dict(r[col], **{k: r[col][k] + 4})}) for r in rows]
        with pytest.raises(AssertionError):
            check_columns(broken)


def test_bad_batch_refused_before_ranks():
    if MISSING is not None:
        with pytest.raises(RuntimeError, match="MemTracker"):
            memory_three_ways(config(), 4, 6, **RUN)
        return
    with pytest.raises(ValueError, match="divisible by 4"):
        memory_three_ways(config(), 4, 6, **RUN)
    with pytest.raises(ValueError, match="reshard_after_forward=3"):
        memory_three_ways(config(), 4, 8, reshard_after_forward=3, **RUN)


def test_missing_api_is_one_sentence(monkeypatch):
    """On a torch without the private module the reason is one sentence, and the functions raise it."""
    saved = sys.modules.get("torch.distributed._tools.mem_tracker")
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", None)  # import fails
    why = memtracker_missing()
    assert why is not None and "MemTracker" in why and why.endswith(".") and "\n" not in why
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", saved)
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.fsdp2_mem_tracker", None)
    assert "FSDPMemTracker" in memtracker_missing()
    with pytest.raises(RuntimeError, match="MemTracker"):
        memory_three_ways(config(), 2, 4, **RUN)


@needs_api
def test_reshard_after_forward_false_moves_only_activation():
    """Notebook 08's self-check: keeping every block gathered after forward changes MemTracker's
    "Activation" by the blocks' gathered bytes, and nothing else."""
    kept, freed = (memory_three_ways(config(), 2, 4, reshard_after_forward=k, **RUN)[0] for k in (False, True))
    check_columns([kept])
    for k in ("params", "grads", "optimizer"):
        assert kept["memtracker"][k] == freed["memtracker"][k]
    assert kept["course"] == freed["course"] and kept["formula"] == freed["formula"]
    blocks = kept["parts"]["gathered after forward"] - freed["parts"]["gathered after forward"]
    assert blocks > 0 and kept["memtracker"]["activations"] - freed["memtracker"]["activations"] == blocks
    fsdp2 = kept["fsdp2"]["gathered after forward"] - freed["fsdp2"]["gathered after forward"]
    assert fsdp2 == blocks and kept["fsdp2"]["activations"] == freed["fsdp2"]["activations"]
