"""Tests for course_lib.parallel.pp: pipeline schedules as data, and real pipelined training.

The central claims: every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1 zero bubble) trained
on 2 and 4 real ranks equals the single-process GPT over several AdamW steps (uneven block
split, tied embeddings), as does torch.distributed.pipelining on the same stages; the
schedules' simulated bubbles equal the formulas (for ZB-H1 and 1F1B also Qi et al.'s idle time
per rank at unequal F, B, W times); GPipe's saved activations grow with m while 1F1B's stay
bounded by p in-flight micro-batches, and ZB-H1 never holds more than p on any rank (1F1B's
peak) with rank 0 exactly at 1F1B's. Equality runs use grad_clip=0 and compare
raw gradients: AdamW is scale-invariant, so a wrongly scaled gradient could still pass a
parameter check.
"""

import sys

import cloudpickle
import pytest
import torch

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.pp import (
    Action,
    Schedule,
    ScheduleError,
    build_stage,
    check_schedule,
    in_flight,
    make_schedule,
    run_pipeline,
    run_schedule,
    schedule_events,
    simulate,
    split_layers,
    stage_tensors,
)
from course_lib.parallel.pp.bubble import formula_for, measured_bubble
from course_lib.parallel.pp.native import run_native
from course_lib.train import TrainConfig, train_reference

from _tolerances import adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw
from _demo_cli import run_main

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

STEPS = 3


def small_config(n_layer=5, **kw):
    return GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=n_layer, d_model=32, n_head=2, block_size=16, **kw)


def train_cfg(clip=0.0, batch_size=8):
    return TrainConfig(steps=STEPS, batch_size=batch_size, grad_clip=clip, eval_every=10**6, eval_batches=1,
                       progress=False)


_REFERENCES = {}


def reference(config, cfg):
    key = (config, cfg.grad_clip, cfg.batch_size)
    if key not in _REFERENCES:
        res = train_reference(config, cfg)
        _REFERENCES[key] = (res.train_losses, {n: p.detach().clone() for n, p in res.model.named_parameters()},
                            {n: p.grad.detach().clone() for n, p in res.model.named_parameters()})
    return _REFERENCES[key]


def assert_equal_to_reference(results, config, cfg):
    """The stages' sums run in another order than the single process's (micro-batches, stage
    boundaries), and AdamW magnifies that rounding near g = 0 (tests/_tolerances): losses within
    adamw_loss_atol, the last step's gradients (taken after 2 AdamW steps) in norm per tensor,
    parameters bounded by AdamW's step and in RMS against lr/100. A wrongly scaled gradient is
    off by O(1) in norm; a wrong update moves most elements by ~lr."""
    losses, params, grads = reference(config, cfg)
    for r, res in enumerate(results):
        assert res.train_losses == pytest.approx(losses, abs=adamw_loss_atol(cfg.lr)), f"rank {r} losses"
    got_p, got_g = stage_tensors(results, "final_params"), stage_tensors(results, "final_grads")
    assert sorted(got_p) == sorted(params), "the stages together must hold every parameter once"

    def params_close(got, want, msg):
        assert_adamw_params_close(got, want, cfg.lr, cfg.steps, cfg.betas, msg=msg)

    for res in results:  # the last stage's copy of a tied matrix must stay equal to the reference too
        mine = stage_tensors([res], "final_params")
        if "tok_emb.weight" in mine:
            params_close(mine["tok_emb.weight"], params["tok_emb.weight"], "tied tok_emb.weight")
    assert_grads_close_after_adamw(got_g, grads, "grad")
    names = sorted(params)
    params_close(*(torch.cat([d[n].reshape(-1) for n in names]) for d in (got_p, params)), "params")


# ---------------------------------------------------------------- schedules as data (no ranks)

@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])
def test_schedules_are_valid_and_their_simulated_bubble_is_the_formula(p, m):
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)):
        if name == "interleaved_1f1b" and m % p:
            continue
        sched = check_schedule(make_schedule(name, p, m, v))
        events = schedule_events(sched)
        bubble = measured_bubble(events)
        one_f_one_b = formula_for("1f1b", p, m)
        # the simulated bubble is a ratio of integer action counts (unit-time actions), the formula
        # a float64 expression of p, m, v: equal up to float64 rounding (~1e-16); abs 1e-12
        if name == "zero_bubble":
            assert bubble < one_f_one_b
            if m >= p:
                assert bubble == pytest.approx(formula_for(name, p, m), abs=1e-12)
        else:
            assert bubble == pytest.approx(formula_for(name, p, m, v), abs=1e-12), (name, p, m, v)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 2), (4, 8), (4, 16)])
