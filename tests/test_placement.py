"""The placement record (course_lib.parallel.placement): every axis says how it splits a tensor,
and the consumers read that record.

Without ranks: a split's pieces reassemble the tensor bit for bit (contiguous, the fused QKV's
heads, a padded vocabulary) at 2 and 3 ranks; a table that loses or repeats an index is refused;
a ZeRO flat unit's ranges cover each parameter once and are the unit's own shards; on a whole
mesh of placements (tp split, experts, the tied matrix on two stages, dp copies) the weights
1/copies of the ranks holding an element add up to exactly 1.

On gloo ranks: the tensor-parallel layers' placements describe exactly what each rank holds
(torch.equal at tp = 2 and 3), and a wrong table (the contiguous QKV split) is caught; the full
state dict rebuilt from the placements equals the single process's, bit for bit, for tp, for
tp x pp, for ZeRO-1 x tp and for experts over ep x pp; the clip weights count every element of
the single-process model once.
"""

import itertools
import sys
from fractions import Fraction

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.model import GPTConfig
from course_lib.parallel.hybrid import ParallelDims
from course_lib.parallel.placement import Placement, copies, embed, global_shape, weight
from course_lib.parallel.tp.apply import qkv_rows
from course_lib.parallel.tp.layers import contiguous_table, padded_size
from course_lib.parallel.zero.flat import FlatUnit

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file

T = 12
VOCAB = CharDataset("train", T).vocab_size  # 97: padded to 98 at tp = 2, to 99 at tp = 3
CONFIG3 = GPTConfig.tiny(VOCAB, block_size=T, n_layer=2, d_model=24, n_head=3)  # 3 heads, d_ff 96: tp = 3
CONFIG2 = GPTConfig.tiny(VOCAB, block_size=T, n_layer=2, d_model=32, n_head=2)
MOE = GPTConfig.tiny(VOCAB, block_size=T, n_layer=2, d_model=32, n_head=2, n_experts=4, top_k=2,
                     aux_loss_coef=0.0, z_loss_coef=0.0, capacity_factor=None)  # what pp with experts needs


def tables(n):
    """(name, dim, table, full, full tensor shape) of the splits the course uses, at n ranks."""
    d = 6 * n
    return [("contiguous", 0, contiguous_table(4 * n, n), 4 * n, (4 * n, 5)),
            ("row-parallel columns", 1, contiguous_table(2 * n, n), 2 * n, (3, 2 * n)),
            ("qkv heads", 0, qkv_rows(d, n), 3 * d, (3 * d, 4)),
            ("padded vocabulary", 0, contiguous_table(padded_size(97, n), n), 97, (97, 3))]


@pytest.mark.parametrize("n", [2, 3])
def test_split_pieces_reassemble_the_tensor_exactly(n):
    for name, dim, table, full, shape in tables(n):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(n))
        places = [Placement.split("tp", dim, table, r, full) for r in range(n)]
        pieces = [p.local(w) for p in places]
        assert all(p.shape[dim] == table.shape[1] for p in pieces), name
        rebuilt = torch.zeros_like(w)
        for p, piece in zip(places, pieces):
            assert p.global_shape(piece.shape) == tuple(shape) and copies((p,)) == 1
            p.scatter(piece, rebuilt)
        assert torch.equal(rebuilt, w), name
        assert torch.equal(sum(embed(piece, (p,), shape) for p, piece in zip(places, pieces)), w), name
        pad = [i for i, g in enumerate(table[-1].tolist()) if g >= full]  # padded vocabulary: the last rank's
        assert torch.equal(pieces[-1][pad], torch.zeros_like(pieces[-1][pad])), name  # extra rows are zeros


def test_a_wrong_table_is_refused():
    good = contiguous_table(8, 2)
    with pytest.raises(ValueError, match=r"every index 0\.\.7 of dim 0 exactly once"):
        Placement.split("tp", 0, [[0, 1, 2, 3], [3, 4, 5, 6]], 0, 8)  # 3 twice, 7 missing
    with pytest.raises(ValueError, match="one index list per rank"):
        Placement.split("tp", 0, [[0, 1, 2], [3, 4, 5, 6, 7]], 0, 8)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, n=2\)"):
        Placement.split("tp", 0, good, 2, 8)
    with pytest.raises(ValueError, match=r"holders=\(0, 2\) must be distinct ranks in \[0, 2\)"):
        Placement.whole("pp", (0, 2), 0, 2)
    with pytest.raises(ValueError, match="kind='rows' must be one of"):
        Placement("tp", "rows", 0, 2)
    # a table that is a valid split but not the layer's (the contiguous qkv mistake) gives other rows
    w = torch.arange(36.0).view(12, 3)
    right, wrong = Placement.split("tp", 0, qkv_rows(4, 2), 0, 12), Placement.split("tp", 0, contiguous_table(12, 2), 0, 12)
    assert not torch.equal(right.local(w), wrong.local(w))


