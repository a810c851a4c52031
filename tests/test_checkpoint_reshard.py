"""Distributed checkpoints: a resumed run equals an uninterrupted one (bit for bit at the same
layout, within float rounding when the world size changes), for data parallel (replicated), ZeRO-1
and ZeRO-3; ZeRO at 4 ranks -> 2; tensor parallel -> one process; DCP as the storage layer;
async saves."""

import sys

import cloudpickle
import pytest
import torch

from course_lib import run_on_ranks
from course_lib.checkpoint import CheckpointReader, checkpoint_path, load_training_state, save_training_state
from course_lib.checkpoint.training import read_events, train_with_checkpoints
from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, make_optimizer, train_step

from _tolerances import adamw_loss_atol, assert_adamw_params_close

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file

T = 16


def config(dropout=0.0):
    return GPTConfig.tiny(CharDataset("train", T).vocab_size, block_size=T, n_layer=1, d_model=32, n_head=2,
                          dropout=dropout)


def cfg(steps):
    return TrainConfig(steps=steps, batch_size=8, progress=False)


def run(world, model_config, steps, directory, every, layout, stage=1, **kw):
    return run_on_ranks(train_with_checkpoints, model_config, cfg(steps), str(directory), every, layout, stage,
                        world_size=world, timeout_s=180, **kw)


@pytest.mark.parametrize("layout,stage", [("replicated", 1), ("zero", 1), ("zero", 3)])
def test_resume_at_the_same_layout_is_bit_exact(layout, stage, tmp_path):
    """Dropout on: every rank's RNG state must come back too."""
    c = config(dropout=0.1)
    full = run(2, c, 6, tmp_path / "full", 0, layout, stage)
    run(2, c, 3, tmp_path / "cut", 3, layout, stage)  # stops after the checkpoint of step 3
    resumed = run(2, c, 6, tmp_path / "cut", 0, layout, stage)
    assert [e["event"] for e in read_events(tmp_path / "cut")] == ["save", "resume"]
    assert resumed[0].train_losses == full[0].train_losses
    for a, b in zip(full, resumed):
        assert torch.equal(a.final_params, b.final_params)


@pytest.mark.parametrize("saved,loaded", [(("zero", 3, 4), ("zero", 3, 2)), (("zero", 1, 2), ("zero", 1, 4)),
                                          (("replicated", 1, 4), ("zero", 1, 2))])
def test_resharding_continues_as_if_never_interrupted(saved, loaded, tmp_path):
    """Saved at one layout and world size, resumed at another: the losses and parameters match
    the uninterrupted run at the first layout up to float rounding (the gradient is averaged
    over a different number of ranks, so the additions happen in another order). Stages 1 and 3
    are not mixed here: apply_zero's stage 3 decays every parameter, the stage-1 loop (like the
    reference) only the matrices, so their runs differ whatever the checkpoint does."""
    c = config()
    (lay0, st0, n0), (lay1, st1, n1) = saved, loaded
    full = run(n0, c, 6, tmp_path / "full", 0, lay0, st0)
    run(n0, c, 3, tmp_path / "cut", 3, lay0, st0)
    resumed = run(n1, c, 6, tmp_path / "cut", 0, lay1, st1)
    assert resumed[0].train_losses[:3] == full[0].train_losses[:3]  # restored from the checkpoint
    # Steps 4-6 from the same state, the gradient summed over n1 ranks instead of n0: fp32
    # rounding, which AdamW magnifies near g = 0 (tests/_tolerances). Losses within what such a
    # moved element can shift them by; parameters bounded by AdamW's step and in RMS to lr/100
    # (a lost optimizer state or a wrong shard moves most elements by ~lr).
    lr, betas = cfg(6).lr, cfg(6).betas
    assert resumed[0].train_losses[3:] == pytest.approx(full[0].train_losses[3:], abs=adamw_loss_atol(lr))
    assert_adamw_params_close(resumed[0].final_params, full[0].final_params, lr, steps=3, betas=betas, first_step=4,
                              msg=f"{saved} -> {loaded}")
    # not a tolerance: the runs really summed in another order (some element is >= 1 ulp apart,
    # ~2e-9 at 0.02), so the comparison above is not of a run with itself
    assert not torch.allclose(resumed[0].final_params, full[0].final_params, atol=1e-9, rtol=0)


def test_zero_ranks_read_only_the_files_they_overlap(tmp_path):
    """ZeRO-3 saved at 4 ranks: a ZeRO-3 rank at 4 ranks reads one file of the model's units,
    not all four (each rank's boxes were written by the rank that owned them)."""
    c = config()
    run(4, c, 1, tmp_path, 1, "zero", 3)
    reader = CheckpointReader(checkpoint_path(tmp_path, 1))
    files = {p["file"] for m in reader.tensors.values() for p in m["pieces"]}
    assert files == {f"rank{r:05d}.pt" for r in range(4)} and reader.world_size == 4

    def read(path):
        from course_lib.checkpoint.training import _build

        model = GPT(c, seed=1)
        opt = _build(model, cfg(1), "zero", 3, None)[0]
        return load_training_state(path, model, opt, "zero").bytes_read

    total = sum((checkpoint_path(tmp_path, 1) / f).stat().st_size for f in files)
    read_bytes = run_on_ranks(read, str(checkpoint_path(tmp_path, 1)), world_size=4, timeout_s=120)
    assert max(read_bytes) < total  # no rank needed every file


def test_async_save_resumes_bit_exact(tmp_path):
    c = config(dropout=0.1)
    full = run(2, c, 6, tmp_path / "full", 0, "zero", 1)
    run(2, c, 4, tmp_path / "cut", 2, "zero", 1, async_save=True)
    resumed = run(2, c, 6, tmp_path / "cut", 0, "zero", 1)
    assert read_events(tmp_path / "cut")[-1] == {"event": "resume", "step": 4, "world_size": 2,
                                                 "saved_world_size": 2, "path": "step_00000004"}
    assert resumed[0].train_losses == full[0].train_losses


