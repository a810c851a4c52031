"""Grouped-query attention (GPTConfig.n_kv_head, Ainslie et al. 2023) and its tensor parallelism.

The GQA model equals grouped attention written out by hand (n_kv_head = 1, 2, n_head), its
parameter count equals the closed form and the estimator's, and the tensor-parallel GQA GPT
trains like the single process at tp = 2 and 4 with n_head = 4 and n_kv_head = 1, 2, 4: KV heads
split (tp <= n_kv_head) or read by tp / n_kv_head ranks (tp > n_kv_head): owned by the first,
read by the others through an all-reduce whose backward sums their gradients back to the owner
(mutants without that sum, or without the exchange, are caught). Bad input is refused in
the parent, before any rank starts.
"""

import contextlib
import math
import os
import pathlib
import subprocess
import sys
from unittest import mock

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from course_lib import run_on_ranks
from course_lib.data import CharDataset, get_batch
from course_lib.dims import ParallelDims, check_tp
from course_lib.estimate import LLAMA3_70B, activation_bytes, per_gpu_memory
from course_lib.estimate.params import param_count
from course_lib.model import GPT, GPTConfig, expected_num_params
from course_lib.observe.memory import SavedActivations, measured_state_bytes
from course_lib.parallel.tp import apply_tensor_parallel, check_tensor_parallel, gather_full_gradients, qkv_rows
from course_lib.parallel.tp.apply import clip_grad_norm_
from course_lib.parallel.tp.training import run_tensor_parallel, train_tensor_parallel
from course_lib.train import TrainConfig, flat_grads, flat_params, train_reference

from _demo_cli import run_main
from _tolerances import (FP32_SUM_RTOL, adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw,
                         by_name)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

VOCAB = CharDataset("train").vocab_size
KV_HEADS = (1, 2, 4)  # with n_head = 4: multi-query, grouped, multi-head


def config(n_kv_head, **kw):
    return GPTConfig.tiny(VOCAB, block_size=32, n_kv_head=n_kv_head, **kw)


def grouped_attention_by_hand(attn, x, kv_of_head):
    """The block's attention written out head by head: query head h reads key/value head
    kv_of_head(h) (the paper's grouping: h // (n_head / n_kv_head))."""
    cfg_d, dh, H = x.shape[-1], attn.d_head, attn.n_head
    g = (attn.qkv.out_features - cfg_d) // 2
    W, b = attn.qkv.weight, attn.qkv.bias
    q_all, k_all, v_all = x @ W[:cfg_d].T + b[:cfg_d], x @ W[cfg_d:cfg_d + g].T + b[cfg_d:cfg_d + g], \
        x @ W[cfg_d + g:].T + b[cfg_d + g:]
    T = x.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(H):
        j = kv_of_head(h)
        q, k, v = q_all[..., h * dh:(h + 1) * dh], k_all[..., j * dh:(j + 1) * dh], v_all[..., j * dh:(j + 1) * dh]
        scores = (q @ k.transpose(-2, -1) / math.sqrt(dh)).masked_fill(~mask, float("-inf"))
        heads.append(F.softmax(scores, dim=-1) @ v)
    return attn.proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("n_kv", KV_HEADS)