@pytest.mark.parametrize("numels,n", [([10, 3, 7], 4), ([5], 3), ([1, 1, 30], 2), ([2, 2], 5)])
def test_flat_unit_ranges_are_the_units_shards(numels, n):
    params = [torch.randn(k) for k in numels]
    units = [FlatUnit(params, n, r) for r in range(n)]
    flat = units[0].flatten(params)
    for i, (p, off, k) in enumerate(zip(params, units[0].offsets, units[0].numels)):
        seen = torch.zeros(k, dtype=torch.long)
        for r, u in enumerate(units):
            pl = Placement.of_flat_unit("dp", off, k, u.shard_numel, r, n)
            a, b = pl.ranges[r]
            seen[a:b] += 1
            assert torch.equal(pl.local(p), flat[off + a:off + b])  # inside rank r's shard [r*S, (r+1)*S)
            assert (a == b or u.start <= off + a and off + b <= u.stop) and copies((pl,)) == 1
        assert torch.equal(seen, torch.ones(k, dtype=torch.long)), f"param {i}: each element once"


def test_weights_count_every_element_once_on_a_whole_mesh():
    """A 2-dim matrix split over tp (dim 0), plus an expert owned by one ep rank, plus the tied
    matrix on pp ranks 0 and 2 of 3, with dp copies: over every rank of the mesh, the weights of
    the ranks holding an element add up to 1 (exact fractions)."""
    tp, ep, pp, dp = 3, 2, 3, 2
    shape, table = (6, 4), contiguous_table(6, tp)
    cases = {"replicated": lambda c: [Placement.replicated("ep", c["ep"], ep), Placement.replicated("pp", c["pp"], pp)],
             "expert 1 on stage 1": lambda c: [Placement.whole("ep", (1,), c["ep"], ep), Placement.whole("pp", (1,), c["pp"], pp)],
             "tied": lambda c: [Placement.replicated("ep", c["ep"], ep), Placement.whole("pp", (0, pp - 1), c["pp"], pp)]}
    for case, more in cases.items():
        counts = {}
        for t, e, s, d in itertools.product(range(tp), range(ep), range(pp), range(dp)):
            c = {"tp": t, "ep": e, "pp": s, "dp": d}
            placed = [Placement.split("tp", 0, table, t, 6), *more(c), Placement.replicated("dp", d, dp)]
            if not all(p.rank in p.holders for p in placed if p.kind == "whole"):
                continue  # this rank does not hold the tensor
            for row in table[t].tolist():
                for col in range(shape[1]):
                    counts[(row, col)] = counts.get((row, col), Fraction(0)) + Fraction(1, copies(placed))
        assert set(counts.values()) == {Fraction(1)}, case
        assert len(counts) == shape[0] * shape[1], case


def test_global_shape_and_weight():
    split = Placement.split("tp", 1, contiguous_table(6, 3), 1, 5)  # the last column is padding
    assert global_shape((split, Placement.replicated("dp", 0, 4)), (7, 2)) == (7, 5)
    assert weight((split, Placement.replicated("dp", 0, 4), Placement.whole("pp", (0, 1), 1, 2))) == 1 / 8
    with pytest.raises(ValueError, match="a flat range has no shape"):
        global_shape((Placement.flat("dp", [(0, 3), (3, 6)], 0),), (3,))


# ---------------------------------------------------------------- on ranks