# ------------------------------------------------------------------ tensor parallel -> one process
def tp_train_and_save(model_config, path, steps_before, steps_after):
    from course_lib.parallel.tp import apply_tensor_parallel, clip_grad_norm_, gather_full_state_dict

    model = apply_tensor_parallel(GPT(model_config, seed=0))
    opt = make_optimizer(model, cfg(1))
    ds, gen = CharDataset("train", T), torch.Generator().manual_seed(0)
    for _ in range(steps_before):
        train_step(model, opt, *get_batch(ds, 8, gen), 1.0, clip_grad_norm=lambda c: clip_grad_norm_(model, c))
    save_training_state(path, steps_before, model, opt, "tp", gen)
    saved = gather_full_state_dict(model)
    fresh = apply_tensor_parallel(GPT(model_config, seed=7))  # the round trip at the same layout
    fresh_opt = make_optimizer(fresh, cfg(1))
    load_training_state(path, fresh, fresh_opt, "tp")
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters())) and all(
        torch.equal(opt.state[p][k], fresh_opt.state[q][k])
        for p, q in zip(model.parameters(), fresh.parameters()) for k in opt.state[p])
    for _ in range(steps_after):
        train_step(model, opt, *get_batch(ds, 8, gen), 1.0, clip_grad_norm=lambda c: clip_grad_norm_(model, c))
    return saved, gather_full_state_dict(model), same


def test_tensor_parallel_checkpoint_round_trip_and_into_one_process(tmp_path):
    c = config()
    path = tmp_path / "tp"
    results = run_on_ranks(tp_train_and_save, c, str(path), 2, 2, world_size=2, timeout_s=180)
    assert [r[2] for r in results] == [True, True]  # bit-exact at tp=2: shards and Adam state
    saved, final, _ = results[0]
    reader = CheckpointReader(path)
    qkv = reader.tensors["model.blocks.0.attn.qkv.weight"]
    assert qkv["shape"] == [3 * c.d_model, c.d_model] and len(qkv["pieces"]) == 6  # Q, K, V runs of 2 ranks
    assert reader.tensors["model.tok_emb.weight"]["shape"] == [c.vocab_size, c.d_model]  # padding dropped

    model = GPT(c, seed=7)
    opt, gen = make_optimizer(model, cfg(1)), torch.Generator()
    info = load_training_state(path, model, opt, "replicated", gen)
    assert info.step == 2 and info.saved_world_size == 2
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
    ds = CharDataset("train", T)
    for _ in range(2):
        train_step(model, opt, *get_batch(ds, 8, gen), 1.0)
    # Adam's moments came back too: training continues alike, up to the tp ranks' other order of
    # sums, magnified by AdamW near g = 0 (bounded by AdamW's step, in RMS to lr/100)
    names = [n for n, _ in model.named_parameters()]
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([final[n].reshape(-1) for n in names])
    assert_adamw_params_close(got, want, cfg(1).lr, steps=2, betas=cfg(1).betas, first_step=3, msg="tp2 -> 1")


# ------------------------------------------------------------------ torch.distributed.checkpoint
def dcp_save_then_reload(src, dst, save_stage, world_to_check):
    """Load a course checkpoint, save it with DCP, and return every piece (to compare)."""
    from course_lib.checkpoint.dcp import save_with_dcp
    from course_lib.checkpoint.state import training_state_pieces
    from course_lib.checkpoint.training import _build

    model = GPT(config(), seed=5)
    opt = _build(model, cfg(1), "zero", save_stage, None)[0]
    load_training_state(src, model, opt, "zero")
    save_with_dcp(dst, training_state_pieces(model, opt, "zero")[1], {"step": torch.tensor(3)})


def dcp_load(src, dst, stage):
    from course_lib.checkpoint.dcp import load_with_dcp
    from course_lib.checkpoint.layouts import describe_layout, materialize_state
    from course_lib.checkpoint.state import training_state_pieces
    from course_lib.checkpoint.training import _build

    out = []
    for load in ("course", "dcp"):
        model = GPT(config(), seed=9)
        opt = _build(model, cfg(1), "zero", stage, None)[0]
        if load == "course":
            load_training_state(src, model, opt, "zero")
            step = 3
        else:
            materialize_state(describe_layout(model, opt, "zero"), CheckpointReader(src).tensors)
            step = load_with_dcp(dst, training_state_pieces(model, opt, "zero", for_load=True)[1],
                                 {"step": torch.tensor(0)})["step"].item()
        out.append((step, [p.tensor.clone() for p in training_state_pieces(model, opt, "zero")[1]]))
    return out


def test_dcp_storage_layer_reshards_zero1_at_2_to_zero3_at_4(tmp_path):
    c = config()
    run(4, c, 3, tmp_path, 3, "zero", 3)
    src, dst = str(checkpoint_path(tmp_path, 3)), str(tmp_path / "dcp")
    # DCP's planner issues its own collectives; check_collectives's extra gathers do not fit them
    run_on_ranks(dcp_save_then_reload, src, dst, 1, 2, world_size=2, timeout_s=180, check_collectives=False)
    assert (tmp_path / "dcp" / ".metadata").exists()
    results = run_on_ranks(dcp_load, src, dst, 3, world_size=4, timeout_s=180, check_collectives=False)
    for (step_a, course), (step_b, dcp) in results:
        assert step_a == step_b == 3 and len(course) == len(dcp)
        assert all(torch.equal(a, b) for a, b in zip(course, dcp))
