"""The estimator on ZeRO-2/3 composed with pipeline and tensor parallelism (issue 31): the composed
engine's units, its collectives per step (reduce-scatter once per step; stage 3's all-gathers 2m
per unit with reshard_after_forward, 1 without), the memory a rank holds under each policy, and
the planner costing these layouts. Pure Python: no rank is started (tests/test_hybrid_zero_pp.py
runs the engine and checks its tracer against the runtime's own count; the notebook-10 cell
checks the tracer against zero_pp_ops)."""

from dataclasses import replace

import pytest

from course_lib.dims import ParallelDims
from course_lib.estimate import model_state_bytes
from course_lib.estimate.clusters import gpu_cluster
from course_lib.estimate.params import LLAMA3_8B
from course_lib.estimate.per_gpu import composed_zero_memory, zero_units
from course_lib.estimate.planner import search
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.estimate.traffic import dp_traffic, zero_pp_ops
from course_lib.model import GPTConfig

# the tests' tiny GPT: d = 16, f = 4d = 64, T = 16, V = 65, biases, tied embedding
TINY = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, d_model=16)
D, F, T, V = 16, 64, 16, 65
BLOCK_MATRICES = 4 * D * D + 2 * D * F  # qkv, proj, fc, mlp proj
BLOCK_VECTORS = 2 * (D + D) + 3 * D + D + F + D  # 2 LayerNorms (weight, bias), 4 biases


