"""V-shaped schedules (ZB-V, DualPipeV) and PipeDream-2BW (course_lib.parallel.pp).

Claims: the V placement puts stages r and 2p-1-r on rank r; ZB-V and DualPipeV are valid action
lists (no deadlock) with ZB-V's published warm-up shape, 1F1B's memory for ZB-V and one more
micro-batch for DualPipeV, and the simulated bubble (p-1)/(6m+p-1), nearly all of it the warm-up
stagger (DualPipeV at or below ZB-V off the ideal clock); trained on real ranks they
equal the single process, and torch's ScheduleZBVZeroBubble / ScheduleDualPipeV on the same
stages; PipeDream-2BW equals its own one-step-delayed single-process reference, holds at most
two weight versions per stage, and differs from synchronous training (staleness). Bad input is
rejected before any rank starts. Ranks are started three times in all: one launch for the V
schedules (ours and torch's), one for 2BW, one torchrun of the demo.
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims, check_pipeline_choice
from course_lib.model import GPTConfig
from course_lib.parallel.pp import (
    Action,
    Schedule,
    ScheduleError,
    check_schedule,
    in_flight,
    make_schedule,
    run_pipeline,
    schedule_events,
    simulate,
    stage_tensors,
)
from course_lib.parallel.pp.actions import rank_of, stage_of
from course_lib.parallel.pp.bubble import formula_for, measured_bubble
from course_lib.parallel.pp.native import run_native, train_native
from course_lib.parallel.pp.pipedream import reference_2bw, run_2bw, train_2bw
from course_lib.parallel.pp.training import train_pipeline
from course_lib.train import TrainConfig, train_reference

from _tolerances import adamw_loss_atol, assert_adamw_params_close
from _demo_cli import run_main

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)


def config(n_layer=6, **kw):
    return GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=n_layer, d_model=32, n_head=2, block_size=16, **kw)


def train_cfg(steps=3, batch_size=12):
    return TrainConfig(steps=steps, batch_size=batch_size, grad_clip=0.0, eval_every=10**6, eval_batches=1,
                       progress=False)


# ---------------------------------------------------------------- schedules as data (no ranks)

def test_v_placement_holds_the_first_and_last_stage_on_rank_0():
    p = 4
    assert [[stage_of("v", p, r, c) for c in (0, 1)] for r in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_of("v", p, s) for s in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [rank_of("loop", p, s) for s in range(2 * p)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 17])
def test_zbv_is_valid_with_1f1b_memory_and_the_v_bubble(p, m):
    zbv = check_schedule(make_schedule("zbv", p, m, 2))
    assert zbv.placement == "v" and zbv.virtual_stages == 2
    # every rank holds at most 2p chunks whose W has not run: 1F1B's p micro-batches of 2 chunks
    assert max(in_flight(zbv, until="W")) <= 2 * p
    # ZB-V's warm-up (Qi et al., 2024): rank r starts with min(2(p-r)-1, m) forwards of chunk 0
    for r, acts in enumerate(zbv.actions):
        head = [a for a in acts[:min(2 * (p - r) - 1, m)]]
        assert head == [Action("F", j, 0) for j in range(len(head))], (r, acts[:8])
    bubble = measured_bubble(schedule_events(zbv))
    if m >= p:
        # ratio of integer tick counts vs a float64 formula: equal to float64 rounding, abs 1e-12
        assert bubble == pytest.approx(formula_for("zbv", p, m), abs=1e-12)
        if p > 1:  # half of ZB-H1's idle time, for the same memory
            assert bubble < formula_for("zero_bubble", p, m)


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (3, 6), (4, 8), (4, 13)])
def test_dualpipev_overlaps_f_with_b_of_another_microbatch(p, m):
    dual = check_schedule(make_schedule("dualpipev", p, m, 2))
    assert max(in_flight(dual, until="W")) <= 2 * p + 2  # one micro-batch (2 chunks) more than ZB-V
    for r, acts in enumerate(dual.actions):
        for i in dual.pairs(r):
            f, b = acts[i], acts[i + 1]
            assert f.kind == "F" and b.kind == "B" and f.microbatch != b.microbatch
            assert acts[i + 2] == Action("W", b.microbatch, b.chunk)  # the pair's backward is whole
    assert sum(len(dual.pairs(r)) for r in range(p)) >= p * (m - 2 * p + 1)  # a steady state of pairs
    assert measured_bubble(schedule_events(dual)) == pytest.approx(formula_for("dualpipev", p, m), abs=1e-12)
    assert "&" in dual.table()


def _stagger_and_gaps(sched):
    """Per rank, in chunk-times of the equal-times simulation: idle before the rank's first action
    and after its last within the step (the stagger), and idle between its actions (the gaps)."""
    sim, chunk = simulate(sched), 1 / sched.virtual_stages
    span = max(r[-1][2] for r in sim) - min(r[0][1] for r in sim)
    return [((span - (r[-1][2] - r[0][1])) / chunk, (r[-1][2] - r[0][1] - sum(e - s for _, s, e in r)) / chunk)
            for r in sim]


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (5, 12), (6, 18)])
def test_the_v_schedules_idle_time_is_the_stagger_and_dualpipev_gains_off_the_ideal_clock(p, m):
    """Notebook 06, section 9: the (p-1)/(6m+p-1) of a synchronous step end is p - 1 idle
    chunk-times per rank, all of it stagger for DualPipeV and all but one chunk-time (over all
    ranks) for ZB-V; with messages that cost time or a W unlike F and B, DualPipeV's bubble is at
    or below ZB-V's. Simulated times are sums of 0.5-multiples (exact in float64), bubbles ratios
    of them: compared to 1e-12."""
    zbv, dual = make_schedule("zbv", p, m, 2), make_schedule("dualpipev", p, m, 2)
    for sched, total_gaps in ((zbv, 1), (dual, 0)):
        split = _stagger_and_gaps(sched)
        assert all(abs(a + g - (p - 1)) < 1e-12 for a, g in split), split
        assert sum(g for _, g in split) == total_gaps, split
    for times in (dict(t_comm=0.1), dict(t_comm=0.3), dict(t_weight=0.5), dict(t_weight=2.0),
                  dict(t_forward=0.7, t_backward=1.3, t_weight=1.5)):
        z, d = (measured_bubble(schedule_events(s, **times)) for s in (zbv, dual))
        assert d <= z + 1e-12, (times, z, d)


def test_the_simulator_starts_an_overlapped_pair_when_both_halves_can():
    """1 rank, 2 stages in a V: F1 alone could start at t=2, but paired with B0 (which waits for
    B0 of stage 1 until t=4) it starts at 4; F then B run one after the other (no compute overlap)."""
    acts = [Action("F", 0), Action("F", 0, 1), Action("B", 0, 1), Action("W", 0, 1), Action("F", 1),
            Action("B", 0), Action("W", 0), Action("F", 1, 1), Action("B", 1, 1), Action("W", 1, 1),
            Action("B", 1), Action("W", 1)]
    plain = Schedule("x", 1, 2, 2, [acts], placement="v")
    paired = Schedule("x", 1, 2, 2, [acts], placement="v", overlapped=[{4}])
    assert [s for _, s, _ in simulate(plain)[0]] == [s for _, s, _ in simulate(paired)[0]]  # same rank: no wait
    two = make_schedule("dualpipev", 2, 4, 2)
    unpaired = Schedule("x", 2, 4, 2, two.actions, placement="v")
    times = {(r, str(a)): s for r in range(2) for a, s, _ in simulate(two, 1, 1, 1, t_comm=0.5)[r]}
    times0 = {(r, str(a)): s for r in range(2) for a, s, _ in simulate(unpaired, 1, 1, 1, t_comm=0.5)[r]}
    for r in range(2):
        for i in two.pairs(r):
            f, b = two.actions[r][i], two.actions[r][i + 1]
            assert times[(r, str(b))] == times[(r, str(f))] + 0.5  # F (1/v = 0.5) then B, back to back
            assert times[(r, str(f))] >= times0[(r, str(f))]  # waiting for the B can only delay the F
    with pytest.raises(ScheduleError, match="overlapped index 0 must start an F followed by a B"):
        check_schedule(Schedule("x", 1, 2, 2, [acts], placement="v", overlapped=[{0}]))


def test_v_schedules_reject_bad_input_naming_the_value_and_rule(monkeypatch):
    with pytest.raises(ValueError, match="'zbv' places exactly 2 chunks per rank in a V.*got 1"):
        make_schedule("zbv", 2, 4, 1)
    with pytest.raises(ValueError, match="'dualpipev' places exactly 2 chunks .*got 3"):
        check_pipeline_choice("dualpipev", 2, 8, 3)
    with pytest.raises(ValueError, match="dualpipev needs n_microbatches >= 2 \\* n_ranks = 8 .*got 6"):
        make_schedule("dualpipev", 4, 6, 2)
    with pytest.raises(ValueError, match="'pipedream_2bw' has no per-step action list"):
        make_schedule("pipedream_2bw", 2, 4)
    import course_lib.runtime as runtime
    from course_lib.parallel.pp import native, pipedream, training

    for mod in (runtime, training, native, pipedream):  # no rank may start
        monkeypatch.setattr(mod, "run_on_ranks", lambda *a, **k: pytest.fail("ranks were started"), raising=False)
    cfg = train_cfg()
    with pytest.raises(ValueError, match="virtual_stages must be 2, got 1"):
        run_pipeline(ParallelDims(pp=2, schedule="zbv", microbatches=4, virtual_stages=1), config(), cfg)
    with pytest.raises(ValueError, match="n_layer=6 blocks cannot fill 8 stages"):
        run_pipeline(ParallelDims(pp=4, schedule="zbv", microbatches=4, virtual_stages=2), config(), cfg)
    with pytest.raises(ValueError, match="'dualpipev' places exactly 2 chunks per rank in a V.*got 1"):
        run_native(ParallelDims(pp=2, schedule="dualpipev", microbatches=4, virtual_stages=1), config(), cfg)
    untied = config(tie_weights=False)
    with pytest.raises(ValueError, match="n_microbatches >= the 4 stages \\(got 2\\)"):
        run_2bw(ParallelDims(pp=4, schedule="pipedream_2bw", microbatches=2), untied, train_cfg(batch_size=8))
    with pytest.raises(ValueError, match="grad_clip=1.0 needs the global gradient norm"):
        run_2bw(ParallelDims(pp=2, schedule="pipedream_2bw", microbatches=2), untied,
                TrainConfig(steps=2, batch_size=8, grad_clip=1.0))
    with pytest.raises(ValueError, match="needs tie_weights=False"):
        run_2bw(ParallelDims(pp=2, schedule="pipedream_2bw", microbatches=2), config(), cfg)


def test_2bw_reference_is_one_step_stale():
    """Batches 0 and 1 both see W_0; batch 2 sees W_1, the weights after ONE update (synchronous
    training's batch 1 sees W_1 too, so its loss on batch 1 differs from 2BW's)."""
    cfg, mc = train_cfg(steps=3, batch_size=8), config(4, tie_weights=False)
    stale, sync = reference_2bw(mc, cfg, 2).train_losses, train_reference(mc, cfg).train_losses
    # the same computation (W_0 on batch 0), micro-batched vs whole: fp32 rounding, abs 1e-5 of ~4.5
    assert stale[0] == pytest.approx(sync[0], abs=1e-5)
    assert abs(stale[1] - sync[1]) > 1e-3  # one AdamW step of lr moves the loss by ~1e-2


# ---------------------------------------------------------------- real ranks

def _v_runs(model_config, cfg):
    """Rank code: ours and torch's, for zbv and dualpipev, in one launch."""
    out = {}
    for name, m in (("zbv", 3), ("dualpipev", 6)):
        out[name] = train_pipeline(model_config, cfg, name, m, 2)
        dist.barrier()
        out["torch " + name] = train_native(model_config, cfg, name, m, 2)
        dist.barrier()
    return out


