"""Tests for course_lib.parallel.tp: Megatron tensor parallelism and sequence parallelism.

The central claim: the tensor-parallel GPT trains exactly like the single-process one
(train_reference) at tp = 2 and 4, with and without sequence parallelism, tied and untied
embeddings (the vocabulary, 97 symbols, is padded at both), over several AdamW steps with
gradient clipping; the gathered final parameters and gradients equal the reference's. DTensor's
parallelize_module on the same model gives the same losses. Communication is counted against
costs.py's formulas, memory against notebook 01's (course_lib.estimate). Mutants (swapped f/g,
a contiguous qkv split, a loss missing a reduction) show the comparisons can fail.
"""

import contextlib
import os
import pathlib
import subprocess
import sys
from unittest import mock

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import CommTracer, RankError, run_on_ranks
from course_lib.dims import ParallelDims
from course_lib.data import CharDataset, get_batch
from course_lib.estimate import activation_bytes, per_gpu_memory
from course_lib.model import GPT, GPTConfig
from course_lib.observe.memory import SavedActivations, measured_state_bytes
from course_lib.parallel.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    apply_tensor_parallel,
    check_tensor_parallel,
    full_logits,
    gather_full_gradients,
    qkv_rows,
)
from course_lib.parallel.tp.costs import layer_communication, step_communication
from course_lib.parallel.tp.training import run_tensor_parallel, train_tensor_parallel
from course_lib.runtime.device import rank_device
from course_lib.train import TrainConfig, flat_grads, flat_params, train_reference

from _tolerances import (FP32_SUM_RTOL, adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw,
                         by_name)
from _demo_cli import run_main

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 3
VOCAB = CharDataset("train").vocab_size


def config(tie=True, **kw):
    return GPTConfig.tiny(VOCAB, block_size=32, tie_weights=tie, **kw)


def train_cfg(clip=1.0):
    return TrainConfig(steps=STEPS, batch_size=4, grad_clip=clip, eval_every=10**6, eval_batches=1, progress=False)


def reference(cfg, tc):
    res = train_reference(cfg, tc)
    return res.train_losses, flat_params(res.model), flat_grads(res.model)


VARIANTS = [(sp, tie) for sp in (False, True) for tie in (True, False)]


def _all_variants(tc):
    out = {(sp, tie, "course"): train_tensor_parallel(config(tie), tc, sp) for sp, tie in VARIANTS}
    for sp in (False, True):
        out[(sp, True, "dtensor")] = train_tensor_parallel(config(True), tc, sp, impl="dtensor")
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_equals_reference_and_dtensor(tp):
    tc = train_cfg()
    refs = {tie: reference(config(tie), tc) for tie in (True, False)}
    per_rank = run_on_ranks(_all_variants, tc, world_size=tp, timeout_s=120)
    for key, out in per_rank[0].items():
        sp, tie, impl = key
        ref_losses, ref_params, ref_grads = refs[tie]
        for r in range(1, tp):  # every rank reports the same global loss (all-reduced: bit for bit)
            assert per_rank[r][key].train_losses == out.train_losses, (key, r)
        # The shards sum in another order than one process, and AdamW magnifies that rounding near
        # g = 0 (tests/_tolerances): losses within adamw_loss_atol, the last step's gradients (after
        # 2 AdamW steps) in norm per tensor, parameters bounded by AdamW's step and in RMS against
        # lr/100 (was: elementwise atol 3e-4 and < 0.1 % of elements beyond 1e-5).
        assert out.train_losses == pytest.approx(ref_losses, abs=adamw_loss_atol(tc.lr)), key
        if impl == "course":
            model = GPT(config(tie))
            assert_grads_close_after_adamw(by_name(out.final_grads, model), by_name(ref_grads, model), str(key))
            assert_adamw_params_close(out.final_params, ref_params, tc.lr, tc.steps, tc.betas, msg=str(key))