def test_gqa_attention_equals_grouped_attention_by_hand(n_kv):
    model = GPT(config(n_kv), seed=0)
    attn = model.blocks[0].attn
    assert attn.qkv.out_features == 64 + 2 * n_kv * 16  # Q: d rows, K and V: n_kv_head * d_head each
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    got = attn(x)
    group = 4 // n_kv
    want = grouped_attention_by_hand(attn, x, lambda h: h // group)
    # the same products and softmax, batched differently (per head here, all heads at once there):
    # fp32 sums in another order, FP32_SUM_RTOL of the largest element (tests/_tolerances)
    torch.testing.assert_close(got, want, rtol=FP32_SUM_RTOL, atol=FP32_SUM_RTOL * want.abs().max().item())
    if n_kv == 2:  # the comparison can fail: heads paired with KV heads round-robin (h % 2) differ by O(1)
        wrong = grouped_attention_by_hand(attn, x, lambda h: h % n_kv)
        assert (wrong - got).abs().max() > 100 * FP32_SUM_RTOL * want.abs().max()


def test_default_config_is_multi_head_and_unchanged():
    cfg = GPTConfig.tiny(VOCAB)
    assert cfg.n_kv_head is None and cfg.kv_heads == cfg.n_head and "n_kv_head" not in repr(cfg)
    assert cfg == GPTConfig.tiny(VOCAB) and cfg.shape.n_kv_head == cfg.n_head
    assert GPT(cfg).blocks[0].attn.qkv.weight.shape == (3 * 64, 64)  # the fused Q, K, V of before
    assert "n_kv_head=2" in repr(config(2))


@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("bias,tie", [(True, True), (False, False)])
def test_parameter_count_formula_estimator_and_model_agree(n_kv, bias, tie):
    cfg = config(n_kv, bias=bias, tie_weights=tie)
    real = GPT(cfg).num_params()
    assert expected_num_params(cfg) == real
    assert param_count(cfg) == real  # the estimator reads n_kv_head (estimate.params.kv_dim)
    assert cfg.shape.n_kv_head == n_kv


@pytest.mark.parametrize("bad", [3, 8, 0, 2.0, True])
def test_n_kv_head_not_dividing_n_head_is_refused(bad):
    with pytest.raises(ValueError, match=rf"n_kv_head={bad!r} must"):
        config(bad)


def test_rule_book_states_what_divides_what():
    # the course's TP splits KV heads (tp | n_kv_head) or copies them (n_kv_head | tp)
    for tp, kv in ((2, 4), (4, 4), (4, 2), (4, 1), (2, 1)):
        check_tensor_parallel(config(kv), tp)
        ParallelDims(tp=tp).check_model(config(kv), batch_size=4)
    six = GPTConfig.tiny(VOCAB, n_head=6, d_model=48, n_kv_head=3)
    with pytest.raises(ValueError, match=r"tp=2 must divide n_kv_head=3 or be a multiple of it"):
        check_tensor_parallel(six, 2)
    with pytest.raises(ValueError, match=r"tp=2 must divide n_kv_head=3 or be a multiple of it"):
        ParallelDims(tp=2).check_model(six, batch_size=4)
    with pytest.raises(ValueError, match=r"tp=8 must divide n_head=4"):
        check_tensor_parallel(config(1), 8)
    # the estimator's layouts split KV heads (its formulas divide them by tp): unchanged for Llama 3
    with pytest.raises(ValueError, match=r"tp=16 must divide n_kv_head=8$"):
        check_tp(16, LLAMA3_70B.n_head, LLAMA3_70B.d_ff, LLAMA3_70B.n_kv_head)
    with pytest.raises(ValueError, match=r"tp=16 must divide n_kv_head=8$"):
        ParallelDims(tp=16).check_model(LLAMA3_70B, batch_size=16)


def test_refused_in_the_parent_before_any_rank_starts():
    six = GPTConfig.tiny(VOCAB, n_head=6, d_model=48, n_kv_head=3, block_size=32)
    tc = TrainConfig(steps=1, batch_size=2, progress=False)
    with mock.patch("course_lib.parallel.tp.training.run_on_ranks") as launch:
        with pytest.raises(ValueError, match=r"n_kv_head=3 or be a multiple"):
            run_tensor_parallel(ParallelDims(tp=2), six, tc)
    launch.assert_not_called()


def test_qkv_rows_copy_each_kv_head_to_the_ranks_of_its_group():
    # d = 8, n_head = 4 (d_head 2), one KV head: rows [Q 0-7 | K 8-9 | V 10-11], all ranks share K, V
    assert qkv_rows(8, 4, 4, 1).tolist() == [[2 * r, 2 * r + 1, 8, 9, 10, 11] for r in range(4)]
    # two KV heads at tp = 4: ranks 0, 1 read KV head 0, ranks 2, 3 KV head 1
    assert [row[2:] for row in qkv_rows(8, 4, 4, 2).tolist()] == [[8, 9, 12, 13]] * 2 + [[10, 11, 14, 15]] * 2
    assert qkv_rows(8, 2, 4, 4).tolist() == qkv_rows(8, 2).tolist()  # multi-head: the split of before


def _owner_gets_only_its_own_gradient(self, t):
    """Mutant: the owner's KV rows reach every rank (g: all-reduce forward) but the backward does not
    sum the other ranks' gradients back to the owner (no f)."""
    from course_lib.comm.autograd import reduce_from_group
    local, slots, n_slots, first = self.shared
    buf = t.new_zeros((n_slots, *t.shape[1:])).index_copy(0, slots[first], t[local[first]])
    return t.index_copy(0, local, reduce_from_group(buf, self.group)[slots])


MUTANTS = {"owner's own gradient only": ("_from_first_holders", _owner_gets_only_its_own_gradient),
           "no exchange (copies read their zero padding)": ("weights", lambda self: (self.weight, self.bias))}


def _one_step(n_kv, sp, mutant=None):
    """Relative errors of the loss, the gathered gradients and the clip's global norm, TP vs one
    process, and whether every padding row (a KV head owned by another rank) has a zero gradient."""
    from course_lib.parallel.tp.layers import ColumnParallelLinear
    cfg = config(n_kv)
    x, y = get_batch(CharDataset("train", cfg.block_size), 4, torch.Generator().manual_seed(0))
    ref = GPT(cfg, seed=0)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    patch = mock.patch.object(ColumnParallelLinear, *MUTANTS[mutant]) if mutant else contextlib.nullcontext()
    with patch:
        model = apply_tensor_parallel(GPT(cfg, seed=0), None, sp)
        loss = model(x, y)[1]
        loss.backward()
    grads = gather_full_gradients(model)
    padding_zero = all(bool((m.weight.grad[m.shared[0][~m.shared[3]]] == 0).all()) for m in model.modules()
                       if isinstance(m, ColumnParallelLinear) and m.shared is not None)
    norm = clip_grad_norm_(model, 1e9)  # a huge max_norm: the norm only, nothing scaled
    grad_err = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in ref.named_parameters())
    errors = abs(loss.item() - ref_loss.item()) / ref_loss.item(), grad_err, abs(norm.item() / ref_norm.item() - 1)
    return errors, padding_zero


