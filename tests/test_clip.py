"""The one weighted global-norm clip (course_lib.parallel.clip) on real gloo ranks: gradients
replicated, sharded on dim 0, or both (sharded over half the ranks, replicated over the other
half) give the total norm and the clipped gradients of torch.nn.utils.clip_grad_norm_ on the
full tensors in one process; a wrong weight gives a different norm; bad input raises a
ValueError naming the value and the rule before any collective."""

import pytest
import torch
import torch.distributed as dist

from course_lib import CommTracer, run_on_ranks
from course_lib.parallel.clip import THIS_RANK, clip_grad_norm_

SHAPES = [(8, 6), (12,), (4, 3, 5), (16, 2)]
# torch sums the squares in fp32 (a norm per tensor, then the norm of those); ours sums them in
# fp64 and rounds once: the two norms differ by fp32 rounding of a sum of ~100 squares, a few
# ulps (~1e-7 relative). The clipped gradients inherit it through the coefficient.
RTOL = 1e-6


def full_grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def torch_reference(grads, max_norm):
    """(norm, clipped gradients) of torch.nn.utils.clip_grad_norm_ in one process."""
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, [p.grad for p in params]


def piece(g, layout, rank, world):
    """(this rank's piece of g, its number of copies among the world's ranks).
    replicated: all of g on every rank; dim0: rows split over all ranks; mix: rows split over
    half the ranks (rank % half), each half-shard held by 2 ranks (world / half copies)."""
    if layout == "replicated":
        return g.clone(), world
    if layout == "dim0":
        return g.chunk(world, dim=0)[rank].clone(), 1
    half = world // 2
    return g.chunk(half, dim=0)[rank % half].clone(), world // half


def _clip_on_rank(grads, layouts, max_norm, wrong=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = [piece(g, lay, rank, world) for g, lay in zip(grads, layouts)]
    # wrong=True: every tensor weighted 1, as if it lived on this rank only
    pairs = [(t, 1 if wrong else 1 / copies) for t, copies in pieces]
    norm = clip_grad_norm_(pairs, max_norm)
    return float(norm), [t for t, _ in pairs]


def assemble(per_rank, layouts, world):
    """The full clipped gradients from the ranks' pieces (each copy must agree exactly)."""
    out = []
    for i, lay in enumerate(layouts):
        pieces = [per_rank[r][1][i] for r in range(world)]
        if lay == "replicated":
            assert all(torch.equal(p, pieces[0]) for p in pieces)
            out.append(pieces[0])
        elif lay == "dim0":
            out.append(torch.cat(pieces))
        else:
            half = world // 2
            for r in range(half, world):
                assert torch.equal(pieces[r], pieces[r % half])
            out.append(torch.cat(pieces[:half]))
    return out


LAYOUTS = {"replicated": ["replicated"] * 4, "dim0": ["dim0"] * 4,
           "mixed": ["replicated", "dim0", "mix", "dim0"], "mix": ["mix"] * 4}


@pytest.mark.parametrize("world", [2, 4])
def test_equals_torch_clip_of_the_full_tensors(world):
    grads = full_grads()
    full_norm = float(torch_reference(grads, 1e9)[0])
    cases = [(name, lay, max_norm) for name, lay in LAYOUTS.items() for max_norm in (full_norm / 3, 1e9)]

    def all_cases():
        return [_clip_on_rank(grads, lay, m) for _, lay, m in cases]

    per_rank = run_on_ranks(all_cases, world_size=world, timeout_s=60)
    for k, (name, lay, max_norm) in enumerate(cases):
        ref_norm, ref_grads = torch_reference(grads, max_norm)
        results = [per_rank[r][k] for r in range(world)]
        assert all(res[0] == results[0][0] for res in results), name  # one all-reduce: the same norm everywhere
        assert results[0][0] == pytest.approx(float(ref_norm), rel=RTOL), name
        for got, want in zip(assemble(results, lay, world), ref_grads):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0, msg=name)
        if max_norm == 1e9:  # no clipping: the gradients are untouched, exactly
            for got, want in zip(assemble(results, lay, world), grads):
                assert torch.equal(got, want), name