def _one_step(sp, tie, mutate=None):
    """Loss, full logits and full gradients of one forward/backward, single-process and TP."""
    cfg = config(tie)
    x, y = get_batch(CharDataset("train", cfg.block_size), 4, torch.Generator().manual_seed(0))
    ref = GPT(cfg, seed=0)
    ref_logits, ref_loss = ref(x, y)
    ref_loss.backward()
    with mutate() if mutate else contextlib.nullcontext():
        model = apply_tensor_parallel(GPT(cfg, seed=0), None, sp)
        logits, loss = model(x, y)
        loss.backward()
        grads = gather_full_gradients(model)
        logits = full_logits(model, logits)
    return relative_errors(loss, ref_loss, logits, ref_logits, grads, ref)


def relative_errors(loss, ref_loss, logits, ref_logits, grads, ref):
    """|loss difference| / |loss|, and the largest |difference| of the logits and of each
    parameter's gradient over that tensor's largest element (fp32 sums in another order are
    bounded relative to the terms: FP32_SUM_RTOL, tests/_tolerances)."""
    grad_err = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in ref.named_parameters())
    logit_err = None if logits is None else ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    return abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), logit_err, grad_err


def _swap_f_and_g():
    from course_lib.comm import autograd
    from course_lib.parallel.tp import functions
    return mock.patch.multiple(functions, copy_to_group=autograd.reduce_from_group,
                               reduce_from_group=autograd.copy_to_group)


def _contiguous_qkv_split():
    from course_lib.parallel.tp import apply
    return mock.patch.object(apply, "qkv_rows", lambda d, tp, *heads: torch.arange(3 * d).view(tp, -1))


def _loss_without_reduction():
    from course_lib.parallel.tp import loss
    return mock.patch.object(loss, "reduce_from_group", lambda t, group=None: t)


MUTANTS = {"swapped f/g": _swap_f_and_g, "contiguous qkv split": _contiguous_qkv_split,
           "loss missing a reduction": _loss_without_reduction}


def _mutants():
    out = {(sp, tie): _one_step(sp, tie) for sp, tie in VARIANTS}
    for name, mutate in MUTANTS.items():
        out[name] = _one_step(False, True, mutate)
    return out


def test_one_step_logits_gradients_and_mutants():
    res = run_on_ranks(_mutants, world_size=2, timeout_s=60)
    for out in res:
        for sp, tie in VARIANTS:
            # one forward and backward: fp32 sums in another order (measured ~1e-7 relative)
            assert max(out[(sp, tie)]) <= FP32_SUM_RTOL, (sp, tie, out[(sp, tie)])
        for name in MUTANTS:  # each wrong implementation is caught by the comparison above, by 100x
            assert max(out[name]) > 100 * FP32_SUM_RTOL, (name, out[name])


def test_qkv_rows_give_whole_heads_of_q_k_and_v():
    rows = qkv_rows(8, 2)  # d = 8 split over 2 ranks: rank 0 has features 0-3 of Q, K and V
    assert rows.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19], [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]]


def _layers(sp):
    torch.manual_seed(0)  # same full layers and input on every rank
    fc, proj = nn.Linear(8, 12).to(rank_device()), nn.Linear(12, 8).to(rank_device())
    x = torch.randn(2, 4, 8, requires_grad=True, device=rank_device())  # NCCL's device rule (COURSE_NCCL_RULES=1)
    ref = proj(torch.relu(fc(x)))
    ref.sum().backward()
    col, row = ColumnParallelLinear.from_linear(fc, None, sp), RowParallelLinear.from_linear(proj, None, sp)
    xs = x.detach().chunk(dist.get_world_size(), dim=1)[dist.get_rank()] if sp else x.detach()
    xs.requires_grad_(True)
    out = row(torch.relu(col(xs)))
    out.sum().backward()
    want = ref.chunk(dist.get_world_size(), dim=1)[dist.get_rank()] if sp else ref
    want_gx = x.grad.chunk(dist.get_world_size(), dim=1)[dist.get_rank()] if sp else x.grad
    r = dist.get_rank()
    pairs = [(out, want), (xs.grad, want_gx), (col.weight.grad, fc.weight.grad[r * 6:(r + 1) * 6]),
             (row.weight.grad, proj.weight.grad[:, r * 6:(r + 1) * 6]), (row.bias.grad, proj.bias.grad)]
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]  # relative to the largest element


