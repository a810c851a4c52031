"""Sharding as a type (appendix A1, course_lib.sharding): the course's layouts run three ways.

Per layout (dp, tp, sp, fsdp, dp x tp) one MLP step runs as the course's hand-written strategy
and as DTensor placements on 4 gloo ranks, and as jax.jit with NamedShardings in a separate
process on 8 emulated CPU devices. Checked: the collective kinds and bytes of each equal the
formula (course_lib.sharding.layouts.formula), the step's numbers equal the single process,
the HLO reader on hand-written lines, and the layouts' bad input. And that the compiler's plan
for the sp layout depends on the shapes (another plan at b=8, s=12, d=20, f=40), while pinning
the hidden activation h gives the formula's plan at both sizes.
"""

from __future__ import annotations

import pytest

from course_lib.sharding import HIDDEN, LAYOUTS, Shapes, check_layout, formula, hlo, mapping_table, totals
from course_lib.sharding.run import (RTOL, collective_table, make_data, max_rel_error, numbers_table, programs, run_jax,
                                     run_torch)
from course_lib.sharding.torch_side import reference_step

NAMES = tuple(LAYOUTS)


@pytest.fixture(scope="module")
def runs():
    data = make_data()
    jax_answer = run_jax(data)
    torch_answer = run_torch(data, timeout_s=180)
    return data, jax_answer, torch_answer, numbers_table(torch_answer, jax_answer, data)


@pytest.mark.parametrize("name", NAMES)
def test_collectives_of_every_framework_equal_the_formula(runs, name):
    _, jax_answer, torch_answer, _ = runs
    rows = collective_table(name, torch_answer, jax_answer)
    # the course's sequence-parallel layer gathers x again in backward (gathered_linear's memory trick)
    assert rows["course"] == totals(formula(name), regather=name == "sp")
    assert rows["DTensor"] == totals(formula(name))
    # XLA's CPU pipeline writes a reduce-scatter as an all-reduce of the same tensor plus a slice
    assert rows["JAX jit"] == totals(formula(name), rs_as_all_reduce=True)
    for rank in range(4):  # every rank sends the same, not only the first
        assert totals(torch_answer[name]["course"][rank]["collectives"]) == rows["course"]
        assert totals(torch_answer[name]["dtensor"][rank]["collectives"]) == rows["DTensor"]


