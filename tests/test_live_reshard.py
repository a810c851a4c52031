"""Live resharding (course_lib.checkpoint.live): trainer ranks' state moved to generator ranks by
point-to-point, bit for bit equal to slicing the full tensors, for ZeRO-3 flat shards -> tensor
parallel, per-parameter dim-0 rows -> tensor parallel, tensor parallel -> both, and uneven shapes; traffic equal to the plan's bytes; the
plan's bytes (and its destination-only formula, wanted_bytes) equal to an element count made independently;
bad input refused in the parent."""

import sys

import cloudpickle
import pytest
import torch

from course_lib.checkpoint.live import (
    Holdings,
    dim0_placements,
    flat_holdings,
    gpt_tp_placements,
    gpt_zero3_units,
    live_rank,
    plan_transfer,
    run_live_reshard,
    split_holdings,
)
from course_lib.model import GPT, GPTConfig
from course_lib.observe.nccl_rules import under_rules
from course_lib.parallel.placement import Placement
from course_lib.parallel.tp.layers import contiguous_table
from course_lib.parallel.zero.flat import shard_bounds
from course_lib.runtime import run_on_ranks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file

CONFIG = GPTConfig(vocab_size=97, block_size=8, n_layer=1, n_head=2, d_model=8)  # V=97: padded rows at tp=2


def gpt():
    return GPT(CONFIG, seed=0)


def full_state():
    return {n: p.detach().clone() for n, p in gpt().named_parameters()}


def shapes_of(state):
    return {n: tuple(t.shape) for n, t in state.items()}


UNEVEN = {"a": torch.arange(15.0).view(5, 3) + 0.5, "b": -torch.arange(8.0) - 0.25,
          "c": torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))}  # 83 elements: 1 padding at 2