def test_units_by_hand_at_dp2_pp2():
    """Rank 0 holds block 0, the position table and the embedding (tied to the last rank's
    head); rank 1 block 1, the final norm and the head. Stage 2: [matrices - tied, vectors,
    tied]; stage 3: [matrices, vectors] of the rank's one chunk."""
    two = ParallelDims(dp=2, pp=2, zero=2, microbatches=2)
    assert zero_units(TINY, two, 0) == [BLOCK_MATRICES + T * D, BLOCK_VECTORS, V * D]
    assert zero_units(TINY, two, 1) == [BLOCK_MATRICES, BLOCK_VECTORS + 2 * D, V * D]
    three = replace(two, zero=3)
    assert zero_units(TINY, three, 0) == [BLOCK_MATRICES + T * D + V * D, BLOCK_VECTORS]
    # tp = 2 splits the column-parallel matrices and biases and the vocabulary rows
    tp2 = replace(three, tp=2)
    assert zero_units(TINY, tp2, 0) == [BLOCK_MATRICES // 2 + T * D + 33 * D, BLOCK_VECTORS - (3 * D + F) // 2]


def test_ops_by_hand_and_the_policy_ratio_is_2m():
    """dp2 x pp2 at zero 3, m = 2: S_u = ceil(P_u / 2); True gathers each of the 2 units 2m = 4
    times, False once; one reduce-scatter per unit, N S_u elements sent, whatever m is."""
    for m in (2, 4, 8):
        keep = ParallelDims(dp=2, pp=2, zero=3, microbatches=m, reshard_after_forward=False)
        free = replace(keep, reshard_after_forward=True)
        shards = [-(-p // 2) for p in zero_units(TINY, keep, 0)]
        want_keep = {"all_gather": {"calls": 2, "bytes_sent": 4 * sum(shards)},
                     "reduce_scatter": {"calls": 2, "bytes_sent": 2 * 4 * sum(shards)}}
        assert zero_pp_ops(TINY, keep, 0) == want_keep
        got = zero_pp_ops(TINY, free, 0)
        assert got["reduce_scatter"] == want_keep["reduce_scatter"]
        assert got["all_gather"]["calls"] == 2 * m * want_keep["all_gather"]["calls"]
        assert got["all_gather"]["bytes_sent"] == 2 * m * want_keep["all_gather"]["bytes_sent"]


@pytest.mark.parametrize("kw", [dict(dp=2, pp=2), dict(dp=2, tp=2, pp=2, sequence_parallel=True),
                                dict(dp=4, pp=2, virtual_stages=2, schedule="interleaved_1f1b"),
                                dict(dp=2, tp=2)])
def test_dp_records_are_rank0_calls_and_every_ranks_bytes(kw):
    """dp_traffic's records: calls = rank 0's (what the tracer counts there), world_bytes = the
    sum over every rank (tp copies of each pipeline rank, N dp ranks) of zero_pp_ops' bytes."""
    config = replace(TINY, n_layer=4)
    for zero, reshard in ((2, True), (3, True), (3, False)):
        dims = ParallelDims(zero=zero, microbatches=4, reshard_after_forward=reshard, **kw)
        records = {r.op: r for r in dp_traffic(config, dims, 16) if not r.report}
        ranks = [zero_pp_ops(config, dims, r) for r in range(dims.pp)]
        for op in ("all_gather", "reduce_scatter"):
            assert records[op].calls == ranks[0][op]["calls"]
            assert records[op].world_bytes == dims.tp * dims.dp * sum(r[op]["bytes_sent"] for r in ranks)
    # unchanged where nothing composes: plain dp's ZeRO-2 reduce-scatters every micro-batch
    flat = {r.op: r for r in dp_traffic(config, ParallelDims(dp=2, zero=2, microbatches=4), 16, None, 1000)}
    assert flat["reduce_scatter"].calls == 4


def test_memory_per_policy_and_unit():
    """Stage 3 holds gathered parameters: with one chunk per rank the whole stage under both
    policies (the course's engine gathers a chunk at once); with v = 2 one chunk (True) or both
    (False); per block (fsdp_unit='block') far less with True. The gradient is accumulated
    unsharded over the micro-batches (the cost of one reduce-scatter per step), the shards
    between steps are notebook 01's formula summed over the units."""
    config = replace(TINY, n_layer=4)
    base = ParallelDims(dp=2, pp=2, zero=3, microbatches=4)
    one = {k: memory_per_rank(config, replace(base, reshard_after_forward=k), 16, recipe="fp32") for k in (True, False)}
    assert one[True]["gathered"] == one[False]["gathered"] > 0
    v2 = replace(base, virtual_stages=2, schedule="interleaved_1f1b")
    two = {k: composed_zero_memory(config, replace(v2, reshard_after_forward=k), "fp32") for k in (True, False)}
    assert 0 < two[True]["gathered"] < two[False]["gathered"]
    block = composed_zero_memory(config, base, "fp32", fsdp_unit="block")
    assert block["gathered"] < composed_zero_memory(config, base, "fp32")["gathered"]
    units = zero_units(config, base, 0)
    assert two[True]["grads"] == 4 * sum(units)  # fp32 gradients, unsharded until the reduce
    between = {k: sum(model_state_bytes(p, "fp32", 3, 2)[k] for p in units) for k in ("params", "grads", "optimizer")}
    assert {k: one[True]["between_steps"][k] for k in between} == between
    # stage 2 keeps the parameters whole and shards only what the step does not use
    z2 = memory_per_rank(config, replace(base, zero=2), 16, recipe="fp32")
    assert z2["gathered"] == 0 and z2["params"] > one[True]["params"] and z2["grads"] == one[True]["grads"]
    with pytest.raises(ValueError, match="fsdp_unit='layer' must be one of"):
        memory_per_rank(config, base, 16, fsdp_unit="layer")


def test_step_time_prices_the_policies_and_the_planner_offers_them():
    """On H100s the 2m all-gathers per unit of reshard_after_forward=True cost more exposed dp
    time than one per step; the planner proposes ZeRO-2/3 with pp > 1 under both policies."""
    cluster = gpu_cluster("H100 SXM 80 GB", 16)
    dims = ParallelDims(dp=2, tp=4, pp=2, zero=3, microbatches=8, sequence_parallel=True)
    t = {k: step_time(LLAMA3_8B, replace(dims, reshard_after_forward=k), cluster, 64, 4096) for k in (True, False)}
    units, m = zero_pp_ops(LLAMA3_8B, dims, 0)["reduce_scatter"]["calls"], dims.microbatches
    assert (t[True]["calls"]["dp"], t[False]["calls"]["dp"]) == ((2 * m + 1) * units, 2 * units)
    assert t[True]["dp_exposed"] > t[False]["dp_exposed"]
    found = {(c.dims.zero, c.dims.reshard_after_forward) for c in
             search(LLAMA3_8B, gpu_cluster("H100 SXM 80 GB", 8), 32, 4096, micro_batches=(1,), recomputes=("full",),
                    schedules=("1f1b",))
             if c.dims.pp > 1 and c.fits}
    assert {(2, True), (3, True), (3, False)} <= found
