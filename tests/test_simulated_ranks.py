"""64 ranks simulated in one process (torch's LocalTensorMode) against the planner's per-rank
parameters and collectives (course_lib.measure.simulated_ranks, notebook 11).

Exact where the two are exact: parameter counts and bytes, calls, bytes handed to each
collective; the loss and gradient norm against one process within fp32 reordering."""

from __future__ import annotations

import pytest
import torch

from course_lib.data import CharDataset, get_batch
from course_lib.dims import ParallelDims, groups
from course_lib.measure.simulated_ranks import local_tensor_missing, one_process, planned, side_by_side, simulate_dp_tp
from course_lib.model import GPTConfig
from course_lib.tolerances import FIRST_GRAD_NORM_RTOL

pytestmark = pytest.mark.skipif(local_tensor_missing() is not None, reason=str(local_tensor_missing()))

V = CharDataset("train", 32).vocab_size  # 97: not a multiple of 8
WIDE = GPTConfig(vocab_size=V, block_size=32, n_layer=2, n_head=8, d_model=64)  # notebook 11's


def _batch(rows):
    return get_batch(CharDataset("train", 32), rows, torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def dp8tp8():
    batch = _batch(8)
    return simulate_dp_tp(WIDE, dp=8, tp=8, batch_size=8, data=batch), batch


def _agrees(sim, plan):
    return all(r["calls"][0] == r["calls"][1] and r["bytes"][0] == r["bytes"][1] and r["sent"][0] == r["sent"][1]
               for r in side_by_side(sim, plan))


def test_64_ranks_agree_with_the_planner(dp8tp8):
    sim, _ = dp8tp8
    plan = planned(WIDE, sim.dims, 8, 32)
    assert len(sim.params_per_rank) == 64
    assert sim.groups == {k: v for k, v in groups(sim.dims.sizes()).items() if k in ("dp", "tp")}
    # the busiest rank (tp rank 0 of every replica) holds exactly what the planner prices
    assert max(sim.params_per_rank) == sim.params_per_rank[0] == plan["params"]
    assert 4 * sim.params_per_rank[0] == plan["param_bytes"]
    # rank 7 of each tp group: DTensor's uneven split (torch.chunk) leaves it 97 - 7 * 13 = 6 rows,
    # where the course pads the vocabulary to 104 (13 rows each)
    assert [sim.params_per_rank[r] for r in range(7, 64, 8)] == [plan["params"] - 7 * 64] * 8
    assert sim.param_shapes["tok_emb.weight"][7] == (6, 64)
    assert _agrees(sim, plan)
    # every tp call is one of the planner's records, size for size (13 = 4L + 2 + 3)
    want = sorted((c.op, c.nbytes) for c in plan["records"]["tp"] for _ in range(c.calls))
    assert sorted((op, b) for op, b, n in sim.calls["tp"]) == want and len(want) == 13
    assert {n for _, _, n in sim.calls["tp"] + sim.calls["dp"]} == {8} and sim.calls["norm"] == [("all_reduce", 8, 64)]
    # torch's CommDebugMode counts the calls the byte recorder saw
    assert {k: sum(v.values()) for k, v in sim.torch_counts.items()} == {k: len(v) for k, v in sim.calls.items()}


def test_the_comparison_can_fail(dp8tp8):
    """The planner's numbers for another layout (tp 4) or another batch (twice the rows) do not pass."""
    sim, _ = dp8tp8
    assert not _agrees(sim, planned(WIDE, ParallelDims(dp=2, tp=4), 8, 32))
    assert not _agrees(sim, planned(WIDE, ParallelDims(dp=8, tp=8), 16, 32))
    assert planned(WIDE, ParallelDims(dp=2, tp=4), 8, 32)["params"] != sim.params_per_rank[0]


def test_the_simulated_step_computes_the_single_process_step(dp8tp8):
    sim, batch = dp8tp8
    loss, norm = one_process(WIDE, batch, dp=8)
    assert abs(sim.loss - loss) < 1e-5  # fp32 loss ~4.6 (spacing 4.8e-7), the same sums in another order
    assert abs(sim.grad_norm - norm) <= FIRST_GRAD_NORM_RTOL["fp32"] * norm  # tolerances.py: reordered fp32 sums


def test_an_even_vocabulary_gives_every_rank_the_planners_count():
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=1, n_head=4, d_model=32)
    batch = _batch(4)
    sim = simulate_dp_tp(cfg, dp=2, tp=4, batch_size=4, data=(batch[0] % 96, batch[1] % 96))
    plan = planned(cfg, sim.dims, 4, 32)
    assert sim.params_per_rank == [plan["params"]] * 8 and _agrees(sim, plan)


def test_bad_input():
    with pytest.raises(ValueError, match="must divide"):
        simulate_dp_tp(WIDE, dp=2, tp=3, batch_size=2, data=_batch(2))
    with pytest.raises(ValueError, match="rows of data"):
        simulate_dp_tp(WIDE, dp=2, tp=2, batch_size=4, data=_batch(2))