def test_zbv_and_dualpipev_equal_the_single_process_and_torch():
    """3 ranks, 6 stages, tied embedding/head (both on rank 0), 3 AdamW steps. Tolerances as in
    test_pipeline.py: losses within adamw_loss_atol, parameters bounded by AdamW's step and in
    RMS (AdamW magnifies reordered sums near g = 0; tests/_tolerances)."""
    mc, cfg = config(6), train_cfg()
    ref = train_reference(mc, cfg)
    want = {n: q.detach() for n, q in ref.model.named_parameters()}
    per_rank = run_on_ranks(_v_runs, mc, cfg, world_size=3, timeout_s=120)
    for key in ("zbv", "torch zbv", "dualpipev", "torch dualpipev"):
        results = [r[key] for r in per_rank]
        for res in results:
            assert res.train_losses == pytest.approx(ref.train_losses, abs=adamw_loss_atol(cfg.lr)), key
        got = stage_tensors(results)
        assert sorted(got) == sorted(want), key
        names = sorted(want)
        assert_adamw_params_close(torch.cat([got[n].reshape(-1) for n in names]),
                                  torch.cat([want[n].reshape(-1) for n in names]), cfg.lr, cfg.steps, cfg.betas,
                                  msg=key)
    assert per_rank[0]["zbv"].param_names.count("tok_emb.weight") == 1  # one Parameter on rank 0


