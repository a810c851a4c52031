"""Context parallelism as a mesh dimension of the hybrid run (course_lib.parallel.hybrid): dp x cp,
cp x tp and cp x pp, each on 4 gloo ranks, equal to the single process over 3 AdamW steps with the
global-norm clip active; without the gradient average over cp the same comparison fails; the
pipeline's messages shrink by cp; bf16 autocast stays close to the bf16 single process; the
capstone saves at a cp layout and resumes without it; bad layouts are refused in the parent,
before any rank starts."""

import pathlib
from dataclasses import replace

import pytest
import torch

from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.hybrid import ParallelDims, merged_params, run_hybrid, train_single
from course_lib.parallel.hybrid.training import traffic_by_dimension
from course_lib.parallel.mesh import mesh_groups
from course_lib.runtime import run_on_ranks
from course_lib.train import TrainConfig

from _tolerances import ADAMW_GRAD_REL_NORM, FP32_SUM_RTOL, adamw_loss_atol, assert_adamw_params_close

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = 24  # not a power of two: 2cp = 4 zig-zag chunks of 6 tokens, or 2 contiguous shards of 12


@pytest.fixture(scope="module")
def dense():
    # 4 heads: tp = 2 leaves 2 per rank, which Ulysses over cp = 2 re-shards to 1 each
    return GPTConfig(vocab_size=CharDataset("train", SEQ).vocab_size, block_size=SEQ, n_layer=2, n_head=4,
                     d_model=16)


# The same run as tests/test_hybrid.py: a small clip threshold, so every step clips.
TRAIN = TrainConfig(steps=3, batch_size=8, lr=1e-2, grad_clip=0.05, progress=False)


@pytest.fixture(scope="module")
def single(dense):
    return train_single(dense, TRAIN)


def _assert_equal_to_single(results, reference):
    """tests/test_hybrid.py's comparison and tolerances: the cp ranks sum the loss and the
    gradients in another order than one process (each rank its T/cp tokens, then the mean over
    dp·cp), and AdamW (lr = 1e-2) magnifies that rounding near g = 0 (tests/_tolerances): losses
    within adamw_loss_atol; the global gradient norm of step 1 to fp32 sums, of later steps to
    ADAMW_GRAD_REL_NORM; parameters bounded by AdamW's step and in RMS against lr/100. A missing
    reduction over cp, a wrong shard or a wrong clip weight is off by far more."""
    for r in results:  # the global loss, the same on every rank
        assert r.train_losses == pytest.approx(reference.train_losses, abs=adamw_loss_atol(TRAIN.lr))
        assert r.grad_norms[0] == pytest.approx(reference.grad_norms[0], rel=FP32_SUM_RTOL)
        assert r.grad_norms[1:] == pytest.approx(reference.grad_norms[1:], rel=ADAMW_GRAD_REL_NORM)
    assert min(reference.grad_norms) > TRAIN.grad_clip  # clipping happened at every step
    for r in results:  # every rank's parameters, cp ranks included, are the single process's
        names = sorted(r.named_params)
        got, want = (torch.cat([d[n].reshape(-1) for n in names]) for d in (r.named_params, reference.named_params))
        assert_adamw_params_close(got, want, TRAIN.lr, TRAIN.steps, TRAIN.betas, msg=f"rank coords {r.coords}")
    assert set(merged_params(results)) == set(reference.named_params)


CASES = [  # 4 ranks each; the three methods, load balancing on and off, both ZeRO settings
    ParallelDims(dp=2, cp=2, cp_method="ring", cp_load_balance=True, zero=1, recompute="full"),
    ParallelDims(tp=2, cp=2, cp_method="ulysses", cp_load_balance=False, sequence_parallel=True, zero=1),
    ParallelDims(pp=2, cp=2, cp_method="allgather", cp_load_balance=True, microbatches=2, zero=0),
]


_RUNS = {}  # dims -> results: the pipeline-bytes test reads the cp x pp run again


def _run(dims, config):
    if dims not in _RUNS:
        _RUNS[dims] = run_hybrid(dims, config, TRAIN, timeout_s=240, trace=True)
    return _RUNS[dims]


@pytest.mark.parametrize("dims", CASES, ids=[d.describe() for d in CASES])
def test_composed_context_parallel_run_equals_single_process(dense, single, dims):
    dims.check(4, dense, TRAIN.batch_size)
    reference = single if dims.recompute == "none" else train_single(dense, TRAIN, recompute=dims.recompute)
    results = _run(dims, dense)
    _assert_equal_to_single(results, reference)
    groups = mesh_groups(4, **dims.sizes())
    assert [r.coords["cp"] for r in results] == [next(g.index(rank) for g in groups["cp"] if rank in g)
                                                for rank in range(4)]
    for r in results:  # the attention's calls run on the cp group, the gradient average on dp·cp
        assert r.traffic["cp"]["calls"] > 0
        assert ("dp_cp" in r.traffic) == (dims.dp > 1)