@pytest.mark.parametrize("sp", [False, True])
def test_column_then_row_parallel_equals_the_full_layers(sp):
    for errs in run_on_ranks(_layers, sp, world_size=2, timeout_s=60):
        # the row-parallel sums of 6 + 6 terms all-reduced vs 12 in one: fp32 rounding (measured
        # ~1 ulp; was atol 1e-6, within 4x of it for outputs ~1, where the bound is ~12 eps |terms|)
        assert max(errs) <= FP32_SUM_RTOL, errs


def _traced(sp, tp_cfg):
    x, y = get_batch(CharDataset("train", tp_cfg.block_size), 4, torch.Generator().manual_seed(0))
    model = apply_tensor_parallel(GPT(tp_cfg, seed=0), None, sp)
    with CommTracer() as fwd:
        loss = model(x, y)[1]
    with CommTracer() as bwd:
        loss.backward()
    from course_lib.parallel.tp.dtensor import apply_dtensor_tensor_parallel
    from torch.distributed.tensor.debug import CommDebugMode
    dmodel = apply_dtensor_tensor_parallel(GPT(tp_cfg, seed=0), None, sp)
    with CommDebugMode() as mode:
        dmodel(x, y)
    counts = {getattr(op, "__name__", str(op)).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    return fwd.summary(), bwd.summary(), counts


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
def test_communication_matches_the_formulas(tp, sp):
    cfg = config()
    expected = step_communication(cfg, 4, cfg.block_size, tp, sp)
    layer = layer_communication(4, cfg.block_size, cfg.d_model, tp, sp)
    L = cfg.n_layer
    for fwd, bwd, dtensor in run_on_ranks(_traced, sp, cfg, world_size=tp, timeout_s=60):
        assert fwd == expected["forward"]
        assert bwd == expected["backward"]
        # DTensor (blocks only; the sequence is gathered once more before ln_f under SP)
        if sp:
            assert dtensor == {"all_gather_into_tensor": L * layer["forward"]["all_gather"] + 1,
                               "reduce_scatter_tensor": L * layer["forward"]["reduce_scatter"]}
        else:
            assert dtensor == {"all_reduce": L * layer["forward"]["all_reduce"]}
    # an all-gather plus a reduce-scatter puts as many bytes on a ring link as one all-reduce
    assert layer["ring_bytes_forward"] == layer_communication(4, 32, 64, tp, not sp)["ring_bytes_forward"]


def _memory(sp):
    out = {}
    for n_layer in (1, 2):
        model = apply_tensor_parallel(GPT(config(n_layer=n_layer), seed=0), None, sp)
        x, y = get_batch(CharDataset("train", 32), 2, torch.Generator().manual_seed(0))
        with SavedActivations(model) as saved:
            model(x, y)
        out[n_layer] = (saved.bytes, measured_state_bytes(model)["params"])
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_memory_matches_notebook_01_formulas(tp):
    cfg = config()
    per_layer = {}
    for sp in (False, True):
        res = run_on_ranks(_memory, sp, world_size=tp, timeout_s=60)[0]
        per_layer[sp] = res[2][0] - res[1][0]
        assert per_layer[sp] == activation_bytes(cfg, 2, 32, tp=tp, sequence_parallel=sp)["per_layer"]
        # Parameters: the formula follows the course's split (the two row-parallel biases whole,
        # added after the reduction; the vocabulary padded to V' = a multiple of tp).
        formula = per_gpu_memory(cfg, 2, 32, recipe="fp32", tp=tp, sequence_parallel=sp)["params"]
        assert res[2][1] == formula
    assert per_layer[True] < per_layer[False]


def test_bad_input_is_rejected_before_any_rank_starts():
    cases = [(dict(n_head=4), 3, False, "tp=3 must divide n_head=4"),
             (dict(n_head=8, d_model=64, d_ff=100), 8, False, "tp=8 must divide d_ff=100"),
             (dict(block_size=30), 4, True, "sequence length 30 must be divisible by tp=4")]
    for overrides, tp, sp, message in cases:
        with pytest.raises(ValueError, match=message):
            run_tensor_parallel(ParallelDims(tp=tp, sequence_parallel=sp), GPTConfig.tiny(VOCAB, **overrides),
                                train_cfg())
    with pytest.raises(ValueError, match="impl='megatron' must be one of"):
        run_tensor_parallel(ParallelDims(tp=2), config(), train_cfg(), impl="megatron")
    with pytest.raises(ValueError, match="tp=0 must be a positive int"):
        check_tensor_parallel(config(), 0)


def _misuse():
    model = apply_tensor_parallel(GPT(config(), seed=0), None, True)
    errors = []
    for call in (lambda: apply_tensor_parallel(model, None), lambda: model(torch.zeros(2, 31, dtype=torch.long))):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_already_parallel_and_uneven_sequence_are_rejected_on_the_ranks():
    for errors in run_on_ranks(_misuse, world_size=2, timeout_s=60):
        assert "already tensor parallel" in errors[0]
        assert "sequence length 31 must be divisible by tp=2" in errors[1]


def test_demo_under_torchrun_with_gloo():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.tensor_parallel", "--steps", "3", "--sequence-parallel", "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor parallel on 2 ranks (gloo), sequence parallel" in proc.stdout, proc.stdout
    # the demo's default loss tolerance, 1e-3, is above adamw_loss_atol(3e-3) = 7e-5 (tests/_tolerances)
    assert proc.stdout.rstrip().endswith("(tolerance 1.0e-03): OK"), proc.stdout


def test_demo_rejects_bad_arguments():
    code, err = run_main("course_lib.demos.tensor_parallel", ["--steps", "0"])
    assert code != 0 and "--steps=0 must be >= 1" in err


def test_rank_error_names_the_rule():
    with pytest.raises(RankError, match="already tensor parallel"):
        run_on_ranks(lambda: apply_tensor_parallel(apply_tensor_parallel(GPT(config()), None), None),
                     world_size=2, timeout_s=60)


def test_widget_offers_only_valid_tp_and_starts_at_its_static_figure():
    from course_lib.estimate import GPT3_175B
    from course_lib.parallel.tp.figures import layer_view, layer_widget, valid_tp

    assert valid_tp(GPT3_175B) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]
    assert valid_tp(config()) == [1, 2, 4]
    widget = layer_widget(GPT3_175B, 8, False)
    assert list(widget.controls["tp"].options) == valid_tp(GPT3_175B)
    static = layer_view(GPT3_175B, 8, False)
    assert (widget.first_view.png, widget.first_view.caption) == (static.png, static.caption)
    assert "qkv 4608x12288" in static.caption and "2 all-reduce of 48.0 MiB" in static.caption
    assert "2 all-gather, 2 reduce-scatter" in layer_view(GPT3_175B, 8, True).caption
    assert not layer_view(GPT3_175B, 5, False).valid  # 5 does not divide 96 heads
    with pytest.raises(ValueError, match="tp=5 must be one of"):
        layer_widget(GPT3_175B, 5)


def _on_a_mesh():
    from course_lib import make_mesh

    mesh = make_mesh(dp=2, tp=2)
    errors = []
    for sp in (False, True):
        errors.append(_one_step_on(mesh["tp"], sp))
    return errors


def _one_step_on(group, sp):
    cfg = config()
    x, y = get_batch(CharDataset("train", cfg.block_size), 4, torch.Generator().manual_seed(0))
    ref = GPT(cfg, seed=0)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    model = apply_tensor_parallel(GPT(cfg, seed=0), group, sp)
    loss = model(x, y)[1]
    loss.backward()
    grads = gather_full_gradients(model)
    return max(e for e in relative_errors(loss, ref_loss, None, None, grads, ref) if e is not None)


def test_tp_groups_of_a_2d_mesh():
    """dp=2 x tp=2 on 4 ranks: each tp group (a DeviceMesh dim, not the world) is exact."""
    for errors in run_on_ranks(_on_a_mesh, world_size=4, timeout_s=60):
        assert max(errors) <= FP32_SUM_RTOL, errors  # one step: fp32 sums in another order