def tp_on_rank(config, wrong_qkv=False):
    """Every parameter's tp placement, applied to the single-process tensor, is exactly this rank's
    tensor; the state dict gathered from the placements is the single process's."""
    from course_lib.model import GPT
    from course_lib.parallel.tp import apply_tensor_parallel, gather_full_state_dict
    from course_lib.parallel.tp.apply import tp_placements

    single = dict(GPT(config, seed=0).named_parameters())
    model = apply_tensor_parallel(GPT(config, seed=0), None)
    placed = tp_placements(model)
    if wrong_qkv:  # the contiguous split of the fused qkv rows: a valid table, but not what the layer holds
        tp, rank = dist.get_world_size(), dist.get_rank()
        qkv = single["blocks.0.attn.qkv.weight"]
        placed["blocks.0.attn.qkv.weight"] = Placement.split("tp", 0, contiguous_table(qkv.shape[0], tp), rank,
                                                            qkv.shape[0])
    exact = {n: torch.equal(placed[n].local(single[n].detach()), p.detach()) for n, p in model.named_parameters()}
    kinds = {n: placed[n].kind for n in placed}
    full = gather_full_state_dict(model)
    state = GPT(config, seed=0).state_dict()
    gathered = sorted(full) == sorted(state) and all(torch.equal(full[k], state[k]) for k in state)
    return exact, kinds, gathered


@pytest.mark.parametrize("config,tp", [(CONFIG2, 2), (CONFIG3, 3)])
def test_tp_placements_describe_each_rank_exactly(config, tp):
    results = run_on_ranks(tp_on_rank, config, world_size=tp, timeout_s=120)
    for rank, (exact, kinds, gathered) in enumerate(results):
        assert all(exact.values()), f"rank {rank}: {[n for n, ok in exact.items() if not ok]}"
        assert gathered, f"rank {rank}: the gathered state dict differs from the single process's"
        assert kinds["tok_emb.weight"] == kinds["blocks.0.attn.qkv.weight"] == kinds["blocks.1.mlp.proj.weight"] == "split"
        assert kinds["blocks.0.ln1.weight"] == kinds["blocks.0.mlp.proj.bias"] == "whole"


def test_a_wrong_tp_placement_is_caught():
    results = run_on_ranks(tp_on_rank, CONFIG2, True, world_size=2, timeout_s=120)
    assert not results[0][0]["blocks.0.attn.qkv.weight"]  # rank 0 holds Q and K of head 0, not Q of both
    assert all(ok for n, ok in results[0][0].items() if n != "blocks.0.attn.qkv.weight")


def hybrid_on_rank(dims, config):
    """(the full state dict equals the single process's, sum over this rank's pieces of w * elements)."""
    from course_lib.model import GPT
    from course_lib.parallel.hybrid import build_hybrid, make_hybrid_optimizer
    from course_lib.parallel.hybrid.compose import count_weights, full_state_dict, placements, trained_parameters
    from course_lib.train import TrainConfig

    parts = build_hybrid(dims, config, seed=0)
    make_hybrid_optimizer(parts, TrainConfig(steps=1, batch_size=4, progress=False))
    full = full_state_dict(parts)
    state = GPT(config, seed=0).state_dict()
    equal = sorted(full) == sorted(state) and all(torch.equal(full[k], state[k]) for k in state)
    weights, placed = count_weights(parts), placements(parts, state=True)
    counted = Fraction(0)
    for name, p in trained_parameters(parts):
        dp = placed[name][-1]
        held = Fraction(p.numel() if dp.kind == "whole" else dp.ranges[dp.rank][1] - dp.ranges[dp.rank][0])
        for split in (pl for pl in placed[name] if pl.kind == "split"):  # padded vocabulary rows: not the model's
            held *= Fraction(sum(i < split.full for i in split.rows), len(split.rows))
        assert weights[id(p)] == weight(placed[name])
        counted += held / copies(placed[name])
    return equal, counted, sum(p.numel() for p in GPT(config, seed=0).parameters())


LAYOUTS = [(ParallelDims(tp=2, pp=2, microbatches=2), CONFIG2),
           (ParallelDims(dp=2, tp=2, zero=1), CONFIG2),
           (ParallelDims(ep=2, pp=2, microbatches=2), MOE)]


@pytest.mark.parametrize("dims,config", LAYOUTS, ids=[d.describe() for d, _ in LAYOUTS])
def test_every_axis_placement_rebuilds_the_model_and_counts_each_element_once(dims, config):
    dims.check(dims.world_size, config, 4, T)
    results = run_on_ranks(hybrid_on_rank, dims, config, world_size=dims.world_size, timeout_s=180)
    assert all(equal for equal, _, _ in results), "the gathered state dict differs from the single process's"
    total = results[0][2]
    assert sum(counted for _, counted, _ in results) == total  # every element of the single process once
