"""Tests for course_lib.loop: the one loop every training function runs (train_loop), the one
record of a step's hooks (StepHooks), and train_step taking either form."""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from course_lib.data import VOCAB_SIZE, CharDataset, collate, sample_indices
from course_lib.loop import StepHooks, share_rows, train_loop
from course_lib.model import GPT, GPTConfig
from course_lib.observe.timeline import Timeline
from course_lib.runtime import RankError, rank_device, run_on_ranks
from course_lib.train import TrainConfig, flat_params, make_optimizer, train_step

CFG = TrainConfig(steps=3, batch_size=8, grad_clip=1.0, progress=False)


def _setup(vocab_size, n_layer=1):
    config = GPTConfig.tiny(vocab_size, n_layer=n_layer, block_size=16)
    model = GPT(config, seed=CFG.seed)
    return model, make_optimizer(model, CFG), CharDataset("train", block_size=16)


def _by_hand(vocab_size, cfg, rows=None, accum_steps=1):
    """The loop written out: the reference's generator, this rank's rows, train_step."""
    model, opt, ds = _setup(vocab_size)
    gen, losses, norms = torch.Generator().manual_seed(cfg.seed), [], []

    def clip(c):
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), c)))

    for _ in range(cfg.steps):
        idx = sample_indices(len(ds), cfg.batch_size, gen)
        x, y = collate(ds, idx if rows is None else idx[rows])
        losses.append(train_step(model, opt, x, y, cfg.grad_clip, accum_steps=accum_steps, clip_grad_norm=clip))
    return losses, norms, flat_params(model)


@pytest.mark.parametrize("rows,accum_steps", [(None, 1), (slice(4, 8), 2)])
def test_loop_equals_the_loop_written_by_hand_bit_for_bit(vocab_size, rows, accum_steps):
    want_losses, want_norms, want_params = _by_hand(vocab_size, CFG, rows, accum_steps)
    model, opt, ds = _setup(vocab_size)
    result = train_loop(model, opt, ds, CFG, StepHooks(accum_steps=accum_steps), rows=rows, record_grad_norms=True)
    assert result.train_losses == want_losses  # exact: the same draws, the same operations
    assert result.grad_norms == want_norms
    assert torch.equal(flat_params(model), want_params)
    assert len(result.step_seconds) == CFG.steps and result.seconds >= 0
    # a different share of the batch is a different run: the comparison can fail
    other = train_loop(*_setup(vocab_size), CFG, StepHooks(accum_steps=accum_steps), rows=slice(0, 4))
    assert other.train_losses != want_losses


def test_callbacks_once_per_step_in_order(vocab_size):
    model, opt, ds = _setup(vocab_size)
    calls = []
    result = train_loop(model, opt, ds, CFG, before_step=lambda s: calls.append(("before", s)),
                        step_context=lambda s: contextlib.nullcontext(calls.append(("context", s))),
                        report_loss=lambda loss: calls.append("report") or 2 * loss,
                        on_step=lambda s, loss: calls.append(("on_step", s, loss)))
    per_step = [[("before", s), ("context", s), "report", ("on_step", s, result.train_losses[s - 1])]
                for s in (1, 2, 3)]
    assert calls == [c for step in per_step for c in step]
    want, _, _ = _by_hand(vocab_size, dataclasses.replace(CFG, grad_clip=1.0))
    assert result.train_losses == [2 * loss for loss in want]  # report_loss decides what is recorded


def test_hooks_per_step_and_timeline(vocab_size):
    model, opt, ds = _setup(vocab_size)
    timeline, synced = Timeline(), []
    timed = StepHooks(timeline=timeline, sync_gradients=lambda: synced.append(1))
    result = train_loop(model, opt, ds, CFG, lambda step: timed if step == 2 else StepHooks())
    assert synced == [1] and {name for name, *_ in timeline.events} >= {"forward", "backward", "optimizer"}
    assert result.timeline_events is None  # the caller that chose the step keeps its timeline
    fixed = train_loop(*_setup(vocab_size), CFG, StepHooks(timeline=Timeline()))
    assert len([e for e in fixed.timeline_events if e[0] == "optimizer"]) == CFG.steps


def test_resume_from_a_later_step_equals_one_run(vocab_size):
    whole = train_loop(*_setup(vocab_size), CFG)
    model, opt, ds = _setup(vocab_size)
    gen = torch.Generator().manual_seed(CFG.seed)
    first = train_loop(model, opt, ds, CFG, generator=gen, last=1)
    rest = train_loop(model, opt, ds, CFG, generator=gen, first=2, result=first)
    assert rest is first and rest.train_losses == whole.train_losses


