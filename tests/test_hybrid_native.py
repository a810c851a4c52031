"""PyTorch's own FSDP2 x TP (course_lib.parallel.hybrid.native: DTensor's parallelize_module, then
fully_shard over the dp dimension of a 2-D DeviceMesh) against the single process, and the
course's composed run (run_hybrid's train_hybrid at the same layout: dp2 x tp2, ZeRO-3, two
micro-batches) against it: 3 clipped fp32 steps on 4 gloo ranks, one launch for all the runs
(torch's under both reshard policies: after forward, or the blocks kept gathered for backward)."""

import pytest
import torch

from course_lib import run_on_ranks
from course_lib.parallel.hybrid import ParallelDims, merged_params, train_hybrid, train_single
from course_lib.parallel.hybrid.native import run_native_fsdp_tp, train_native_fsdp_tp

from _tolerances import ADAMW_GRAD_REL_NORM, FP32_SUM_RTOL, adamw_loss_atol, assert_adamw_params_close
from test_hybrid import TRAIN, _assert_equal_to_single, dense  # noqa: F401 (dense: the same fixture)


def test_fsdp2_with_dtensor_tp_equals_single_process_and_the_course_composed_run(dense):
    dims = ParallelDims(dp=2, tp=2, zero=3, microbatches=2)
    dims.check(None, dense, TRAIN.batch_size)

    def both(dims, config, cfg):  # rank code: the course's run, then torch's (both reshard policies), on 4 ranks
        native = [train_native_fsdp_tp(config, cfg, dims.dp, dims.tp, dims.microbatches, reshard)
                  for reshard in (True, False)]
        return train_hybrid(dims, config, cfg), *native

    # check_collectives=False: FSDP2 and DTensor issue their collectives from C++, below the
    # Python-level check, which would only see part of them.
    pairs = run_on_ranks(both, dims, dense, TRAIN, world_size=dims.world_size, timeout_s=240,
                         check_collectives=False)
    course, native, kept = ([p[i] for p in pairs] for i in range(3))  # kept: no reshard after forward
    assert [r.coords for r in native] == [{"dp": d, "tp": t} for d in (0, 1) for t in (0, 1)]

    # torch's composition equals the single process (the tolerances and their reasons are
    # _assert_equal_to_single's: the mesh sums in another order, AdamW magnifies it near g = 0);
    # its clip norm is the single process's: a norm counting the tp copies of a LayerNorm twice,
    # or a tp shard once only, moves the norm by far more than FP32_SUM_RTOL.
    single = train_single(dense, TRAIN)
    _assert_equal_to_single(native, single)
    _assert_equal_to_single(kept, single)  # keeping the gathered blocks for backward changes no number

    # The course's run and torch's, the same computation in two implementations: as tight as either
    # against the single process (same reasons); the loss reported once, the same on every rank.
    for c, n in zip(course, native):
        assert c.train_losses == pytest.approx(n.train_losses, abs=adamw_loss_atol(TRAIN.lr))
        assert c.grad_norms[0] == pytest.approx(n.grad_norms[0], rel=FP32_SUM_RTOL)
        assert c.grad_norms[1:] == pytest.approx(n.grad_norms[1:], rel=ADAMW_GRAD_REL_NORM)
    ours, theirs = merged_params(course), merged_params(native)
    assert set(ours) == set(theirs)
    names = sorted(ours)
    got, want = (torch.cat([d[k].reshape(-1) for k in names]) for d in (ours, theirs))
    assert_adamw_params_close(got, want, TRAIN.lr, TRAIN.steps, TRAIN.betas, msg="course vs FSDP2 x TP")


@pytest.mark.parametrize("kw, message", [
    (dict(dp=3, tp=2, zero=3), r"batch_size=8 must be divisible by dp \* microbatches = 3"),
    (dict(dp=2, tp=3, zero=3), r"tp=3 must divide n_head=2"),
    (dict(dp=0, tp=2, zero=3), r"dp=0 must be a positive int"),
    (dict(dp=2, tp=2), r"zero=0: run_native_fsdp_tp runs FSDP2, which is ZeRO stage 3"),
    (dict(dp=2, tp=2, zero=3, pp=2), r"pp=2: run_native_fsdp_tp runs dp, tp, microbatches, zero, reshard_after_forward"),
])
def test_a_layout_torch_cannot_train_is_refused_before_any_rank_starts(dense, kw, message):
    with pytest.raises(ValueError, match=message):
        run_native_fsdp_tp(ParallelDims(**kw), dense, TRAIN)