def test_gpipe_holds_all_m_in_flight_and_1f1b_at_most_p_minus_rank(p, m):
    assert in_flight(make_schedule("gpipe", p, m)) == [m] * p
    assert in_flight(make_schedule("1f1b", p, m)) == [min(p - r, m) for r in range(p)]
    assert max(in_flight(make_schedule("zero_bubble", p, m))) <= p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_zero_bubble_is_zb_h1_with_the_memory_of_1f1b(p, m):
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B's graphs per rank, and at most p micro-batches
    waiting for their W on any rank (p M_B, 1F1B's peak); rank 0 defers no W, so its peak is
    1F1B's; rank r defers at most r. A schedule that defers W's on every rank by the same rule
    (rank 0 holding 2p - 1) fails here."""
    zb, ref = make_schedule("zero_bubble", p, m), make_schedule("1f1b", p, m)
    assert in_flight(zb) == in_flight(ref)  # whole graphs: p - r on rank r, as 1F1B
    assert in_flight(zb, until="W") == [min(p, m)] * p  # 1F1B's peak, p (or all m), on every rank
    for r, acts in enumerate(zb.actions):
        waiting_w = most = 0  # B done, W not yet: at most r besides the one just back
        for a in acts:
            waiting_w += (a.kind == "B") - (a.kind == "W")
            most = max(most, waiting_w)
        assert most <= r + 1
    assert in_flight(ref, until="W") == in_flight(ref)  # no W in 1F1B: B ends the micro-batch
    with pytest.raises(ValueError, match="until='F' must be 'B' or 'W'"):
        in_flight(zb, until="F")


@pytest.mark.parametrize("t_f, t_b, t_w", [(1, 1, 1), (1, 2, 1), (1, 1.5, 0.5), (2, 1, 0.5)])
def test_idle_time_per_rank_is_table_2_of_the_zero_bubble_paper(t_f, t_b, t_w):
    """Qi et al. 2023, Table 2: every rank idles (p-1)(T_F+T_B+T_W) under 1F1B and
    (p-1)(T_F+T_B-T_W) under ZB-H1 (m >= p). Simulated times are sums of these binary fractions:
    exact up to float64 rounding, abs 1e-9."""
    for p, m in ((2, 4), (4, 8), (4, 16), (8, 24)):
        for name, idle in (("1f1b", (p - 1) * (t_f + t_b + t_w)), ("zero_bubble", (p - 1) * (t_f + t_b - t_w))):
            ranks = simulate(make_schedule(name, p, m), t_f, t_b, t_w)
            span = max(e for rank in ranks for *_, e in rank) - min(s for rank in ranks for _, s, _ in rank)
            for rank in ranks:
                assert span - sum(e - s for _, s, e in rank) == pytest.approx(idle, abs=1e-9), (name, p, m)


def test_the_schedule_is_printable_data():
    sched = make_schedule("1f1b", 2, 3)
    assert sched.table() == "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2"
    assert str(make_schedule("zero_bubble", 2, 2).actions) == "[[F0, F1, B0, W0, B1, W1], [F0, B0, F1, B1, W0, W1]]"


def test_checker_catches_missing_duplicated_and_deadlocking_actions():
    zb = make_schedule("zero_bubble", 2, 3)
    missing_w = Schedule("zb", 2, 3, 1, [zb.actions[0], [a for a in zb.actions[1] if a != Action("W", 2)]])
    with pytest.raises(ScheduleError, match="rank 1 never runs W2"):
        check_schedule(missing_w)
    g = make_schedule("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="runs F1 twice"):
        check_schedule(Schedule("x", 2, 2, 1, [g.actions[0] + [Action("F", 1)], g.actions[1]]))
    # rank 0 insists on its backward before the forwards that the last stage needs: stuck.
    backward_first = [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
    late_last = [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 at B0 waits for B0 of stage 1"):
        check_schedule(Schedule("x", 2, 2, 1, [backward_first, late_last]))
    with pytest.raises(ScheduleError, match="holds 4 micro-batches in flight"):
        check_schedule(make_schedule("gpipe", 2, 4), max_in_flight=2)


def test_make_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="schedule='pipedream' must be one of"):
        make_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="n_microbatches=6 must be a multiple of the 4 ranks"):
        make_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved_1f1b'"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="n_microbatches=0 must be an int >= 1"):
        make_schedule("gpipe", 2, 0)


def test_blocks_split_as_evenly_as_possible_with_the_remainder_first():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(9, 4) == [range(0, 3), range(3, 5), range(5, 7), range(7, 9)]
    with pytest.raises(ValueError, match="n_layer=3 blocks cannot fill 4 stages"):
        split_layers(3, 4)


def test_simulated_timeline_of_zero_bubble_fills_time_1f1b_leaves_idle():
    a, b = simulate(make_schedule("1f1b", 4, 8)), simulate(make_schedule("zero_bubble", 4, 8))
    assert max(e for r in b for *_, e in r) < max(e for r in a for *_, e in r)


# ---------------------------------------------------------------- real ranks: equality to one process

CASES = [  # (world size, schedule, micro-batches, virtual stages, n_layer)
    (2, "gpipe", 4, 1, 5),
    (2, "1f1b", 4, 1, 5),
    (2, "zero_bubble", 4, 1, 5),
    (2, "interleaved_1f1b", 4, 2, 5),
    (4, "gpipe", 4, 1, 5),
    (4, "1f1b", 2, 1, 5),   # fewer micro-batches than stages: works (degenerates to GPipe)
    (4, "1f1b", 8, 1, 5),
    (4, "zero_bubble", 8, 1, 5),
    (4, "interleaved_1f1b", 8, 2, 9),
]


@pytest.mark.parametrize("world,schedule,m,v,n_layer", CASES, ids=[f"{c[1]}-p{c[0]}-m{c[2]}-v{c[3]}" for c in CASES])
def test_pipeline_equals_single_process_training(world, schedule, m, v, n_layer):
    config, cfg = small_config(n_layer), train_cfg()
    dims = ParallelDims(pp=world, schedule=schedule, microbatches=m, virtual_stages=v)
    results = run_pipeline(dims, config, cfg, timeout_s=90)
    assert_equal_to_reference(results, config, cfg)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pipeline_with_gradient_clipping_and_untied_head(schedule):
    config = small_config(4, tie_weights=False)
    cfg = train_cfg(clip=0.05)  # small enough to clip every step: the global norm must be right
    two = ParallelDims(pp=2, schedule=schedule, microbatches=4)
    assert_equal_to_reference(run_pipeline(two, config, cfg, timeout_s=90), config, cfg)
    tied = small_config(4)
    four = ParallelDims(pp=4, schedule=schedule, microbatches=4)
    assert_equal_to_reference(run_pipeline(four, tied, cfg, timeout_s=90), tied, cfg)


@pytest.mark.parametrize("world,schedule,m,v", [(2, "gpipe", 4, 1), (2, "1f1b", 4, 1), (2, "interleaved_1f1b", 4, 2),
                                                (4, "1f1b", 4, 1)])
def test_torch_pipelining_on_the_same_stages_gives_the_same_training(world, schedule, m, v):
    config, cfg = small_config(5), train_cfg()
    dims = ParallelDims(pp=world, schedule=schedule, microbatches=m, virtual_stages=v)
    ours = run_pipeline(dims, config, cfg, timeout_s=90)
    theirs = run_native(dims, config, cfg, timeout_s=90)
    assert_equal_to_reference(theirs, config, cfg)
    for a, b in zip(ours, theirs):  # two implementations' sums, after AdamW steps: as above
        assert a.train_losses == pytest.approx(b.train_losses, abs=adamw_loss_atol(cfg.lr))


def test_bad_input_is_rejected_in_the_parent_before_any_rank_waits(monkeypatch):
    import course_lib.runtime as runtime

    # no rank may start: run_on_ranks fails the test if called (no wall-clock assert)
    monkeypatch.setattr(runtime, "run_on_ranks", lambda *a, **k: pytest.fail("ranks were started"))
    cfg = train_cfg()
    with pytest.raises(ValueError, match="n_layer=2 blocks cannot fill 4 stages"):
        run_pipeline(ParallelDims(pp=2, schedule="interleaved_1f1b", microbatches=4, virtual_stages=2), small_config(2),
                     cfg)
    with pytest.raises(ValueError, match="batch size 8 must be divisible by n_microbatches=3"):
        run_pipeline(ParallelDims(pp=2, schedule="1f1b", microbatches=3), small_config(), cfg)
    with pytest.raises(ValueError, match="n_microbatches=2 must be a multiple of the 4 ranks"):
        run_pipeline(ParallelDims(pp=4, schedule="interleaved_1f1b", microbatches=2, virtual_stages=2), small_config(8),
                     cfg)
    with pytest.raises(ValueError, match="schedule='zb2' must be one of"):
        run_pipeline(ParallelDims(pp=2, schedule="zb2", microbatches=4), small_config(), cfg)
    with pytest.raises(ValueError, match="for torch.distributed.pipelining"):
        run_native(ParallelDims(pp=2, schedule="zero_bubble", microbatches=4), small_config(), cfg)


def _run_one_step(schedules_and_m, micro_batch=2, n_layer=4):
    """Rank code: one run_schedule per (schedule, m) on the same stage; returns per run the
    compute-event names in order and the peak saved-activation bytes."""
    from course_lib import Timeline

    config = small_config(n_layer)
    stage = build_stage(GPT(config, seed=0), None)
    out = []
    for schedule, m in schedules_and_m:
        gen = torch.Generator().manual_seed(1)
        idx = torch.randint(0, config.vocab_size, (m * micro_batch, config.block_size), generator=gen)
        tl = Timeline()
        run_schedule(stage, idx, idx, schedule, m, timeline=tl)
        stage.zero_grad(set_to_none=True)
        out.append(([n for n, _, _, c in tl.events if c != "comm"], [c for *_, c in tl.events],
                    stage.last_peak_activation_bytes))
    return out


def test_real_timeline_follows_the_schedule_and_activation_memory_follows_in_flight():
    runs = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 4), ("1f1b", 8), ("zero_bubble", 8),
            ("zero_bubble", 16)]
    per_rank = run_on_ranks(_run_one_step, runs, world_size=4, timeout_s=90)
    for r, results in enumerate(per_rank):
        one_mb = results[0][2]  # a micro-batch's saved activations on this stage
        assert one_mb > 0
        for (schedule, m), (names, cats, peak) in zip(runs, results):
            sched = make_schedule(schedule, 4, m)
            assert names == [str(a) for a in sched.actions[r]], (schedule, m, r)
            if r > 0:
                assert "comm" in cats  # every rank but the first receives activations
            if schedule != "zero_bubble":
                assert peak == in_flight(sched)[r] * one_mb, (schedule, m, r)
        peaks = {run: res[2] for run, res in zip(runs, results)}
        assert peaks[("gpipe", 4)] == 4 * one_mb  # GPipe grows with m
        assert peaks[("1f1b", 8)] == peaks[("1f1b", 4)] == (4 - r) * one_mb  # 1F1B: bounded by p - r
        # ZB-H1: p - r whole graphs plus at most r deferred W's (each Linear's input and output
        # gradient, less than a graph): independent of m and within p graphs of this stage, 1F1B's
        # peak p M_B (Qi et al. 2023, Table 2); rank 0 defers none, so its peak is 1F1B's exactly.
        assert peaks[("zero_bubble", 16)] == peaks[("zero_bubble", 8)] <= 4 * one_mb
        if r == 0:
            assert peaks[("zero_bubble", 8)] == peaks[("1f1b", 8)]


# ---------------------------------------------------------------- the instructor path

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_pipeline_demo_under_torchrun_with_gloo():
    import os
    import re
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.demos.pipeline", "--schedule", "1f1b", "--microbatches", "4", "--steps", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = re.findall(r"step (\d): pipeline loss (\S+)  single process (\S+)", proc.stdout)
    assert [s[0] for s in steps] == ["1", "2"], proc.stdout
    for _, ours, ref in steps:  # printed to 6 decimals (1e-6), step 2 after an AdamW step
        assert abs(float(ours) - float(ref)) < adamw_loss_atol(TrainConfig().lr) + 1e-6
    assert "bubble formula 0.200" in proc.stdout


def test_pipeline_demo_rejects_bad_arguments_before_joining_the_group():
    code, err = run_main("course_lib.demos.pipeline", ["--microbatches", "3"])
    assert code != 0 and "batch size 8 must be divisible by n_microbatches=3" in err
