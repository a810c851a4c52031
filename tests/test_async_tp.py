"""Tests for course_lib.parallel.tp.async_tp: the decomposed all-gather + matmul and matmul +
reduce-scatter (Wang et al. 2023) on real gloo ranks at tp = 2, 3 and 4.

Each is compared, forward and backward (input and weight gradients), with the plain collective +
matmul on the same ranks (course_lib.comm.autograd's gather_along_dim / scatter_along_dim) and
with the single-process matmul. Bad shapes are refused with a ValueError on every rank before
any send. A mutant ring (a chunk multiplied at the wrong place) shows the comparison can fail.
The traffic is counted exactly: p - 1 chunks per ring, the ring collectives' bytes.
apply_tensor_parallel(..., sequence_parallel=True, async_tp=True) trains 3 AdamW steps like plain
TP and like one process at tp = 2, 3, 4; the TP demo's --async-tp runs under torchrun.
Also run under COURSE_NCCL_RULES=1: every step's batch must pair up in NCCL's issue order.
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import run_on_ranks
from course_lib.comm.autograd import gather_along_dim, scatter_along_dim
from course_lib.parallel.tp import async_tp
from course_lib.runtime.device import rank_device

from _tolerances import assert_close_fp32_sums

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

B, T, D_IN, D_OUT = 2, 12, 8, 12  # T and both feature sizes divisible by 2, 3 and 4


def _data():
    """The full problem, the same on every rank and in the parent: X (B, T, D_IN), W (D_OUT,
    D_IN) and a loss weight G of Y's shape (a plain .sum() would give every element the same
    gradient, and a misplaced chunk would go unseen)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D_IN, generator=gen)
    w = torch.randn(D_OUT, D_IN, generator=gen)
    g = torch.randn(B, T, D_OUT, generator=gen)
    return x, w, g


def _single_process():
    """Y = X W^T and its gradients against the loss (Y * G).sum(), in one process."""
    x, w, g = _data()
    x, w = x.requires_grad_(), w.requires_grad_()
    y = F.linear(x, w)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad


def _on_rank(kind: str):
    """Rank r's pieces, the decomposed op and the plain one, each with its gradients.

    gather ("all_gather_matmul"): x_shard = X's r-th sequence chunk, w = W's r-th row block
    (column parallel); y = X W_r^T (B, T, D_OUT/p). scatter ("matmul_reduce_scatter"): x = X's
    r-th feature block, w = W's r-th column block (row parallel); y = (X W^T)'s r-th sequence chunk.
    """
    p, r = dist.get_world_size(), dist.get_rank()
    dev = rank_device()
    x, w, g = (t.to(dev) for t in _data())
    if kind == "gather":
        x_r, w_r, g_r = x.chunk(p, 1)[r], w.chunk(p, 0)[r], g.chunk(p, 2)[r]
        ops = {"async": lambda a, b: async_tp.all_gather_matmul(a, b),
               "plain": lambda a, b: F.linear(gather_along_dim(a, 1), b)}
    else:
        x_r, w_r, g_r = x.chunk(p, 2)[r], w.chunk(p, 1)[r], g.chunk(p, 1)[r]
        ops = {"async": lambda a, b: async_tp.matmul_reduce_scatter(a, b),
               "plain": lambda a, b: scatter_along_dim(F.linear(a, b), 1)}
    out = {}
    for name, op in ops.items():
        a, b = x_r.clone().requires_grad_(), w_r.clone().requires_grad_()
        y = op(a, b)
        (y * g_r).sum().backward()
        out[name] = [t.detach().cpu() for t in (y, a.grad, b.grad)]
    return out


def _expected_piece(kind, full, p, r):
    """Rank r's piece of the single-process (y, dX, dW)."""
    y, gx, gw = full
    if kind == "gather":
        return y.chunk(p, 2)[r], gx.chunk(p, 1)[r], gw.chunk(p, 0)[r]
    return y.chunk(p, 1)[r], gx.chunk(p, 2)[r], gw.chunk(p, 1)[r]


@pytest.mark.parametrize("kind", ["gather", "scatter"])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_decomposed_equals_plain_and_single_process(tp, kind):
    res = run_on_ranks(_on_rank, kind, world_size=tp, timeout_s=60)
    full = _single_process()
    for r in range(tp):
        want = _expected_piece(kind, full, tp, r)
        for what, got_async, got_plain, exp in zip(("y", "dX", "dW"), res[r]["async"], res[r]["plain"], want):
            assert got_async.shape == exp.shape, (what, r)
            # The ring sums chunk by chunk (reduce-scatter: rank partials in ring order; dW: one
            # chunk of the sequence at a time), one matmul sums in its own order: equal up to the
            # rounding of fp32 sums taken in another order (FP32_SUM_RTOL's reason).
            assert_close_fp32_sums(got_async, exp, msg=f"{kind} tp={tp} rank {r} {what} vs single process")
            assert_close_fp32_sums(got_async, got_plain, msg=f"{kind} tp={tp} rank {r} {what} vs plain collective")