def test_train_step_takes_the_record_or_keywords_not_both(vocab_size):
    losses = []
    for use_record in (True, False):
        model, opt, ds = _setup(vocab_size)
        x, y = collate(ds, sample_indices(len(ds), 8, torch.Generator().manual_seed(0)))
        if use_record:
            losses.append(train_step(model, opt, x, y, 1.0, hooks=StepHooks(accum_steps=2)))
        else:
            losses.append(train_step(model, opt, x, y, 1.0, accum_steps=2))
    assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="not both"):
        train_step(model, opt, x, y, 1.0, hooks=StepHooks(), accum_steps=2)


@pytest.mark.parametrize("kwargs,message", [
    ({"accum_steps": 0}, "accum_steps=0 must be an int >= 1"),
    ({"accum_steps": True}, "accum_steps=True must be an int >= 1"),
    ({"sync_gradients": 3}, "sync_gradients=3 must be callable"),
    ({"forward_backward": lambda m, x, y: 0.0, "accum_steps": 2}, "forward_backward replaces the micro-batch loop"),
])
def test_step_hooks_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepHooks(**kwargs)


@pytest.mark.parametrize("changes,kwargs,message", [
    ({"steps": 0}, {}, "steps=0 must be an int >= 1"),
    ({"batch_size": 0}, {}, "batch_size=0 must be an int >= 1"),
    ({}, {"first": 0}, "first=0 must be an int >= 1"),
    ({}, {"last": 4}, r"last=4 must be an int in \[first - 1 = 0, steps = 3\]"),
    ({}, {"first": 3, "last": 1}, r"last=1 must be an int in \[first - 1 = 2"),
    ({}, {"rows": slice(4, 12)}, r"rows=slice\(4, 12, None\) must be a slice"),
    ({}, {"rows": [0, 1]}, "must be a slice"),
    ({}, {"hooks": {"accum_steps": 2}}, "must be a StepHooks or a function"),
    ({}, {"on_step": "print"}, "on_step='print' must be callable"),
])
def test_loop_refuses_bad_input_before_any_step(vocab_size, changes, kwargs, message):
    model, opt, ds = _setup(vocab_size)
    before, gen = flat_params(model), torch.Generator().manual_seed(0)
    state, calls = gen.get_state(), []
    with pytest.raises(ValueError, match=message):
        train_loop(model, opt, ds, dataclasses.replace(CFG, **changes), generator=gen,
                   before_step=lambda s: calls.append(s), **kwargs)
    # nothing ran: no step, no draw, no update
    assert calls == [] and torch.equal(gen.get_state(), state) and torch.equal(flat_params(model), before)


def test_hooks_function_must_return_a_record(vocab_size):
    with pytest.raises(ValueError, match=r"hooks\(1\) returned 7, not a StepHooks"):
        train_loop(*_setup(vocab_size), CFG, lambda step: 7)


def test_share_rows():
    assert share_rows(1, 4, 8) == slice(2, 4)
    with pytest.raises(ValueError, match="batch_size=6 must be divisible by 4"):
        share_rows(0, 4, 6)
    with pytest.raises(ValueError, match=r"index=4 must be an int in \[0, n=4\)"):
        share_rows(4, 4, 8)


def _global_loss_run(steps):
    """Rank code: a loop whose recorded loss is an all-reduce (a collective every step)."""
    model, opt, ds = _setup(VOCAB_SIZE)
    rank, n = dist.get_rank(), dist.get_world_size()

    def mean(loss):
        t = torch.tensor([loss / n], dtype=torch.float64, device=rank_device())  # NCCL: the rank's device
        dist.all_reduce(t)
        return t.item()

    cfg = dataclasses.replace(CFG, steps=steps)
    return train_loop(model, opt, ds, cfg, rows=share_rows(rank, n, cfg.batch_size), report_loss=mean).train_losses


def test_bad_input_refused_on_every_rank_before_a_collective():
    # every rank raises before its first all-reduce: the run fails at once, no rank waits for a peer
    with pytest.raises(RankError, match="steps=0 must be an int >= 1") as err:
        run_on_ranks(_global_loss_run, 0, world_size=2, timeout_s=60)
    assert sorted(err.value.failures) == [0, 1]
    losses = run_on_ranks(_global_loss_run, 2, world_size=2, timeout_s=60)
    assert losses[0] == losses[1] and len(losses[0]) == 2  # the global loss: the same on both ranks
