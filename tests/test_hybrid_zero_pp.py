"""The full composition (issue 31): sequence parallelism across pipeline stages, and ZeRO-2 / ZeRO-3
with pipeline and tensor parallelism (course_lib.parallel.hybrid.zero_pp), each equal to the single
process over 3 clipped fp32 steps (test_hybrid's _assert_equal_to_single: its tolerances and their
reasons), with the bytes the tracer counts and the bytes a rank holds equal to their formulas."""

from dataclasses import replace

import pytest

from course_lib.estimate.per_gpu import composed_zero_memory
from course_lib.estimate.traffic import pp_traffic
from course_lib.parallel import topology
from course_lib.parallel.hybrid import ParallelDims, run_hybrid, train_single
from course_lib.parallel.hybrid.zero_pp import zero_pp_traffic
from course_lib.parallel.zero import expected_state_bytes

from test_hybrid import SEQ, TRAIN, _assert_equal_to_single, dense  # noqa: F401 (dense: the same fixture)


@pytest.fixture(scope="module")
def single(dense):
    return train_single(dense, TRAIN)


def _sent_per_step(results, dim):
    return sum(r.traffic.get(dim, {}).get("bytes_sent", 0) for r in results) // TRAIN.steps


def _check_zero(results, dims, config):
    """Per rank: ZeRO's all-gathers and reduce-scatters over 3 steps = 3 x zero_pp_traffic of its
    units (exact: integers), and the bytes it holds between steps = notebook 01's formula summed
    over its units (expected_state_bytes: params P_u at stage 2, S_u at stage 3; gradients and
    AdamW's m, v of S_u = ceil(P_u / dp) elements). The planner's estimate, which never runs the
    model (composed_zero_memory from the config and the layout alone), equals both measurements:
    the state between steps, the whole gradients accumulated before the step's reduction and, at
    stage 3, the most bytes gathered at once."""
    for r in results:
        sizes = list(r.zero_units.values())
        want = zero_pp_traffic(sizes, dims.microbatches, dims.dp, dims.zero, dims.reshard_after_forward)
        got = {op: r.zero_ops[op] for op in want}
        assert got == {op: {k: TRAIN.steps * v for k, v in row.items()} for op, row in want.items()}, r.coords
        held = {k: v for k, v in r.memory.items() if k in ("params", "grads", "optimizer", "total")}
        assert held == expected_state_bytes(sizes, "fp32", dims.zero, dims.dp), r.coords
        estimate = composed_zero_memory(config, dims, "fp32", rank=r.coords["pp"])
        assert held == estimate["between_steps"], r.coords
        assert r.memory["grads_peak"] == estimate["grads"], r.coords
        if dims.zero == 3:
            assert r.memory["gathered_peak"] == estimate["gathered"], r.coords


def test_sequence_parallel_across_pipeline_stages_equals_single_process_and_sends_a_tp_shard(dense, single):
    """dp1 x pp2 x tp2 with SP (4 ranks): every stage boundary carries the tp rank's T/tp tokens,
    so the pipeline's bytes are pp_traffic's with M / tp (Megatron), tp's are tp_traffic's."""
    dims = ParallelDims(dp=1, tp=2, pp=2, sequence_parallel=True, microbatches=2)
    results = run_hybrid(dims, dense, TRAIN, trace=True, timeout_s=240)
    _assert_equal_to_single(results, single)
    model = topology.traffic_per_step(dense, dims, TRAIN.batch_size)
    for dim in ("pp", "tp"):
        assert _sent_per_step(results, dim) == model[dim]["bytes_sent"], dim

    def messages(d):  # the activations and their gradients (not the tied gradient, not the loss)
        return [c.world_bytes for c in pp_traffic(dense, d, TRAIN.batch_size) if c.what.startswith("activations")]
    assert messages(dims)[0] * dims.tp == messages(replace(dims, sequence_parallel=False))[0]


@pytest.mark.parametrize("zero, reshard", [(2, True), (3, True), (3, False)])
def test_zero_2_and_3_over_pipeline_stages_equal_single_process_with_their_traffic_and_memory(
        dense, single, zero, reshard):
    """dp2 x pp2 (4 ranks): one reduce-scatter per unit per step (not per micro-batch); stage 3
    all-gathers each unit 2m times a step (reshard after forward) or once (kept for the step)."""
    dims = ParallelDims(dp=2, pp=2, zero=zero, reshard_after_forward=reshard, microbatches=2)
    results = run_hybrid(dims, dense, TRAIN, trace=True, timeout_s=240)
    _assert_equal_to_single(results, single)
    _check_zero(results, dims, dense)