def uneven_placements(n):
    rows = -(-5 // n) * n  # a: 5 rows over n ranks, padded like the vocabulary
    return {"a": Placement.split("tp", 0, contiguous_table(rows, n), 0, 5),
            "b": Placement.replicated("tp", 0, n),
            "c": Placement.split("tp", 1, contiguous_table(4, n), 0, 4) if 4 % n == 0 else Placement.replicated("tp", 0, n)}


# -- what each side should hold, computed without the plan --------------------------------------

def flat_shards(state, units, world):
    """Rank r's buffers of flat_holdings: each unit's tensors end to end, zero padded, its shard."""
    out = [[] for _ in range(world)]
    for names in units:
        flat = torch.cat([state[n].reshape(-1) for n in names])
        for r in range(world):
            a, b = shard_bounds(flat.numel(), world, r)
            out[r].append(torch.cat([flat, flat.new_zeros(b - flat.numel())])[a:b] if b > flat.numel() else flat[a:b])
    return out


def split_pieces(state, placements, world):
    return [[placements[n].local(state[n], r).clone() for n in state] for r in range(world)]


def element_owners(layout: Holdings, shape_of, name):
    """{rank: bool mask of the elements of `name` the rank's layout holds}, by painting its boxes."""
    masks = {}
    for r, held in enumerate(layout.held):
        m = torch.zeros(shape_of[name], dtype=torch.bool)
        for h in held:
            if h.name == name:
                m[h.box.slices()] = True
        masks[r] = m
    return masks


def counted_bytes(state, src_flat_units, src_world, dst_placements, dst_world):
    """bytes(s, d) = 4 * #{elements of a flat-shard source s that tp destination d holds}: the flat
    source by flat index against shard_bounds, the destination by Placement.local of an index tensor."""
    out = {}
    for names in src_flat_units:
        offset = 0
        total = sum(state[n].numel() for n in names)
        for n in names:
            idx = torch.arange(state[n].numel()).view(state[n].shape) + offset
            for d in range(dst_world):
                p = dst_placements[n]
                got = p.local(idx + 1, d).reshape(-1)  # +1: padding rows are 0, never an element
                got = got[got > 0] - 1
                for s in range(src_world):
                    a, b = shard_bounds(total, src_world, s)
                    k = int(((got >= a) & (got < b)).sum())
                    if k:
                        out[(s, d)] = out.get((s, d), 0) + 4 * k
            offset += state[n].numel()
    return out


# -- the plan alone ------------------------------------------------------------------------------

@pytest.mark.parametrize("a,b", [(2, 2), (1, 2), (2, 1), (3, 2)])
def test_plan_bytes_equal_the_element_count_and_cover_once(a, b):
    state = full_state()
    shapes, units = shapes_of(state), gpt_zero3_units(gpt())
    placements = gpt_tp_placements(gpt(), b)
    plan = plan_transfer(flat_holdings(shapes, a, units), split_holdings(shapes, placements))
    counted = counted_bytes(state, units, a, placements, b)
    assert plan.pair_bytes() == counted
    assert plan.wanted_bytes() == sum(counted.values())  # the destination-only formula: each element once
    for d in range(b):  # every wanted element of generator d written exactly once
        for n in shapes:
            want = element_owners(plan.dst, shapes, n)[d]
            hits = torch.zeros(shapes[n], dtype=torch.int32)
            for (s, dd), moves in plan.moves.items():
                for m in moves:
                    if dd == d and m.dst.name == n:
                        hits[m.box.slices()] += 1
            assert torch.equal(hits, want.to(torch.int32)), (n, d)


def test_replicated_source_boxes_are_sent_once_spread_over_holders():
    shapes = shapes_of(UNEVEN)
    plan = plan_transfer(split_holdings(shapes, uneven_placements(2)), split_holdings(shapes, uneven_placements(2)))
    senders = {(d, m.dst.name): s for (s, d), moves in plan.moves.items() for m in moves if m.dst.name == "b"}
    assert senders == {(0, "b"): 0, (1, "b"): 1}  # b replicated on both trainers: holders[d mod 2]


def test_bad_input_refused_before_any_rank_starts():
    state = full_state()
    shapes = shapes_of(state)
    plan = plan_transfer(flat_holdings(shapes, 2), split_holdings(shapes, gpt_tp_placements(gpt(), 2)))
    with pytest.raises(ValueError, match=r"world_size=3: .*A=2 trainer ranks then B=2 generator ranks .*A \+ B = 4"):
        run_live_reshard(plan, _zero3_source, world_size=3)
    dst = split_holdings(shapes, gpt_tp_placements(gpt(), 2))
    holes = Holdings(dst.kind, dst.shapes, tuple(tuple(h for h in held if h.name != "pos_emb.weight") for held in dst.held),
                   dst.buffers)
    with pytest.raises(ValueError, match=r"covers 0 of the 64 elements of 'pos_emb.weight': every parameter must be wanted"):
        plan_transfer(flat_holdings(shapes, 2), holes)
    src = flat_holdings(shapes, 2)
    gap = Holdings(src.kind, src.shapes, (src.held[0], tuple(h for h in src.held[1] if h.name != "ln_f.bias")),
                 src.buffers)  # ln_f.bias (all on trainer 1) held by no one
    with pytest.raises(ValueError, match=r"'ln_f.bias' box .* on generator rank 0: elements covered 0..0 times, "
                                         r"must be exactly once"):
        plan_transfer(gap, dst)
    with pytest.raises(ValueError, match=r"destination tensor 'b' is not in the source layout"):
        plan_transfer(flat_holdings({"a": (5, 3)}, 2), split_holdings(shapes_of(UNEVEN), uneven_placements(2)))
    with pytest.raises(ValueError, match=r"'a': source shape \(3, 5\) != destination shape \(5, 3\)"):
        plan_transfer(flat_holdings({"a": (3, 5)}, 1), split_holdings({"a": (5, 3)}, {"a": uneven_placements(2)["a"]}))


# -- on ranks ------------------------------------------------------------------------------------

def _zero3_source(rank, group):
    """A real ZeRO-3 model on the trainer group: its flat master shards, after checking that its
    units are the ones the parent planned with."""
    from course_lib.parallel.zero.apply import apply_zero
    model = gpt()
    units = gpt_zero3_units(model)
    _, opt = apply_zero(model, 3, torch.optim.AdamW, group, lr=1e-3)
    assert [u.names for u in opt.fsdp.units] == units
    return [s.master.detach() for s in opt.shards]


def _tp_check(rank, group, buffers):
    """The generator's buffers against a real tensor-parallel model built on the generator group."""
    from course_lib.parallel.tp.apply import apply_tensor_parallel, tp_placements
    model = apply_tensor_parallel(gpt(), group)
    placed, mine = tp_placements(model), gpt_tp_placements(gpt(), dist_size(group))
    params = dict(model.named_parameters())
    return all(placed[n].table == mine[n].table and placed[n].kind == mine[n].kind
               and torch.equal(params[n].detach(), t) for n, t in zip(params, buffers))


def dist_size(group):
    import torch.distributed as dist
    return dist.get_world_size(group)


def _per_param_source(rank, group):
    """A real per-parameter stage 3 model on the trainer group: its dim-0 row blocks (zero padded),
    after checking that its placement records are the ones the parent planned with."""
    from course_lib.parallel.zero.apply import apply_zero
    model, _ = apply_zero(gpt(), 3, torch.optim.AdamW, group, lr=1e-3, sharding="per_param")
    planned = dim0_placements(shapes_of(full_state()), dist_size(group))
    for _, e in model.per_param.entries():
        assert (e.placement.table, e.placement.full) == (planned[e.name].table, planned[e.name].full), e.name
    params = dict(model.named_parameters())
    return [params[n].detach() for n in full_state()]


def _tp_source(rank, group):
    from course_lib.parallel.tp.apply import apply_tensor_parallel
    params = dict(apply_tensor_parallel(gpt(), group).named_parameters())
    return [params[n].detach() for n in full_state()]


def _uneven_flat_source(rank, group):
    return flat_shards(UNEVEN, [list(UNEVEN)], dist_size(group))[rank]


def _uneven_split_source(rank, group):
    return split_pieces(UNEVEN, uneven_placements(dist_size(group)), dist_size(group))[rank]


def _check_run(plan, results, expected):
    a = plan.src.world
    sent = {s: sum(v for (ss, _), v in plan.pair_bytes().items() if ss == s) for s in range(a)}
    recv = {d: sum(v for (_, dd), v in plan.pair_bytes().items() if dd == d) for d in range(plan.dst.world)}
    assert sum(sent.values()) == plan.wanted_bytes()
    for s in range(a):
        assert results[s]["traffic"] == {"bytes_sent": sent[s], "bytes_recv": 0}
    for d in range(plan.dst.world):
        r = results[a + d]
        assert r["traffic"] == {"bytes_sent": 0, "bytes_recv": recv[d]}
        assert r["calls"].get("irecv", 0) == sum(1 for (_, dd) in plan.moves if dd == d)
        assert len(r["buffers"]) == len(expected[d])
        for got, want in zip(r["buffers"], expected[d]):
            assert torch.equal(got, want)  # bit for bit: the same float32 values moved, never computed
        assert r.get("check", True) is True


@pytest.mark.parametrize("a,b", [(2, 2), (1, 2)])
def test_zero3_flat_to_tensor_parallel_gpt(a, b):
    state, shapes = full_state(), shapes_of(full_state())
    placements = gpt_tp_placements(gpt(), b)
    plan = plan_transfer(flat_holdings(shapes, a, gpt_zero3_units(gpt())), split_holdings(shapes, placements))
    results = run_live_reshard(plan, _zero3_source, a + b, consume_fn=_tp_check, timeout_s=120)
    _check_run(plan, results, split_pieces(state, placements, b))


@pytest.mark.parametrize("a,b", [(2, 1), (2, 2)])
def test_tensor_parallel_to_flat_gpt(a, b):
    state, shapes = full_state(), shapes_of(full_state())
    units = gpt_zero3_units(gpt())
    plan = plan_transfer(split_holdings(shapes, gpt_tp_placements(gpt(), a)), flat_holdings(shapes, b, units))
    results = run_live_reshard(plan, _tp_source, a + b, timeout_s=120)
    _check_run(plan, results, flat_shards(state, units, b))


@pytest.mark.parametrize("a,b", [(2, 2), (3, 1)])
def test_per_parameter_rows_to_tensor_parallel_gpt(a, b):
    """dp (per-parameter dim-0 rows, padded: 97 vocabulary rows over 2 or 3 ranks) -> tp."""
    state, shapes = full_state(), shapes_of(full_state())
    placements = gpt_tp_placements(gpt(), b)
    plan = plan_transfer(split_holdings(shapes, dim0_placements(shapes, a), "dp"), split_holdings(shapes, placements))
    results = run_live_reshard(plan, _per_param_source, a + b, consume_fn=_tp_check, timeout_s=120)
    _check_run(plan, results, split_pieces(state, placements, b))


def test_tensor_parallel_to_per_parameter_rows_gpt():
    state, shapes = full_state(), shapes_of(full_state())
    placements = dim0_placements(shapes, 2)
    plan = plan_transfer(split_holdings(shapes, gpt_tp_placements(gpt(), 1)), split_holdings(shapes, placements, "dp"))
    results = run_live_reshard(plan, _tp_source, 3, timeout_s=120)
    _check_run(plan, results, split_pieces(state, placements, 2))


@pytest.mark.parametrize("a,b,direction", [(2, 2, "flat->split"), (1, 2, "flat->split"), (2, 1, "split->flat"),
                                           (2, 2, "split->split")])
def test_uneven_shapes(a, b, direction):
    shapes = shapes_of(UNEVEN)
    src = flat_holdings(shapes, a) if direction.startswith("flat") else split_holdings(shapes, uneven_placements(a))
    dst = flat_holdings(shapes, b) if direction.endswith("flat") else split_holdings(shapes, uneven_placements(b))
    source = _uneven_flat_source if direction.startswith("flat") else _uneven_split_source
    expected = flat_shards(UNEVEN, [list(UNEVEN)], b) if direction.endswith("flat") else \
        split_pieces(UNEVEN, uneven_placements(b), b)
    results = run_live_reshard(plan := plan_transfer(src, dst), source, a + b, timeout_s=120)
    _check_run(plan, results, expected)


def test_under_nccl_rules():
    """One batch_isend_irecv per rank, one buffer per pair: NCCL's matching and rendezvous hold."""
    shapes = shapes_of(UNEVEN)
    plan = plan_transfer(flat_holdings(shapes, 2), split_holdings(shapes, uneven_placements(2)))
    results = run_on_ranks(under_rules(live_rank), plan, _uneven_flat_source, None, world_size=4, timeout_s=120)
    _check_run(plan, results, split_pieces(UNEVEN, uneven_placements(2), 2))
