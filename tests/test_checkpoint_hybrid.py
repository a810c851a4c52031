"""Checkpoints of composed layouts (course_lib.parallel.hybrid: dp x tp x pp, ZeRO-1 or not):
saved at one 3D layout, loaded into one process and into another 3D layout, by global offsets;
training continues as if never interrupted (to float rounding)."""

import sys
from dataclasses import replace

import cloudpickle
import pytest
import torch

from course_lib import run_on_ranks
from course_lib.checkpoint import CheckpointReader, load_training_state
from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.hybrid import ParallelDims
from course_lib.train import TrainConfig, make_optimizer, train_step

from _tolerances import assert_adamw_params_close

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file

T, B = 16, 8
CONFIG = GPTConfig.tiny(CharDataset("train", T).vocab_size, block_size=T, n_layer=2, d_model=32, n_head=2)
TRAIN = TrainConfig(steps=1, batch_size=B, progress=False)
LAYOUTS = {"dp2 x tp2, ZeRO-1": ParallelDims(dp=2, tp=2, zero=1),
           "tp2 x pp2": ParallelDims(tp=2, pp=2, microbatches=2)}


def hybrid_steps(dims, save_to, steps_before, steps_after, load_from=None):
    """Rank code: build the composed model, (load,) train, (save,) train on; returns the
    single-process parameters this rank owns, at the save and at the end."""
    from course_lib.checkpoint import load_training_state, save_training_state
    from course_lib.parallel.hybrid import (build_hybrid, clip_grad_norm_hybrid, make_hybrid_optimizer,
                                            sync_gradients, trained_module)
    from course_lib.parallel.pp import run_schedule
    from course_lib.parallel.tp import gather_full_state_dict

    parts = build_hybrid(dims, CONFIG, seed=0)
    opt = make_hybrid_optimizer(parts, TRAIN)
    ds, gen = CharDataset("train", T), torch.Generator().manual_seed(0)
    share = B // dims.replicas  # replica r = dp_index * ep + ep_index (hybrid/training.py)
    replica = parts.coords["dp"] * dims.ep + parts.coords["ep"]
    rows = slice(replica * share, (replica + 1) * share)

    def forward_backward(_module, x, y):
        if parts.stage is not None:
            loss = run_schedule(parts.stage, x, y, dims.schedule, dims.microbatches)
        else:
            loss = parts.model(x, y)[1]
            loss.backward()
            loss = loss.item()
        sync_gradients(parts)
        return loss

    def step():
        x, y = get_batch(ds, B, gen)
        train_step(trained_module(parts), opt, x[rows], y[rows], 1.0, forward_backward=forward_backward,
                   clip_grad_norm=lambda c: clip_grad_norm_hybrid(parts, c))

    def owned():
        full = gather_full_state_dict(parts.model) if dims.tp > 1 else dict(parts.model.named_parameters())
        keep = set(parts.stage.param_names) if parts.stage is not None else {n for n, _ in parts.model.named_parameters()}
        return {n: t.detach().clone() for n, t in full.items() if n in keep}

    if load_from is not None:
        load_training_state(load_from, parts, opt, "hybrid", gen)
    for _ in range(steps_before):
        step()
    if save_to is not None:
        save_training_state(save_to, steps_before, parts, opt, "hybrid", gen)
    saved = owned()
    for _ in range(steps_after):
        step()
    return saved, owned()


def assert_continued_alike(got: dict, want: dict, msg: str) -> None:
    """Two runs that took AdamW steps 3 and 4 from the same saved state (bit for bit: checked
    before), their gradients summed in another order: AdamW magnifies that rounding where a
    gradient is near 0 (tests/_tolerances), so element by element at most what AdamW can move an
    element, and in RMS a hundredth of lr. A lost Adam state or data position moves most by ~lr."""
    names = sorted(got)
    assert set(names) <= set(want), set(names) - set(want)
    flat = [torch.cat([d[n].detach().reshape(-1) for n in names]) for d in (got, want)]
    assert_adamw_params_close(*flat, lr=TRAIN.lr, steps=2, betas=TRAIN.betas, first_step=3, msg=msg)


def run(dims, *args):
    results = run_on_ranks(hybrid_steps, dims, *args, world_size=dims.world_size, timeout_s=180)
    merged = [{}, {}]
    for r in results:
        for i in (0, 1):
            for k, v in r[i].items():
                merged[i].setdefault(k, v)
    return merged


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_3d_checkpoint_loads_into_one_process_and_training_continues(name, tmp_path):
    saved, final = run(LAYOUTS[name], str(tmp_path), 2, 2)
    assert CheckpointReader(tmp_path).world_size == 4
    model = GPT(CONFIG, seed=9)
    opt, gen = make_optimizer(model, TRAIN), torch.Generator()
    load_training_state(tmp_path, model, opt, "replicated", gen)
    for n, p in model.named_parameters():
        assert torch.equal(p, saved[n]), n
    ds = CharDataset("train", T)
    for _ in range(2):
        train_step(model, opt, *get_batch(ds, B, gen), 1.0)
    # Adam's state and the data position came back too
    assert_continued_alike(dict(model.named_parameters()), final, name)


def test_3d_checkpoint_resharded_to_another_3d_layout(tmp_path):
    saved, final = run(LAYOUTS["dp2 x tp2, ZeRO-1"], str(tmp_path), 2, 2)
    loaded, continued = run(LAYOUTS["tp2 x pp2"], None, 0, 2, str(tmp_path))
    assert set(loaded) == set(saved)
    for n in saved:
        assert torch.equal(loaded[n], saved[n]), n
    assert_continued_alike(continued, final, "dp2 x tp2 -> tp2 x pp2")


MOE = replace(CONFIG, n_experts=4, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.0)


def test_expert_parallel_checkpoint_resumes_at_another_ep_and_world_size(tmp_path, monkeypatch):
    """Saved at dp2 x ep2 x pp2 (8 ranks, ZeRO-1), loaded at dp1 x ep4 (4 ranks): every expert
    comes back by its single-process name, and training continues as if never interrupted."""
    monkeypatch.setattr(sys.modules[__name__], "CONFIG", MOE)  # hybrid_steps reads CONFIG
    saved, final = run(ParallelDims(dp=2, ep=2, pp=2, zero=1, microbatches=2), str(tmp_path), 2, 2)
    assert CheckpointReader(tmp_path).world_size == 8
    assert "blocks.1.mlp.experts.mlps.3.fc.weight" in saved
    loaded, continued = run(ParallelDims(dp=1, ep=4, zero=0), None, 0, 2, str(tmp_path))
    assert set(loaded) == set(saved)
    for n in saved:
        assert torch.equal(loaded[n], saved[n]), n
    assert_continued_alike(continued, final, "dp2 x ep2 x pp2 -> ep4")