def _placements_on_rank(config, layouts):
    """Rank code, per layout: (the full state dict rebuilt from every rank's placements equals the
    single process's, this rank's sum over its parameters of w(p) * the elements it holds)."""
    from fractions import Fraction

    from course_lib.model import GPT
    from course_lib.parallel.hybrid import build_hybrid, make_hybrid_optimizer
    from course_lib.parallel.hybrid.compose import count_weights, full_state_dict, placements, trained_parameters
    from course_lib.parallel.placement import copies, weight

    out = []
    for dims in layouts:
        parts = build_hybrid(dims, config, seed=0)
        make_hybrid_optimizer(parts, TRAIN)
        full, state = full_state_dict(parts), GPT(config, seed=0).state_dict()
        equal = sorted(full) == sorted(state) and all(torch.equal(full[k], state[k]) for k in state)
        weights, placed = count_weights(parts), placements(parts, state=True)
        assert all(pl[3].axis == "cp" for pl in placed.values())  # (tp, ep, pp, cp, dp)
        counted = Fraction(0)
        for name, p in trained_parameters(parts):
            dp = placed[name][-1]  # a flat range of the (tp-local) tensor at ZeRO-1, else whole
            held = Fraction(p.numel() if dp.kind == "whole" else dp.ranges[dp.rank][1] - dp.ranges[dp.rank][0])
            for split in (pl for pl in placed[name] if pl.kind == "split"):  # padded vocabulary rows
                held *= Fraction(sum(i < split.full for i in split.rows), len(split.rows))
            assert weights[id(p)] == weight(placed[name])
            counted += held / copies(placed[name])
        out.append((equal, counted))
    return out


def test_placements_rebuild_the_model_and_count_each_element_once(dense):
    """Every CASES layout: full_state_dict (placements with cp whole on every cp rank) gives the
    single process's state dict exactly, and the clip's weights (1 / copies; ZeRO-1's flat range
    over dp·cp on one rank) count every element of the model once over the 4 ranks."""
    results = run_on_ranks(_placements_on_rank, dense, CASES, world_size=4, timeout_s=240)
    total = sum(p.numel() for p in GPT(dense, seed=0).parameters())
    for i, dims in enumerate(CASES):
        assert all(r[i][0] for r in results), f"{dims.describe()}: the gathered state dict differs"
        assert sum(r[i][1] for r in results) == total, dims.describe()


def test_the_pipeline_sends_the_sequence_shard_cp_times_smaller(dense):
    """Stage 0 sends each micro-batch's activations (B/m rows x T tokens x d fp32) and stage 1
    the gradients back: B*T*d*4 bytes per rank and step. Under cp each stage holds T/cp tokens,
    so exactly B*T*d*4*(1 - 1/cp) fewer bytes per step; the rest (the tied matrix's gradient,
    the loss broadcast) is the same. Compared with the same pipeline without cp, in integers.
    (Alone on 2 ranks the pp group is the world, so there "pp" also counts the clip's all-reduce
    of one float64 per step, which the cp run counts under "world".)"""
    with_cp = CASES[2]
    plain = ParallelDims(pp=2, microbatches=with_cp.microbatches, zero=with_cp.zero)
    a = _run(with_cp, dense)
    b = run_hybrid(plain, dense, TRAIN, timeout_s=240, trace=True)
    saved = TRAIN.steps * TRAIN.batch_size * SEQ * dense.d_model * 4 * (with_cp.cp - 1) // with_cp.cp
    clip = TRAIN.steps * 8  # the plain run's world-group norm all-reduce, counted under "pp" there
    assert "world" in a[0].traffic and "world" not in b[0].traffic
    for r in a:
        pp_rank = r.coords["pp"]
        assert b[pp_rank].traffic["pp"]["bytes_sent"] - r.traffic["pp"]["bytes_sent"] == saved + clip


def test_bf16_autocast_cp_run_is_close_to_the_bf16_single_process(dense):
    """bf16 autocast around forward and backward, fp32 master weights, Ulysses over dp2 x cp2.
    Not bit-equal (the cp ranks' attention and the dp·cp mean sum bf16-rounded products in
    another order; bf16 keeps 8 significant bits); tests/test_hybrid.py's bf16 tolerance, 1e-2
    on the loss, holds with room (measured ~1e-4 here); fp32 of the same layout is ~1e-6."""
    dims = ParallelDims(dp=2, cp=2, cp_method="ulysses", zero=1, precision="bf16")
    results = run_hybrid(dims, dense, TRAIN, timeout_s=240)
    reference = train_single(dense, TRAIN, precision="bf16")
    assert results[0].train_losses == pytest.approx(reference.train_losses, abs=1e-2)  # bf16: see the docstring