def test_zero3_reshard_policy_sets_the_gathered_peak_with_interleaved_chunks(dense):
    """pp2 x v2 (a rank runs two chunks), dp2: resharding after every forward and backward holds
    one chunk's parameters at a time, keeping them holds both: the peak gathered bytes are the
    largest chunk's sum of N S_u e, or every unit's."""
    config = replace(dense, n_layer=4)
    reference = train_single(config, TRAIN)
    peaks = {}
    for reshard in (True, False):
        dims = ParallelDims(dp=2, pp=2, zero=3, virtual_stages=2, schedule="interleaved_1f1b", microbatches=2,
                            reshard_after_forward=reshard)
        results = run_hybrid(dims, config, TRAIN, trace=True, timeout_s=240)
        _assert_equal_to_single(results, reference)
        _check_zero(results, dims, config)
        for r in results:
            gathered = {}
            for name, p in r.zero_units.items():  # "chunk{c}.group{g}": padded to N S_u, 4 bytes
                gathered[name.split(".")[0]] = gathered.get(name.split(".")[0], 0) + 2 * (-(-p // 2)) * 4
            want = max(gathered.values()) if reshard else sum(gathered.values())
            assert r.memory["gathered_peak"] == want, r.coords
            peaks.setdefault(reshard, []).append(want)
    assert all(a < b for a, b in zip(peaks[True], peaks[False]))


@pytest.mark.parametrize("kw", [dict(zero=2), dict(zero=3, sequence_parallel=True),
                                dict(zero=3, reshard_after_forward=False, sequence_parallel=True)])
def test_fsdp_tp_pp_at_8_ranks_equals_single_process(dense, single, kw):
    """dp2 x tp2 x pp2: ZeRO-2, and ZeRO-3 under both policies with sequence parallelism too; a
    tensor-parallel weight is then sharded on two dims (its tp slice, flattened, cut over dp)."""
    dims = ParallelDims(dp=2, tp=2, pp=2, microbatches=2, **kw)
    results = run_hybrid(dims, dense, TRAIN, trace=True, timeout_s=300)
    _assert_equal_to_single(results, single)
    _check_zero(results, dims, dense)
    if dims.sequence_parallel:
        model = topology.traffic_per_step(dense, dims, TRAIN.batch_size)
        assert _sent_per_step(results, "pp") == model["pp"]["bytes_sent"]


def test_an_odd_layout_pads_its_shards_and_equals_single_process(dense, monkeypatch):
    """dp3 x pp2 (6 ranks), global batch 6: the units' P_u are not multiples of 3, so every
    shard ends in padding (zero gradient, zero value: AdamW leaves it 0); ZeRO-2 and ZeRO-3."""
    import test_hybrid

    six = replace(TRAIN, batch_size=6)
    monkeypatch.setattr(test_hybrid, "TRAIN", six)  # the tolerances read its lr, steps and clip
    monkeypatch.setitem(globals(), "TRAIN", six)  # and _check_zero its steps
    reference = train_single(dense, six)
    for zero in (3, 2):
        dims = ParallelDims(dp=3, pp=2, zero=zero, microbatches=2)
        results = run_hybrid(dims, dense, six, trace=True, timeout_s=240)
        assert any(p % 3 for r in results for p in r.zero_units.values())  # padding present
        _assert_equal_to_single(results, reference)
        _check_zero(results, dims, dense)


@pytest.mark.parametrize("kw", [dict(dp=2, tp=2, zero=3), dict(dp=2, pp=2, zero=2, schedule="zero_bubble"),
                                dict(dp=2, pp=2, zero=2, recompute="full")])
def test_fsdp_with_tp_alone_and_zero2_under_split_backward_and_recomputation(dense, single, kw):
    """FSDP x TP without a pipeline (the model one chunk); ZeRO-2 under the zero-bubble schedule,
    whose W actions add weight gradients after their hooks fired (those units reduce at the
    step's end), and under full recomputation (each gradient still accumulated once per backward)."""
    dims = ParallelDims(microbatches=2, **kw)
    results = run_hybrid(dims, dense, TRAIN, trace=True, timeout_s=240)
    reference = single if dims.recompute == "none" else train_single(dense, TRAIN, recompute="full")
    _assert_equal_to_single(results, reference)
    _check_zero(results, dims, dense)


@pytest.mark.parametrize("kw, message", [
    (dict(dp=2, zero=1, reshard_after_forward=False), "reshard_after_forward=False with zero=1: it is a ZeRO-3 policy"),
    (dict(dp=1, cp=2, zero=3), "zero=3 with cp=2: stages 2 and 3 reduce each gradient over dp"),
    (dict(dp=2, zero=3, reshard_after_forward="no"), "reshard_after_forward='no' must be True or False"),
    (dict(pp=2, schedule="pipedream_2bw", microbatches=2), "schedule=.pipedream_2bw. with pp=2: the composed runtime"),
])
def test_what_still_does_not_compose_is_refused_with_its_reason(dense, kw, message):
    dims = ParallelDims(**kw)
    with pytest.raises(ValueError, match=message):
        dims.check(dims.world_size, dense, TRAIN.batch_size)


def test_zero_2_with_experts_is_refused(dense):
    moe = replace(dense, n_experts=4, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.0)
    with pytest.raises(ValueError, match="zero=2 with ep=2: .* before expert parallelism's average over ep"):
        ParallelDims(ep=2, zero=2).check(2, moe, TRAIN.batch_size)