def test_pipedream_2bw_equals_its_delayed_reference_with_two_versions():
    """2 ranks, m = 2, 4 steps, no flush. Equal to reference_2bw (same delayed update in one
    process; tolerances as above), never more than 2 stashed versions per stage, batch t run with
    version max(t-1, 0), and not equal to synchronous training (the price of staleness)."""
    mc, cfg = config(4, tie_weights=False), train_cfg(steps=4, batch_size=8)
    want = reference_2bw(mc, cfg, 2)
    results = run_2bw(ParallelDims(pp=2, schedule="pipedream_2bw", microbatches=2), mc, cfg, timeout_s=120)
    for res in results:
        assert res.train_losses == pytest.approx(want.train_losses, abs=adamw_loss_atol(cfg.lr))
        assert max(len(v) for v in res.versions_held) == 2
        assert res.version_used == {0: 0, 1: 0, 2: 1, 3: 2}
    got, ref = stage_tensors(results), stage_tensors([want])
    names = sorted(ref)
    assert sorted(got) == names
    assert_adamw_params_close(torch.cat([got[n].reshape(-1) for n in names]),
                              torch.cat([ref[n].reshape(-1) for n in names]), cfg.lr, cfg.steps, cfg.betas)
    sync = train_reference(mc, cfg).train_losses
    assert abs(want.train_losses[-1] - sync[-1]) > 1e-3