def test_the_formula_counts_what_the_papers_say():
    s = Shapes()
    M, P = s.b * s.s * s.d * s.e, s.f * s.d * s.e
    assert totals(formula("tp")) == {("all_reduce", 4): 2 * M}  # Megatron's f and g
    sp = totals(formula("sp"))  # the same bytes as tp's all-reduces, as an all-gather + reduce-scatter pair each
    assert sp[("all_gather", 4)] + sp[("reduce_scatter", 4)] == 2 * M * 2
    fsdp = totals(formula("fsdp"), regather=True)  # ZeRO-3: 2 all-gathers + 1 reduce-scatter of every weight
    assert fsdp[("all_gather", 4)] == 2 * 2 * P and fsdp[("reduce_scatter", 4)] == 2 * P
    assert totals(formula("dp_tp")) == {("all_reduce", 2): 2 * M // 2 + 2 * P // 2 + s.e}


@pytest.mark.parametrize("name", NAMES)
def test_one_step_equals_the_single_process(runs, name):
    *_, numbers = runs
    row = numbers[name]
    assert set(row) >= {"course", "DTensor", "JAX", "reference"}
    for who, result in row.items():
        # fp32, the same arithmetic in another order (parallel sums, XLA's and ATen's kernels)
        assert max_rel_error(result, row["reference"]) <= RTOL, (name, who)


def test_a_wrong_step_fails_the_comparison(runs):
    *_, numbers = runs
    wrong = dict(numbers["tp"]["course"])
    wrong["g_x"] = wrong["g_x"] * 0.5  # f left out on half the contributions, say
    assert max_rel_error(wrong, numbers["tp"]["reference"]) > RTOL


def test_compiler_plan_without_and_with_an_annotation(runs):
    _, jax_answer, _, numbers = runs
    programs = jax_answer["programs"]
    plain = totals(programs["fsdp_unannotated"]["collectives"])
    assert ("all_to_all", 4) in plain and sum(plain.values()) > sum(totals(programs["fsdp"]["collectives"]).values())
    for name in ("fsdp", "fsdp_h"):  # either annotation gives FSDP's plan
        assert totals(programs[name]["collectives"]) == totals(formula("fsdp"), rs_as_all_reduce=True)
    for name in ("fsdp_unannotated", "fsdp_h"):  # the plan changes, the step does not
        assert max_rel_error(programs[name]["out"], numbers["fsdp"]["reference"]) <= RTOL


def test_shard_map_is_the_course_layers(runs):
    _, jax_answer, torch_answer, numbers = runs
    rows = collective_table("tp", torch_answer, jax_answer)
    assert rows["JAX shard_map"] == rows["course"] == totals(formula("tp"))
    assert max_rel_error(numbers["tp"]["JAX shard_map"], numbers["tp"]["reference"]) <= RTOL
    assert jax_answer["devices"] == 8


def test_hlo_reader():
    text = "\n".join([
        "  %all-reduce.3 = (f32[], f32[64,16]{1,0}) all-reduce(%a, %b), channel_id=1, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, to_apply=%add",
        "  %all-gather = f32[4,8,16]{2,0,1} all-gather(%x), replica_groups={{0,1},{2,3}}, dimensions={1}",
        "  %rs = bf16[4,2,16]{2,0,1} reduce-scatter(%y), replica_groups=[2,4]<=[8], dimensions={1}",
        "  %a2a = (f32[1,8], f32[1,8]) all-to-all(%p, %q), replica_groups={{0,1}}",
        "  %add = f32[4] add(%u, %v)",
    ])
    assert hlo.collectives(text) == [("all_reduce", 4, 4), ("all_reduce", 64 * 16 * 4, 4),
                                     ("all_gather", 4 * 8 * 16 * 4, 2), ("reduce_scatter", 4 * 2 * 16 * 2 * 4, 4),
                                     ("all_to_all", 2 * 8 * 4, 2)]
    assert hlo.calls(text) == {"all_gather": 1, "all_reduce": 1, "all_to_all": 1, "reduce_scatter": 1}
    with pytest.raises(ValueError, match="replica_groups"):
        hlo.group_size("%x = f32[2] all-reduce(%y)")


def test_layout_table_and_bad_input():
    for who, tensor, placements, spec in mapping_table():
        assert placements.startswith("[") and who
    assert LAYOUTS["dp_tp"].placements("fc") == (("Replicate",), ("Shard", 0))
    assert LAYOUTS["sp"].placements("x") == (("Shard", 1),)
    with pytest.raises(ValueError, match="layout='pp' must be one of"):
        check_layout("pp")
    with pytest.raises(ValueError, match="x dim 1 = 6 must be divisible by tp = 4"):
        check_layout("sp", Shapes(s=6))


SECOND = Shapes(b=8, s=12, d=20, f=40)  # the sizes a new user tried: activations larger than a weight


def _bytes(shapes):
    """(M, P): one activation and one weight, bytes."""
    return shapes.b * shapes.s * shapes.d * shapes.e, shapes.f * shapes.d * shapes.e


@pytest.fixture(scope="module")
def second_size():
    data = make_data(SECOND)
    return data, run_jax(data, SECOND, names=("sp",))


def test_sp_plan_depends_on_the_shapes_and_pinning_h_restores_it(runs, second_size):
    _, first, _, _ = runs
    data2, second = second_size
    assert set(second["programs"]) == {"sp", "sp_h"}  # only the layout asked for, and its pinned variant
    for shapes, answer in ((Shapes(), first), (SECOND, second)):
        m, p = _bytes(shapes)
        want = totals(formula("sp", shapes), rs_as_all_reduce=True)  # XLA's CPU pipeline: RS as all-reduce
        plain, pinned = (totals(answer["programs"][k]["collectives"]) for k in ("sp", "sp_h"))
        assert pinned == want, shapes  # h pinned as Megatron holds it: the formula at any size
        # Shardy keeps the split that comes from the larger tensor: the weight's when P > M
        assert (plain == want) == (p > m), (shapes, plain, want)
    m2, p2 = _bytes(SECOND)
    assert m2 > p2
    plain2 = totals(second["programs"]["sp"]["collectives"])
    want2 = totals(formula("sp", SECOND), rs_as_all_reduce=True)
    assert ("all_to_all", 4) in plain2 and plain2[("all_gather", 4)] == want2[("all_gather", 4)] + p2
    assert any(line.startswith("all-gather") and f"f32[{SECOND.f},{SECOND.d}]" in line
               for line in hlo.describe(second["programs"]["sp"]["hlo"]))  # the extra gather is the whole fc
    reference = reference_step(data2, SECOND)
    for name in ("sp", "sp_h"):  # another plan, the same step (fp32 reordering, as above)
        assert max_rel_error(second["programs"][name]["out"], reference) <= RTOL


def test_programs_and_run_jax_bad_input():
    assert programs(("sp",)) == {"sp": ("sp", LAYOUTS["sp"].use), "sp_h": ("sp", {**LAYOUTS["sp"].use, "h": HIDDEN["sp"]})}
    every = programs()
    assert every["fsdp_unannotated"] == ("fsdp", {}) and every["fsdp_h"] == ("fsdp", {"h": HIDDEN["fsdp"]})
    assert set(every) == set(LAYOUTS) | {"fsdp_unannotated", "fsdp_h", "sp_h"}
    with pytest.raises(ValueError, match="data shapes"):  # raised before any process starts
        run_jax(make_data(), SECOND, names=("sp",))
    with pytest.raises(ValueError, match="x dim 1 = 6 must be divisible by tp = 4"):
        run_jax(make_data(Shapes(s=6)), Shapes(s=6), names=("sp",))