def test_the_capstone_saves_at_a_cp_layout_and_resumes_without_it(tmp_path):
    """The capstone config's cp keys reach ParallelDims; its run (fp32, recomputation) saves after
    step 2 at pp2 x cp2 with ZeRO-1 over the cp ranks and resumes at dp2 on 2 ranks: the whole
    loss curve within the capstone's own fp32 tolerance of the single process."""
    from course_lib.capstone import config_from_dict, read_toml, run_capstone

    raw = read_toml(ROOT / "configs" / "capstone_tiny.toml")
    raw["train"]["precision"] = "fp32"
    raw["layout"].update(dp=1, tp=1, pp=2, cp=2, cp_method="allgather", cp_load_balance=False, zero=1,
                         microbatches=2)
    raw["resume"].update(dp=2, tp=1, pp=1, zero=0, microbatches=1)
    config = config_from_dict(raw)
    assert (config.layout.cp, config.layout.cp_method, config.layout.cp_load_balance) == (2, "allgather", False)
    run = run_capstone(config, tmp_path, timeout_s=240)
    assert run.equal, (run.max_difference, config.tolerance)  # capstone.config.TOLERANCE["fp32"], its reason there
    assert run.traffic[0]["cp"]["calls"] > 0


def _train_without_cp_reduction(dims, config, train_cfg):
    """Rank code: train_hybrid with ZeRO's engine over dp only, as if cp were forgotten in the
    gradient reduction (each cp rank then steps on the gradient of its own tokens)."""
    import course_lib.parallel.hybrid.compose as compose
    from course_lib.parallel.hybrid import train_hybrid

    right = compose.zero_group
    compose.zero_group = lambda parts: parts.groups["dp"]
    try:  # the rank processes are reused: put the function back
        return train_hybrid(dims, config, train_cfg)
    finally:
        compose.zero_group = right


def test_without_the_gradient_average_over_cp_the_run_differs(dense, single):
    dims = ParallelDims(dp=2, cp=2, zero=1)
    dims.check(4, dense, TRAIN.batch_size)
    results = run_on_ranks(_train_without_cp_reduction, dims, dense, TRAIN, world_size=4, timeout_s=240)
    with pytest.raises(AssertionError):
        _assert_equal_to_single(results, single)
    # the step-1 loss is computed before any update: still the single process's
    assert results[0].train_losses[0] == pytest.approx(single.train_losses[0], rel=FP32_SUM_RTOL)


@pytest.mark.parametrize("change, message", [
    (dict(cp=5), "seq_len=24 must be divisible by 2*cp = 10 chunks"),
    (dict(cp=16, cp_load_balance=False), "seq_len=24 must be divisible by cp = 16 equal shards"),
    (dict(cp=2, tp=2, cp_method="ulysses", n_head=2), "cp=2 must divide the n_head/tp = 2/2 = 1 heads"),
    (dict(cp=4, cp_method="ulysses", n_head=2), "cp=4 must divide n_head=2 for method='ulysses'"),
    (dict(cp=2, ep=2, n_experts=4), "cp=2 with n_experts=4: context parallelism here splits the dense GPT only"),
    (dict(cp=2, dropout=0.1), "cp=2 with dropout=0.1: context-parallel attention has no attention dropout"),
    (dict(cp=2, cp_method="star"), "cp_method='star' must be one of ('ring', 'allgather', 'ulysses')"),
])
def test_bad_context_parallel_layouts_are_refused_before_any_rank_starts(dense, change, message, monkeypatch):
    import course_lib.parallel.hybrid.training as training

    model = {k: change.pop(k) for k in ("n_head", "n_experts", "dropout") if k in change}
    if "n_head" in model:
        model["d_model"] = 8 * model["n_head"]
    config = replace(dense, **model, **(dict(top_k=1, aux_loss_coef=0.0, z_loss_coef=0.0)
                                        if "n_experts" in model else {}))

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(training, "run_on_ranks", no_ranks)
    with pytest.raises(ValueError) as err:
        run_hybrid(ParallelDims(**change), config, TRAIN)
    assert message in str(err.value), str(err.value)


def test_traffic_by_dimension_names_cp_and_dp_cp_and_cp1_as_before():
    """Pure Python: which dimension a group's records count under."""
    from types import SimpleNamespace

    def rec(ranks):
        return SimpleNamespace(group_ranks=ranks, bytes_sent=4, bytes_recv=4)

    dims = ParallelDims(dp=2, cp=2, tp=2)  # ranks = (dp * 2 + cp) * 2 + tp
    groups = mesh_groups(8, **dims.sizes())
    assert groups["cp"][0] == [0, 2] and groups["dp"][0] == [0, 4] and groups["tp"][0] == [0, 1]
    got = traffic_by_dimension([rec([0, 2]), rec([0, 2, 4, 6]), rec([0, 1]), rec([1, 3, 5, 7])], dims, 8)
    assert {d: s["calls"] for d, s in got.items()} == {"cp": 1, "dp_cp": 2, "tp": 1}
    plain = ParallelDims(dp=2, tp=2)  # cp = 1: its groups are single ranks, so no call counts under cp
    assert set(mesh_groups(4, **plain.sizes())) == {"pp", "dp", "ep", "cp", "tp"}
    assert traffic_by_dimension([rec([0, 2])], plain, 4) == {"dp": {"calls": 1, "bytes_sent": 4, "bytes_recv": 4}}