def test_a_wrong_weight_gives_a_different_norm():
    """A replicated tensor weighted 1 instead of 1/copies is counted `copies` times: the norm
    (and so the clipped update) moves far beyond the tolerance above, so the tests would fail."""
    grads = full_grads()
    ref_norm = float(torch_reference(grads, 1e9)[0])
    lay = LAYOUTS["mixed"]
    per_rank = run_on_ranks(lambda: (_clip_on_rank(grads, lay, 1e9), _clip_on_rank(grads, lay, 1e9, wrong=True)),
                            world_size=4, timeout_s=60)
    right, wrong = per_rank[0]
    assert right[0] == pytest.approx(ref_norm, rel=RTOL)
    assert abs(wrong[0] - ref_norm) > 1000 * RTOL * ref_norm
    # what it is instead: the replicated tensor 4 times, each half-shard of "mix" twice
    sq = [g.double().square().sum().item() for g in grads]
    assert wrong[0] == pytest.approx((4 * sq[0] + sq[1] + 2 * sq[2] + sq[3]) ** 0.5, rel=RTOL)


def test_one_process_without_a_group():
    """No process group (or THIS_RANK): no collective, the plain single-process clip."""
    grads = full_grads()
    for group in (None, THIS_RANK):
        ours = [g.clone() for g in grads]
        ref_norm, ref_grads = torch_reference(grads, 0.5)
        assert float(clip_grad_norm_([(g, 1) for g in ours], 0.5, group)) == pytest.approx(float(ref_norm), rel=RTOL)
        for got, want in zip(ours, ref_grads):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    none_skipped = [torch.ones(3) * 4]  # a None gradient is skipped, as torch skips parameters without .grad
    assert float(clip_grad_norm_([(None, 1), (none_skipped[0], 1)], 1e9)) == pytest.approx(48 ** 0.5, rel=RTOL)


BAD = [
    (dict(max_norm=-1.0), "max_norm=-1.0 must be a finite number >= 0"),
    (dict(max_norm=float("nan")), "max_norm=nan must be a finite number >= 0"),
    (dict(weight=0), "weight=0 must be in (0, 1]"),
    (dict(weight=1.5), "weight=1.5 must be in (0, 1]"),
    (dict(weight=-0.5), "weight=-0.5 must be in (0, 1]"),
    (dict(weight=True), "weight=True must be in (0, 1]"),
    (dict(weight=0.5, group=THIS_RANK), "weight=0.5 says the gradient has copies on other ranks"),
]


@pytest.mark.parametrize("kw, message", BAD)
def test_bad_input_names_the_value_and_the_rule(kw, message):
    g = torch.ones(3)
    with pytest.raises(ValueError) as info:
        clip_grad_norm_([(g, kw.get("weight", 1))], kw.get("max_norm", 1.0), kw.get("group"))
    assert message in str(info.value)
    assert torch.equal(g, torch.ones(3))  # nothing scaled
    with pytest.raises(ValueError, match="must be a .gradient, weight. pair"):
        clip_grad_norm_([g], 1.0)


def _bad_on_rank():
    with CommTracer() as tracer:
        try:
            clip_grad_norm_([(torch.ones(3), 0.0)], 1.0)
        except ValueError as e:
            return str(e), len(tracer.records)
    return None, len(tracer.records)


def test_bad_input_raises_before_any_collective():
    """On real ranks every rank raises before the all-reduce: none waits, none is traced."""
    for message, n_collectives in run_on_ranks(_bad_on_rank, world_size=2, timeout_s=60):
        assert message is not None and "weight=0.0 must be in (0, 1]" in message
        assert n_collectives == 0
