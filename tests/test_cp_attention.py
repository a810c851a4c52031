"""Tests for course_lib.parallel.cp's attention: the layout, the block arithmetic, and the three
context-parallel methods on real gloo ranks.

The central claim: for each method (allgather, ring, ulysses), contiguous and zig-zag layouts,
cp = 2, 3 and 4 and sequence lengths that are not powers of two, every rank's output and its
dq, dk, dv equal single-process causal attention (F.scaled_dot_product_attention) restricted to
its rows, in fp32. The calls and bytes each method sends equal the counts in attention.py's
docstring. Mutants show the checks can fail: a plain average instead of the log-sum-exp merge,
on one process and inside the ring. The methods also run on sub-groups (cp groups of a larger
world), and PyTorch's experimental context_parallel is tried on the same inputs (on CPU it
refuses; the test says so and would compare its numbers if it ran).

One launch per cp size runs every method and layout (multi-rank launches dominate the time).
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import CommTracer, run_on_ranks
from course_lib.dims import CP_METHODS
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.cp import (
    ContextParallelAttention,
    SequenceLayout,
    attention_work,
    block_attention,
    chunk_ids,
    context_attention,
    merge_partials,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from course_lib.parallel.cp.blocks import block_attention_backward
from course_lib.parallel.cp.ring import ring_work

from _tolerances import assert_close_fp32_sums

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

B, H, HD = 2, 12, 8  # H = 12: cp = 2, 3 and 4 all divide it (Ulysses)
SEQ = {2: 36, 3: 30, 4: 24}  # divisible by 2cp, none a power of two


def qkv(T, seed=0, h=H):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, HD, generator=gen) for _ in range(4)]  # q, k, v and the output gradient


def reference(q, k, v, g):
    """Single-process causal attention and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def plain_average(out_a, lse_a, out_b, lse_b):
    """The mutant merge: averages the two partial outputs, ignoring how many keys each saw."""
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


# ---------------------------------------------------------------- layout (pure torch)

def test_chunks_and_positions():
    assert chunk_ids(4, 1, False) == [1] and chunk_ids(4, 1, True) == [1, 6]
    assert shard_positions(16, 4, 0, True).tolist() == [0, 1, 14, 15]
    assert shard_positions(16, 4, 3, False).tolist() == [12, 13, 14, 15]
    for cp, T in SEQ.items():
        for lb in (False, True):
            pos = [shard_positions(T, cp, r, lb) for r in range(cp)]
            assert sorted(torch.cat(pos).tolist()) == list(range(T))  # every position once
            assert all(bool((p[1:] > p[:-1]).all()) for p in pos)  # increasing
            x = torch.arange(3 * T).reshape(3, T)
            shards = [shard_sequence(x, cp, r, lb) for r in range(cp)]
            assert all(torch.equal(s[0], p) for s, p in zip(shards, pos))  # shard = x at the positions
            assert torch.equal(unshard_sequence(shards, cp, lb), x)
            assert torch.equal(SequenceLayout(T, cp, lb).all_positions(), torch.cat(pos))


def brute_force_work(T, cp, lb):
    """Count (query, key) pairs with key <= query, query by query."""
    return [sum(p + 1 for p in shard_positions(T, cp, r, lb).tolist()) for r in range(cp)]


@pytest.mark.parametrize("cp,T", [(1, 7), (2, 12), (3, 30), (4, 24), (4, 48), (5, 70)])
def test_attention_work_closed_form(cp, T):
    for lb in (False, True):
        work = attention_work(T, cp, lb)
        assert work == brute_force_work(T, cp, lb)
        assert sum(work) == T * (T + 1) // 2  # the whole causal triangle
    zigzag, contiguous = attention_work(T, cp, True), attention_work(T, cp, False)
    assert len(set(zigzag)) == 1  # the zig-zag evens the work exactly
    c = T // cp
    assert contiguous[-1] * (c + 1) == contiguous[0] * (c + 1 + 2 * c * (cp - 1))  # ratio 1 + 2c(cp-1)/(c+1)


def test_ring_work_skips_masked_blocks():
    """The ring computes a rectangle per step: contiguous rank r computes r+1 blocks of s x s
    (the others are wholly masked and skipped); zig-zag ranks all compute the same."""
    cp, T = 4, 24
    s = T // cp
    assert ring_work(SequenceLayout(T, cp, False)) == [(r + 1) * s * s for r in range(cp)]
    c = T // (2 * cp)
    assert ring_work(SequenceLayout(T, cp, True)) == [(4 + 2 * (cp - 1)) * c * c] * cp


