"""JAX's explicit sharding mode beside the automatic and manual modes (appendix A1, section 7).

The dp x tp layout runs in one JAX process three ways: jax.jit with NamedShardings (automatic),
jax.shard_map (manual), and typed arrays on an AxisType.Explicit mesh (explicit). Checked: the
three compile to the formula's collectives, byte for byte; they compute the single process's step;
explicit mode's types (jax.typeof) are the layout's specs; the row-parallel matmul without
out_sharding is refused; y typed as split over tp instead costs exactly the reduce-scatter's
all-gather and the loss's reduction over tp; auto_axes gives the out_sharding program. Skipped,
with the JAX process's reason, on a jax without explicit mode.
"""

from __future__ import annotations

import pytest

from course_lib.sharding import LAYOUTS, Shapes, formula, totals
from course_lib.sharding.run import EXPLICIT_LAYOUT, RTOL, make_data, max_rel_error, modes_table, run_jax
from course_lib.sharding.torch_side import reference_step

S = Shapes()  # b=4, s=8, d=16, f=64
DP, TP = (size for _, size in LAYOUTS[EXPLICIT_LAYOUT].axes)
# what jax.typeof printed in jax 0.10.2 for each value of the typed step (y whole over tp)
TYPES = {"x": "float32[4@dp,8,16]", "fc": "float32[64@tp,16]", "proj": "float32[16,64@tp]",
         "h": "float32[4@dp,8,64@tp]", "y": "float32[4@dp,8,16]", "loss": "float32[]",
         "g_fc": "float32[64@tp,16]", "g_proj": "float32[16,64@tp]", "g_x": "float32[4@dp,8,16]"}


@pytest.fixture(scope="module")
def answer():
    data = make_data(S)
    got = run_jax(data, S, names=(EXPLICIT_LAYOUT,))
    if "unavailable" in got["explicit"]:
        pytest.skip(got["explicit"]["unavailable"])
    return data, got


def test_the_layout_is_the_2d_mesh_the_types_name():
    assert EXPLICIT_LAYOUT == "dp_tp" and (DP, TP) == (2, 2)


def test_three_modes_send_the_formulas_collectives(answer):
    _, got = answer
    rows = modes_table(got)
    assert set(rows) == {"formula", "automatic (jit + shardings)", "manual (shard_map)", "explicit (sharding in types)"}
    for mode, row in rows.items():  # exact: bytes by (op, group size)
        assert row == totals(formula(EXPLICIT_LAYOUT)), mode


def test_three_modes_compute_the_single_process_step(answer):
    data, got = answer
    reference = reference_step(data, S)
    outs = {"automatic": got["programs"][EXPLICIT_LAYOUT]["out"],
            "manual": got["programs"][f"{EXPLICIT_LAYOUT}_shard_map"]["out"],
            "explicit": got["explicit"]["programs"]["all_reduce"]["out"]}
    for mode, out in outs.items():
        # fp32, the same arithmetic in another order (parallel sums; XLA's and ATen's kernels)
        assert max_rel_error(out, reference) <= RTOL, mode
        assert max_rel_error(out, outs["automatic"]) <= RTOL, mode  # same reason
    wrong = dict(outs["explicit"], g_fc=outs["explicit"]["g_fc"] * (1 + 10 * RTOL))  # the check can fail
    assert max_rel_error(wrong, reference) > RTOL


def test_explicit_types_are_the_layouts_specs(answer):
    _, got = answer
    typed = got["explicit"]["programs"]["all_reduce"]["types"]
    assert typed == TYPES
    layout = LAYOUTS[EXPLICIT_LAYOUT]
    for tensor in ("x", "fc", "proj"):  # the same strings, from the layout table
        spec, shape = layout.specs[tensor], S.shape(tensor)
        assert typed[tensor] == "float32[" + ",".join(str(n) if a is None else f"{n}@{a}" for n, a in zip(shape, spec)) + "]"


def test_the_row_parallel_matmul_without_out_sharding_is_refused(answer):
    _, got = answer
    refused = got["explicit"]["refused"]
    assert refused["error"] == "ShardingTypeError"
    assert "ambiguous" in refused["message"] and "out_sharding" in refused["message"]
    assert "refused" not in got["explicit"]["programs"]


def test_y_split_over_tp_is_a_reduce_scatter(answer):
    data, got = answer
    programs = got["explicit"]["programs"]
    whole, split = (totals(programs[k]["collectives"]) for k in ("all_reduce", "reduce_scatter"))
    assert programs["reduce_scatter"]["types"] == {**TYPES, "y": "float32[4@dp,8@tp,16]"}
    m_local = S.b * S.s * S.d * S.e // DP
    assert split[("all_gather", TP)] == m_local  # dL/dy gathered in backward
    # XLA's CPU pipeline writes the forward reduce-scatter as an all-reduce (g's bytes); + the loss over tp
    assert split[("all_reduce", TP)] == whole[("all_reduce", TP)] + S.e
    assert set(split) == {("all_gather", TP), ("all_reduce", TP)}
    # fp32 reordering, as above
    assert max_rel_error(programs["reduce_scatter"]["out"], reference_step(data, S)) <= RTOL


def test_auto_axes_gives_the_out_sharding_program(answer):
    _, got = answer
    programs = got["explicit"]["programs"]
    assert programs["auto_axes"]["types"] == TYPES
    assert totals(programs["auto_axes"]["collectives"]) == totals(programs["all_reduce"]["collectives"])