def _all_one_steps(tp):
    out = {(n_kv, sp): _one_step(n_kv, sp) for n_kv in KV_HEADS for sp in (False, True)}
    for name in MUTANTS:
        out[name] = _one_step(1, False, name)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_one_step_gradients_norm_and_mutants(tp):
    for out in run_on_ranks(_all_one_steps, tp, world_size=tp, timeout_s=120):
        for key in [(n, sp) for n in KV_HEADS for sp in (False, True)]:
            errors, padding_zero = out[key]
            # one forward and backward: fp32 sums in another order (ranks, heads), FP32_SUM_RTOL
            assert max(errors) <= FP32_SUM_RTOL, (tp, key, errors)
            assert padding_zero, key  # exactly: nothing flows into another rank's KV head's place
        for name in MUTANTS:  # each wrong exchange is caught by the comparison above, by 100x
            assert max(out[name][0]) > 100 * FP32_SUM_RTOL, (name, out[name])


STEPS = 3


def _train_all(tc):
    return {(n_kv, sp): train_tensor_parallel(config(n_kv), tc, sp) for n_kv in KV_HEADS for sp in (False, True)}


@pytest.mark.parametrize("tp", [2, 4])
def test_training_equals_the_single_process(tp):
    # a small clip, so that the global norm (with the copied KV rows weighted 1/copies) scales every step
    tc = TrainConfig(steps=STEPS, batch_size=4, grad_clip=0.05, eval_every=10**6, eval_batches=1, progress=False)
    refs = {}
    for n_kv in KV_HEADS:
        res = train_reference(config(n_kv), tc)
        refs[n_kv] = res.train_losses, flat_params(res.model), flat_grads(res.model)
    per_rank = run_on_ranks(_train_all, tc, world_size=tp, timeout_s=300)
    for key, out in per_rank[0].items():
        n_kv, sp = key
        ref_losses, ref_params, ref_grads = refs[n_kv]
        for r in range(1, tp):  # the all-reduced global loss: bit for bit on every rank
            assert per_rank[r][key].train_losses == out.train_losses, (key, r)
        # shards summed in another order, magnified by AdamW near g = 0 (tests/_tolerances): losses
        # within adamw_loss_atol, gradients in norm per tensor, parameters by AdamW's step and in RMS
        assert out.train_losses == pytest.approx(ref_losses, abs=adamw_loss_atol(tc.lr)), key
        model = GPT(config(n_kv))
        assert_grads_close_after_adamw(by_name(out.final_grads, model), by_name(ref_grads, model), str(key))
        assert_adamw_params_close(out.final_params, ref_params, tc.lr, tc.steps, tc.betas, msg=str(key))


def _params_per_rank(n_kv, sp):
    """Parameter bytes on this rank of the tensor-parallel GQA model."""
    return measured_state_bytes(apply_tensor_parallel(GPT(config(n_kv), seed=0), None, sp))["params"]