def test_bad_layouts_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"seq_len=36 must be divisible by 2\*cp = 8"):
        SequenceLayout(36, 4, load_balance=True)
    with pytest.raises(ValueError, match="seq_len=30 must be divisible by cp = 4"):
        SequenceLayout(30, 4, load_balance=False)
    SequenceLayout(24, 3, True).check(n_head=12, method="ulysses")  # 3 | 12
    with pytest.raises(ValueError, match="cp=3 must divide n_head=4 for method='ulysses'"):
        SequenceLayout(24, 3, True).check(n_head=4, method="ulysses")
    SequenceLayout(24, 3, True).check(n_head=4, method="ring")  # the ring has no head rule
    with pytest.raises(ValueError, match="cp_method='tree'"):
        SequenceLayout(24, 3, True).check(n_head=4, method="tree")
    with pytest.raises(ValueError, match="rank=4 must be < cp=4"):
        chunk_ids(4, 4, True)


def test_module_positions_follow_the_layout():
    attn = ContextParallelAttention(None, SequenceLayout(24, 4, True), "ring", rank=1)  # rank given: no group needed
    assert attn.q_pos.tolist() == [3, 4, 5, 18, 19, 20]
    attn.set_layout(SequenceLayout(16, 4, False))  # another sequence length: positions recomputed
    assert attn.q_pos.tolist() == [4, 5, 6, 7]
    assert attn.state_dict() == {}  # swapping CausalAttention for it changes no state-dict key
    assert repr(attn) == "ContextParallelAttention(method='ring', cp=4, load_balance=False)"
    with pytest.raises(ValueError, match="method='tree'"):
        ContextParallelAttention(None, SequenceLayout(24, 4, True), "tree", rank=0)


# ---------------------------------------------------------------- blocks (one process)

def test_block_attention_is_causal_attention_by_position():
    T = 30
    q, k, v, g = qkv(T)
    pos = torch.arange(T)
    out, lse = block_attention(q, k, v, pos, pos)
    assert_close_fp32_sums(out, reference(q, k, v, g)[0])
    scores = (q @ k.transpose(-2, -1)) / HD ** 0.5
    want_lse = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).logsumexp(-1)
    assert_close_fp32_sums(lse, want_lse)
    # Positions, not indices, decide: the same keys in a shuffled order give the same result.
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(1))
    out_p, lse_p = block_attention(q, k[:, :, perm], v[:, :, perm], pos, pos[perm])
    assert_close_fp32_sums(out_p, out)