# ---------------------------------------------------------------- the demo

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_pipeline_demo_checks_2bw_under_torchrun():
    """The demo's pipedream_2bw path with --check (its zbv/dualpipev path is the 1F1B demo's loop
    with a V stage, checked by hand: --schedule zbv --check)."""
    import os
    import re
    import subprocess

    for schedule, m, ref in (("pipedream_2bw", "2", "delayed-update single process"),):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "course_lib.demos.pipeline", "--schedule", schedule, "--microbatches", m, "--steps", "2",
               "--check"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        steps = re.findall(rf"step (\d): pipeline loss (\S+)  {ref} (\S+)", proc.stdout)
        assert [s[0] for s in steps] == ["1", "2"], proc.stdout
        assert "): OK" in proc.stdout


def test_pipeline_demo_check_verdict_and_bad_v_arguments():
    import argparse

    from course_lib.demos.pipeline import verdict

    args = argparse.Namespace(schedule="zbv", steps=2, batch_size=8, tolerance=None)
    assert verdict(args, [4.5, 4.4], [4.5, 4.4 + 1e-6]) == 0
    assert verdict(args, [4.5, 4.4], [4.5, 4.5]) == 1  # a loss off by 0.1: exit status 1
    code, err = run_main("course_lib.demos.pipeline", ["--schedule", "zbv", "--virtual-stages", "3"])
    assert code == 2 and "virtual_stages must be 2, got 3" in err