@pytest.mark.parametrize("n_kv", [1, 2])
def test_estimator_memory_counts_kv_heads(n_kv):
    # one process (tp = 1): the plain model repeats K and V to n_head heads for its per-head matmuls
    # and keeps those copies, 2e*n*(d - g) bytes more than the formula, which counts K and V n_kv_head
    # wide (what a GQA attention kernel keeps); exact integers, both sides
    cfg, n, e = config(n_kv), 2 * 32, 4
    saved = {}
    for n_layer in (1, 2):
        model = GPT(config(n_kv, n_layer=n_layer), seed=0)
        x, y = get_batch(CharDataset("train", 32), 2, torch.Generator().manual_seed(0))
        with SavedActivations(model) as s:
            model(x, y)
        saved[n_layer] = s.bytes
    repeated = 2 * e * n * (cfg.d_model - cfg.kv_dim)
    assert saved[2] - saved[1] == activation_bytes(cfg, 2, 32)["per_layer"] + repeated
    # tp = 2 splits the KV heads (2 | n_kv_head = 2): parameters per rank equal the estimator's
    if n_kv == 2:
        for sp in (False, True):
            params = run_on_ranks(_params_per_rank, n_kv, sp, world_size=2, timeout_s=60)[0]
            assert params == per_gpu_memory(cfg, 2, 32, recipe="fp32", tp=2, sequence_parallel=sp)["params"]


def _pieces_after_a_step(n_kv):
    """Whether every parameter equals its placement's piece of the gathered full state dict after an
    AdamW step (what loading a full checkpoint gives each rank), padding rows zero included."""
    from course_lib.parallel.tp import gather_full_state_dict, tp_placements
    cfg = config(n_kv)
    x, y = get_batch(CharDataset("train", cfg.block_size), 4, torch.Generator().manual_seed(0))
    model = apply_tensor_parallel(GPT(cfg, seed=0), None, False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model(x, y)[1].backward()
    opt.step()
    full, placements = gather_full_state_dict(model), tp_placements(model)
    return all(torch.equal(placements[n].local(full[n]), p.detach()) for n, p in model.named_parameters())


def test_each_rank_holds_its_placements_piece_after_a_step():
    # exact: the gather copies elements, AdamW leaves a zero weight with a zero gradient at zero
    assert all(run_on_ranks(_pieces_after_a_step, 1, world_size=4, timeout_s=60))


@pytest.mark.parametrize("dims", [ParallelDims(dp=2, tp=2, pp=2, zero=1, microbatches=2),
                                  ParallelDims(dp=2, tp=2, zero=1, sequence_parallel=True, microbatches=1)],
                         ids=["dp2-tp2-pp2-zero1", "dp2-tp2-sp-zero1"])
def test_composed_with_dp_pp_and_zero_equals_the_single_process(dims):
    # the hybrid runtime's gather, clip and ZeRO shards read the same placements: an owned KV head
    # (n_kv_head = 1 < tp = 2) composes unchanged; the comparison and its tolerances are test_hybrid's
    from course_lib.parallel.hybrid import run_hybrid, train_single
    from test_hybrid import SEQ, TRAIN, _assert_equal_to_single
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, d_model=16, n_kv_head=1)
    _assert_equal_to_single(run_hybrid(dims, cfg, TRAIN, timeout_s=240), train_single(cfg, TRAIN))


def test_demo_trains_a_gqa_model_under_torchrun_like_one_process():
    root = pathlib.Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "course_lib.demos.tensor_parallel", "--steps", "3", "--sequence-parallel", "--async-tp",
           "--n-head", "8", "--n-kv-head", "2", "--seq-len", "32", "--check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "n_head=8" in proc.stdout and "n_kv_head=2" in proc.stdout and "block_size=32" in proc.stdout, proc.stdout
    assert "async TP (overlapped)" in proc.stdout, proc.stdout
    # the demo's own tolerance, 1e-3, above adamw_loss_atol(3e-3) = 7e-5 (tests/_tolerances): --check's exit code says
    assert proc.stdout.rstrip().endswith("(tolerance 1.0e-03): OK"), proc.stdout


@pytest.mark.parametrize("args,rule", [(["--n-kv-head", "3"], "n_kv_head=3 must divide n_head=4"),
                                       (["--n-head", "6", "--n-kv-head", "3"],
                                        "tp=2 must divide n_kv_head=3 or be a multiple of it"),
                                       (["--seq-len", "0"], "block_size=0 must be")])
def test_demo_refuses_bad_heads_before_any_group(args, rule):
    code, err = run_main("course_lib.demos.tensor_parallel", args, env={"WORLD_SIZE": "2"})
    assert code != 0 and rule in err, err


def test_the_dtensor_comparison_refuses_grouped_query_attention():
    """Its whole-head permutation assumes Q, K and V of equal width: refused, not silently wrong."""
    from course_lib.parallel.tp.dtensor import apply_dtensor_tensor_parallel

    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_kv_head=2, d_model=16))

    with pytest.raises(ValueError, match="n_kv_head=2 with n_head=4"):  # before any mesh or group is touched
        apply_dtensor_tensor_parallel(model, None)