def test_block_attention_empty_rows():
    """Queries before every key: lse = -inf, out = 0, no NaN (forward and backward)."""
    q, k, v, _ = qkv(6)
    q.requires_grad_()
    out, lse = block_attention(q, k, v, torch.arange(6), torch.tensor([3, 4, 5, 6, 7, 8]))
    assert torch.equal(lse[..., :3], torch.full_like(lse[..., :3], float("-inf")))
    assert torch.equal(out[..., :3, :], torch.zeros_like(out[..., :3, :]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    none_visible = block_attention(q, k[..., :0, :], v[..., :0, :], torch.arange(6), torch.arange(0))
    assert torch.equal(none_visible[0], torch.zeros_like(q)) and bool((none_visible[1] == float("-inf")).all())


def test_merge_partials_equals_softmax_over_the_union():
    T = 24
    q, k, v, g = qkv(T)
    pos = torch.arange(T)
    whole = block_attention(q, k, v, pos, pos)
    a = torch.tensor([0, 1, 2, 21, 22, 23])  # the zig-zag chunks of rank 0 at cp = 4 ...
    b = torch.tensor([i for i in range(T) if i not in a.tolist()])  # ... and everything else
    part_a = block_attention(q, k[:, :, a], v[:, :, a], pos, a)
    part_b = block_attention(q, k[:, :, b], v[:, :, b], pos, b)
    out, lse = merge_partials(*part_a, *part_b)
    assert_close_fp32_sums(out, whole[0])
    assert_close_fp32_sums(lse, whole[1])
    # The check can fail: a plain average is far off wherever the blocks saw different key counts.
    wrong, _ = plain_average(*part_a, *part_b)
    assert (wrong - whole[0]).abs().max() > 0.1
    # Rows with no key in either block stay 0 / -inf without NaN; an empty block is neutral.
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    both_empty = merge_partials(*empty, *empty)
    assert torch.equal(both_empty[0], empty[0]) and torch.equal(both_empty[1], empty[1])
    one = merge_partials(*empty, *whole)
    assert torch.equal(one[0], whole[0]) and torch.equal(one[1], whole[1])


def test_block_backward_sums_to_the_full_gradient():
    """The hand-written backward (FlashAttention-2's dS = P ∘ (dP - D)) from the final lse: dQ
    summed over key blocks and dK, dV over query blocks equal autograd's gradients."""
    T = 24
    q, k, v, g = qkv(T)
    _, dq, dk, dv = reference(q, k, v, g)
    pos = torch.arange(T)
    out, lse = block_attention(q, k, v, pos, pos)
    delta = (g * out).sum(-1)
    got_dq, got_dk, got_dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    blocks = [torch.arange(0, 9), torch.arange(9, 16), torch.arange(16, T)]
    for qi in blocks:
        for ki in blocks:
            a, b, c = block_attention_backward(q[:, :, qi], k[:, :, ki], v[:, :, ki], qi, ki, lse[..., qi],
                                               g[:, :, qi], delta[..., qi])
            got_dq[:, :, qi] += a
            got_dk[:, :, ki] += b
            got_dv[:, :, ki] += c
    for got, want in ((got_dq, dq), (got_dk, dk), (got_dv, dv)):
        assert_close_fp32_sums(got, want)


# ---------------------------------------------------------------- on real ranks

def _canonical(summary):
    """Tracer summary with torch < 2.13's collective names mapped to 2.13's."""
    rename = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
    return {rename.get(op, op): (s["calls"], s["bytes_sent"], s["bytes_recv"]) for op, s in summary.items()}


def _every_method(T, q, k, v, g):
    """On each rank: every method x layout, forward and backward traced; the ring with a plain
    average merge; ContextParallelAttention inside a GPT."""
    from course_lib.parallel.cp import ring as ring_module

    cp, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for method in CP_METHODS:
        for lb in (False, True):
            layout = SequenceLayout(T, cp, lb)
            ql, kl, vl = (layout.shard(t, rank, dim=2).requires_grad_() for t in (q, k, v))
            with CommTracer() as fwd:
                out = context_attention(ql, kl, vl, layout.positions(rank), None, layout, method)
            with CommTracer() as bwd:
                out.backward(layout.shard(g, rank, dim=2))
            results[method, lb] = dict(out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad,
                                       fwd=_canonical(fwd.summary()), bwd=_canonical(bwd.summary()))
    layout = SequenceLayout(T, cp, True)
    ring_module.merge_partials, real_merge = plain_average, ring_module.merge_partials
    try:
        shards = [layout.shard(t, rank, dim=2) for t in (q, k, v)]
        results["mutant"] = context_attention(*shards, layout.positions(rank), None, layout, "ring")
    finally:
        ring_module.merge_partials = real_merge
    # The module is a drop-in for every block's CausalAttention; the model gets the positions.
    model = GPT(GPTConfig.tiny(97, n_head=H, d_model=H * 4, block_size=T), seed=0)
    idx = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(2))
    for method in CP_METHODS:
        for block in model.blocks:
            block.attn.attend = ContextParallelAttention(None, layout, method)
        logits, _ = model(layout.shard(idx, rank), pos=layout.positions(rank))
        results["model", method] = logits.detach()
    results["repr"] = repr(model.blocks[0].attn.attend)
    return results


@pytest.fixture(scope="module", params=sorted(SEQ))
def per_rank(request):
    cp = request.param
    T = SEQ[cp]
    q, k, v, g = qkv(T)
    return cp, T, (q, k, v, g), run_on_ranks(_every_method, T, q, k, v, g, world_size=cp, timeout_s=120)


def test_forward_and_backward_equal_the_single_process(per_rank):
    cp, T, (q, k, v, g), ranks = per_rank
    want = dict(zip(("out", "dq", "dk", "dv"), reference(q, k, v, g)))
    for method in CP_METHODS:
        for lb in (False, True):
            layout = SequenceLayout(T, cp, lb)
            for rank, res in enumerate(ranks):
                for name, full in want.items():
                    # fp32 sums in another order (blocks merged by log-sum-exp, gradients
                    # accumulated round the ring): course-wide FP32_SUM_RTOL (tests/_tolerances.py).
                    assert_close_fp32_sums(res[method, lb][name], layout.shard(full, rank, dim=2),
                                           msg=f"{method} load_balance={lb} cp={cp} rank {rank}: {name}")


def test_the_check_fails_on_a_plain_average_merge(per_rank):
    cp, T, (q, k, v, g), ranks = per_rank
    layout = SequenceLayout(T, cp, True)
    want = reference(q, k, v, g)[0]
    assert max((res["mutant"] - layout.shard(want, r, dim=2)).abs().max().item() for r, res in enumerate(ranks)) > 0.1


def test_module_is_a_drop_in_for_causal_attention(per_rank):
    cp, T, _, ranks = per_rank
    layout = SequenceLayout(T, cp, True)
    model = GPT(GPTConfig.tiny(97, n_head=H, d_model=H * 4, block_size=T), seed=0)
    idx = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = model(idx)
    for method in CP_METHODS:
        got = layout.unshard([res["model", method] for res in ranks])
        assert_close_fp32_sums(got, logits, msg=method)
    assert ranks[0]["repr"] == f"ContextParallelAttention(method={CP_METHODS[-1]!r}, cp={cp}, load_balance=True)"


def test_calls_and_bytes_per_layer(per_rank):
    """The counts of attention.py's docstring, per rank per layer: one block = B·H·s·hd fp32."""
    cp, T, _, ranks = per_rank
    n = B * H * (T // cp) * HD * 4  # bytes of one block
    want = {
        "allgather": ({"all_gather_single": (1, 2 * n, 2 * cp * n)},
                      {"reduce_scatter_single": (1, 2 * cp * n, 2 * n)}),
        "ring": ({"isend": (cp - 1, (cp - 1) * 2 * n, 0), "irecv": (cp - 1, 0, (cp - 1) * 2 * n)},
                 {"isend": (2 * cp - 1, (2 * cp - 1) * 2 * n, 0), "irecv": (2 * cp - 1, 0, (2 * cp - 1) * 2 * n)}),
        # the tracer counts the buffers handed to the all-to-all: Q||K||V then O (backward: dO
        # then dQ||dK||dV); (cp-1)/cp of them cross to other ranks.
        "ulysses": ({"all_to_all_single": (2, 4 * n, 4 * n)}, {"all_to_all_single": (2, 4 * n, 4 * n)}),
    }
    for method, (fwd, bwd) in want.items():
        for lb in (False, True):
            for res in ranks:
                assert res[method, lb]["fwd"] == fwd, (method, lb)
                assert res[method, lb]["bwd"] == bwd, (method, lb)


def _in_subgroups(T, q, k, v, g):
    """cp = 2 groups {0, 2} and {1, 3} of 4 ranks (as a dp x cp mesh makes them): group ranks
    differ from global ranks, which the ring's peers must translate."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[dist.get_rank() % 2]
    rank, layout = dist.get_rank(group), SequenceLayout(T, 2, True)
    results = {}
    for method in CP_METHODS:
        ql, kl, vl = (layout.shard(t, rank, dim=2).requires_grad_() for t in (q, k, v))
        out = context_attention(ql, kl, vl, layout.positions(rank), group, layout, method)
        out.backward(layout.shard(g, rank, dim=2))
        results[method] = (out.detach(), ql.grad, kl.grad, vl.grad)
    return rank, results


def test_methods_on_subgroups():
    T = 36
    q, k, v, g = qkv(T)
    want = reference(q, k, v, g)
    layout = SequenceLayout(T, 2, True)
    for rank, results in run_on_ranks(_in_subgroups, T, q, k, v, g, world_size=4, timeout_s=120):
        for method, got in results.items():
            for name, a, full in zip(("out", "dq", "dk", "dv"), got, want):
                assert_close_fp32_sums(a, layout.shard(full, rank, dim=2), msg=f"{method}: {name}")


def _torch_context_parallel(T, q, k, v):
    """PyTorch's experimental context_parallel on the same inputs: its output gathered back, or
    the error it raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    qs, ks, vs = q.clone(), k.clone(), v.clone()
    try:
        with context_parallel(mesh, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return context_parallel_unshard(mesh, [out], [2])[0]
    except (NotImplementedError, RuntimeError) as e:
        return repr(e)


def test_torch_context_parallel_on_cpu():
    """torch.distributed.tensor.experimental.context_parallel intercepts only the CUDA flash and
    memory-efficient SDPA kernels; on CPU (torch 2.13) SDPA dispatches to
    _scaled_dot_product_flash_attention_for_cpu, which has no sharding rule, so it refuses: the
    course compares its methods with each other and with the single process instead. Should a
    later torch run it on CPU, this test compares its numbers with the single process."""
    T = 24
    q, k, v, g = qkv(T, h=4)
    got = run_on_ranks(_torch_context_parallel, T, q, k, v, world_size=2, timeout_s=120, check_collectives=False)
    if isinstance(got[0], str):
        assert "_scaled_dot_product_flash_attention_for_cpu" in got[0], got[0]
    else:
        for full in got:
            assert_close_fp32_sums(full, reference(q, k, v, g)[0])