def _shifted_ring(on_rank_kind):
    """A mutant: the same ring, every chunk labelled one place off (as if the ring turned the
    other way). The comparison above must catch it."""
    orig = async_tp.ring

    def bad(group, gather=None, on_chunk=None, partial=None):
        p = dist.get_world_size(group)
        return orig(group, gather, None if on_chunk is None else (lambda c, xc: on_chunk((c + 1) % p, xc)),
                    None if partial is None else (lambda c: partial((c + 1) % p)))

    async_tp.ring = bad
    try:
        return _on_rank(on_rank_kind)
    finally:
        async_tp.ring = orig


@pytest.mark.parametrize("kind", ["gather", "scatter"])
def test_a_mislabelled_ring_fails_the_comparison(kind):
    tp = 3
    res = run_on_ranks(_shifted_ring, kind, world_size=tp, timeout_s=60)
    full = _single_process()
    with pytest.raises(AssertionError):
        for r in range(tp):
            for got, exp in zip(res[r]["async"], _expected_piece(kind, full, tp, r)):
                assert_close_fp32_sums(got, exp)


def _traffic(kind: str):
    """This rank's calls for one forward and one backward, forward alone first."""
    from course_lib import CommTracer

    p, r = dist.get_world_size(), dist.get_rank()
    x, w, g = (t.to(rank_device()) for t in _data())
    if kind == "gather":
        a, b, op = x.chunk(p, 1)[r], w.chunk(p, 0)[r], async_tp.all_gather_matmul
    else:
        a, b, op = x.chunk(p, 2)[r], w.chunk(p, 1)[r], async_tp.matmul_reduce_scatter
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    with CommTracer() as fwd:
        y = op(a, b)
    with CommTracer() as bwd:
        y.sum().backward()
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("kind", ["gather", "scatter"])
def test_traffic_is_the_ring_collectives(kind):
    """Point-to-point only, p - 1 chunks per ring: what a ring all-gather or reduce-scatter of the
    same tensor sends (each rank sends (p-1)/p of the gathered tensor). Counted exactly."""
    tp = 4
    res = run_on_ranks(_traffic, kind, world_size=tp, timeout_s=60)
    fp32, n = 4, tp - 1
    x_chunk = B * (T // tp) * fp32  # times features
    for fwd, bwd in res:
        assert set(fwd) == {"isend", "irecv"} and set(bwd) == {"isend", "irecv"}, (fwd, bwd)
        if kind == "gather":  # forward: X's chunks (D_IN); backward: X again + the dX partial sums (D_IN)
            assert fwd["isend"] == {"calls": n, "bytes_sent": n * x_chunk * D_IN, "bytes_recv": 0}
            assert bwd["isend"] == {"calls": 2 * n, "bytes_sent": 2 * n * x_chunk * D_IN, "bytes_recv": 0}
        else:  # forward: Y's partial sums (D_OUT); backward: dY's chunks (D_OUT)
            assert fwd["isend"] == {"calls": n, "bytes_sent": n * x_chunk * D_OUT, "bytes_recv": 0}
            assert bwd["isend"] == {"calls": n, "bytes_sent": n * x_chunk * D_OUT, "bytes_recv": 0}
        assert fwd["irecv"]["bytes_recv"] == fwd["isend"]["bytes_sent"]
        assert bwd["irecv"]["bytes_recv"] == bwd["isend"]["bytes_sent"]


def _refusals():
    """Every bad shape's message, raised before this rank sent or waited on anything."""
    from course_lib import CommTracer

    x = torch.randn(2, 10, 8, device=rank_device())
    msgs = []
    with CommTracer() as tracer:
        for call in (lambda: async_tp.matmul_reduce_scatter(x, torch.randn(12, 8, device=x.device)),  # 10 % 4
                     lambda: async_tp.all_gather_matmul(x, torch.randn(12, 6, device=x.device)),  # 8 != 6
                     lambda: async_tp.all_gather_matmul(x, torch.randn(12, 8, device=x.device), dim=2)):
            with pytest.raises(ValueError) as err:
                call()
            msgs.append(str(err.value))
    return msgs, len(tracer.records)


def test_bad_shapes_are_refused_before_any_send():
    res = run_on_ranks(_refusals, world_size=4, timeout_s=60)
    for msgs, calls in res:
        assert calls == 0
        assert "size 10 of dim 1 must be divisible by tp=4" in msgs[0]
        assert "x's last size 8 must equal w's in_features w.shape[1]=6" in msgs[1]
        assert "dim=2 is the feature dim of x" in msgs[2]


# ---- apply_tensor_parallel(..., sequence_parallel=True, async_tp=True): training steps -------------

SEQ = 12  # the whole sequence splits over 2, 3 and 4 ranks


def _config(tie=True, n_kv_head=None):
    from course_lib.data import CharDataset
    from course_lib.model import GPTConfig

    # 12 heads, 48 features, 192 MLP columns: divisible by 2, 3 and 4; n_kv_head < tp copies each
    # key/value head over tp / n_kv_head ranks (grouped-query attention)
    return GPTConfig(vocab_size=CharDataset("train").vocab_size, block_size=SEQ, n_layer=2, n_head=12,
                     d_model=48, d_ff=192, tie_weights=tie, n_kv_head=n_kv_head)


def _train_cfg():
    from course_lib.train import TrainConfig

    # 3 AdamW steps with clipping: the setting tests/_tolerances measured its AdamW bounds on.
    return TrainConfig(steps=3, batch_size=4, grad_clip=1.0, eval_every=10**6, eval_batches=1, progress=False)


def _train_plain_and_async(tie, n_kv_head=None):
    """train_tensor_parallel with sequence parallelism, plain and with async_tp=True, and what an
    async model's blocks hold."""
    from collections import Counter

    from course_lib.model import GPT
    from course_lib.parallel.tp import apply_tensor_parallel, training

    cfg, tc = _config(tie, n_kv_head), _train_cfg()
    model = GPT(cfg)
    with pytest.raises(ValueError) as err:  # refused before the model changes
        apply_tensor_parallel(model, None, sequence_parallel=False, async_tp=True)
    untouched = not any(isinstance(m, async_tp.ColumnParallelLinear) for m in model.modules())
    kinds = Counter(type(m).__name__ for m in apply_tensor_parallel(GPT(cfg), None, True, async_tp=True).modules()
                    if "ParallelLinear" in type(m).__name__)
    plain = training.train_tensor_parallel(cfg, tc, sequence_parallel=True)
    asy = training.train_tensor_parallel(cfg, tc, sequence_parallel=True, async_tp=True)
    return {"plain": plain, "async": asy, "refusal": str(err.value), "untouched": untouched, "kinds": kinds}


@pytest.mark.parametrize("tp,tie,n_kv_head", [(2, True, None), (3, False, None), (4, True, None),
                                              (2, True, 1), (4, False, 2)])
def test_async_tp_trains_like_plain_tp_and_one_process(tp, tie, n_kv_head):
    from course_lib.model import GPT
    from course_lib.train import train_reference, flat_grads, flat_params
    from _tolerances import adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw, by_name

    cfg, tc = _config(tie, n_kv_head), _train_cfg()
    res = run_on_ranks(_train_plain_and_async, tie, n_kv_head, world_size=tp, timeout_s=180)
    ref = train_reference(cfg, tc)
    ref_params, ref_grads = flat_params(ref.model), flat_grads(ref.model)
    for r in range(tp):
        assert "async_tp=True needs sequence_parallel=True" in res[r]["refusal"] and res[r]["untouched"]
        # every block's four linears overlapped; the head stays plain
        assert res[r]["kinds"] == {"AsyncColumnParallelLinear": 2 * cfg.n_layer, "AsyncRowParallelLinear": 2 * cfg.n_layer,
                                   "ColumnParallelLinear": 1}, res[r]["kinds"]
        assert res[r]["async"].train_losses == res[0]["async"].train_losses  # all-reduced: bit for bit
    out, plain = res[0]["async"], res[0]["plain"]
    model = GPT(cfg)
    # The ring sums in another order than one all-gather/reduce-scatter and one matmul, and AdamW
    # magnifies fp32 rounding near g = 0 (tests/_tolerances): losses within adamw_loss_atol, the
    # last gradients in norm per tensor, parameters bounded by AdamW's step and in RMS.
    for name, want_losses, want_params, want_grads in (("single process", ref.train_losses, ref_params, ref_grads),
                                                       ("plain TP", plain.train_losses, plain.final_params,
                                                        plain.final_grads)):
        assert out.train_losses == pytest.approx(want_losses, abs=adamw_loss_atol(tc.lr)), name
        assert_grads_close_after_adamw(by_name(out.final_grads, model), by_name(want_grads, model), name)
        assert_adamw_params_close(out.final_params, want_params, tc.lr, tc.steps, tc.betas, msg=name)


def test_async_tp_without_sequence_parallel_is_refused_in_the_parent():
    with pytest.raises(ValueError, match="async_tp=True needs sequence_parallel=True"):
        async_tp.check_async_tp(True, False)
    async_tp.check_async_tp(True, True)
    async_tp.check_async_tp(False, False)


def test_demo_async_tp_under_torchrun_with_gloo():
    import os
    import pathlib
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.tensor_parallel", "--steps", "3", "--sequence-parallel", "--async-tp",
           "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=pathlib.Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor parallel on 2 ranks (gloo), sequence parallel, async TP (overlapped)" in proc.stdout, proc.stdout
    # the demo's default loss tolerance, 1e-3, is above adamw_loss_atol(3e-3) = 7e-5 (tests/_tolerances)
    assert proc.stdout.rstrip().endswith("(tolerance 1.0e-03): OK"), proc.stdout


def test_demo_refuses_async_tp_without_sequence_parallel():
    from _demo_cli import run_main

    code, err = run_main("course_lib.demos.tensor_parallel", ["--async-tp"], env={"WORLD_SIZE": "2"})
    assert code == 2 and "async_tp=True needs sequence_parallel=True" in err, err
