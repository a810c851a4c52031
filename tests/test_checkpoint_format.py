"""course_lib.checkpoint in one process: box math, the format's round trip, every corruption case
named, atomic directories, argument checks, and the checkpoint-interval formulas."""

import json
import math
import shutil

import pytest
import torch

from course_lib.checkpoint import (Box, CheckpointError, checkpoint_path, complete_checkpoints,
                                   flat_range_boxes, index_runs, latest_checkpoint, load_training_state, prune,
                                   save_training_state, whole)
from course_lib.checkpoint.atomic import prepare_staging, staging_path
from course_lib.checkpoint.format import _plan
from course_lib.checkpoint.interval import (llama3_job_mtbf_hours, wasted_fraction, young_daly_interval)
from course_lib.checkpoint.reshard import copy_overlaps
from course_lib.checkpoint.training import check_checkpoint_run
from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig, make_optimizer, train_step


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 1, 3)])
def test_flat_range_boxes_tile_the_range_in_order(shape):
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1, 3):
            covered = []
            for box, pos in flat_range_boxes(shape, start, stop):
                assert box.inside(shape)
                block = full[box.slices()]
                # the box is exactly the flat slice [pos, pos + volume)
                assert torch.equal(block.reshape(-1), torch.arange(pos, pos + box.volume))
                covered += block.reshape(-1).tolist()
            assert covered == list(range(start, stop))


def test_flat_range_boxes_is_at_most_three_boxes_of_a_matrix():
    boxes = flat_range_boxes((4, 5), 3, 17)
    assert [(b.offsets, b.lengths) for b, _ in boxes] == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]


def test_index_runs_split_qkv_like_tables_and_drop_padding():
    # rank 1 of tp=2 over fused qkv with d=4: rows 2,3 (Q) 6,7 (K) 10,11 (V)
    assert index_runs([2, 3, 6, 7, 10, 11], 12) == [(2, 0, 2), (6, 2, 2), (10, 4, 2)]
    assert index_runs([48, 49, 50, 51], 50) == [(48, 0, 2)]  # padded vocabulary rows dropped


def test_box_intersection_and_copy():
    a, b = Box((0, 2), (3, 4)), Box((1, 0), (4, 3))
    assert a.intersect(b) == Box((1, 2), (2, 1))
    assert a.intersect(Box((3, 0), (1, 1))) is None
    glob = torch.arange(30.).view(5, 6)
    dst = torch.zeros(4, 3)
    written = copy_overlaps(dst, b, [(a, glob[a.slices()]), (Box((0, 0), (5, 2)), glob[:, :2])])
    assert written == 2 * 1 + 4 * 2  # rows 1-2 of col 2, rows 1-4 of cols 0-1; rows 3-4 of col 2 uncovered
    assert torch.equal(dst[:, :2], glob[1:5, :2]) and torch.equal(dst[:2, 2], glob[1:3, 2])
    assert torch.equal(dst[2:, 2], torch.zeros(2))
    assert whole(()).volume == 1


def test_plan_keeps_one_copy_of_replicated_boxes_and_rejects_gaps_and_partial_overlaps():
    rep = ("w", (2, 2), "float32", (0, 0), (2, 2))
    tensors, keep = _plan([[rep], [rep]], 2)
    assert keep == [[0], []] and len(tensors["w"]["pieces"]) == 1
    with pytest.raises(ValueError, match="cover 2 of its 4 elements"):
        _plan([[("w", (2, 2), "float32", (0, 0), (1, 2))], []], 2)
    with pytest.raises(ValueError, match="partly overlaps"):
        _plan([[("w", (2, 2), "float32", (0, 0), (2, 2))], [("w", (2, 2), "float32", (1, 0), (1, 2))]], 2)
    with pytest.raises(ValueError, match="ranks disagree about w"):
        _plan([[rep], [("w", (2, 3), "float32", (0, 0), (2, 3))]], 2)


# ------------------------------------------------------------------ one process: round trip
@pytest.fixture(scope="module")
def small():
    config = GPTConfig.tiny(CharDataset("train", 16).vocab_size, block_size=16, n_layer=1, d_model=32, n_head=2,
                            dropout=0.1)
    return config, TrainConfig(steps=2, batch_size=4, progress=False)


def _trained(config, cfg, steps, gen=None):
    torch.manual_seed(0)
    model = GPT(config, seed=0)
    opt = make_optimizer(model, cfg)
    ds, gen = CharDataset("train", config.block_size), gen or torch.Generator().manual_seed(0)
    losses = [train_step(model, opt, *get_batch(ds, cfg.batch_size, gen), 1.0) for _ in range(steps)]
    return model, opt, gen, losses


def test_round_trip_is_bit_exact_and_training_continues_identically(small, tmp_path):
    config, cfg = small
    model, opt, gen, _ = _trained(config, cfg, 2)
    path = save_training_state(checkpoint_path(tmp_path, 2), 2, model, opt, "replicated", gen, extra={"note": "x"})
    after_save = [train_step(model, opt, *get_batch(CharDataset("train", 16), 4, gen), 1.0) for _ in range(2)]

    fresh = GPT(config, seed=123)
    fresh_opt, fresh_gen = make_optimizer(fresh, cfg), torch.Generator().manual_seed(99)
    torch.manual_seed(5)  # a different dropout RNG: the load must restore it
    info = load_training_state(path, fresh, fresh_opt, "replicated", fresh_gen)
    assert (info.step, info.saved_world_size, info.rng_restored, info.extra) == (2, 1, True, {"note": "x"})
    resumed = [train_step(fresh, fresh_opt, *get_batch(CharDataset("train", 16), 4, fresh_gen), 1.0)
               for _ in range(2)]
    assert resumed == after_save  # bit-exact: weights, Adam moments and step, data position, dropout RNG
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_forgetting_the_optimizer_state_changes_the_run(small, tmp_path):
    """The test above can fail: a load without Adam's moments diverges at once."""
    config, cfg = small
    model, opt, gen, _ = _trained(config, cfg, 2)
    path = save_training_state(tmp_path / "c", 2, model, opt, "replicated", gen)
    train_step(model, opt, *get_batch(CharDataset("train", 16), 4, gen), 1.0)
    fresh, gen2 = GPT(config, seed=1), torch.Generator()
    load_training_state(path, fresh, None, "replicated", gen2)
    train_step(fresh, make_optimizer(fresh, cfg), *get_batch(CharDataset("train", 16), 4, gen2), 1.0)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


# ------------------------------------------------------------------ corruption, each named
@pytest.fixture
def saved(small, tmp_path):
    config, cfg = small
    model, opt, gen, _ = _trained(config, cfg, 1)
    path = save_training_state(checkpoint_path(tmp_path, 1), 1, model, opt, "replicated", gen)
    return config, cfg, path


def _load(config, cfg, path):
    model = GPT(config, seed=0)
    return load_training_state(path, model, make_optimizer(model, cfg), "replicated", torch.Generator())


def _meta(path):
    return json.loads((path / "metadata.json").read_text())


def test_incomplete_checkpoint_without_metadata(saved):
    config, cfg, path = saved
    (path / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint: .*metadata\.json is missing"):
        _load(config, cfg, path)


def test_interrupted_save_leaves_only_a_partial_directory(saved):
    config, cfg, path = saved
    final = checkpoint_path(path.parent, 7)
    prepare_staging(final)
    assert latest_checkpoint(path.parent) == path  # the partial one is never picked
    with pytest.raises(CheckpointError, match=r"step_00000007 does not exist \(a save was interrupted"):
        _load(config, cfg, final)


def test_missing_shard(saved):
    config, cfg, path = saved
    (path / "rank00000.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard: .*rank00000\.pt is listed"):
        _load(config, cfg, path)


def test_truncated_file(saved):
    config, cfg, path = saved
    data = (path / "rank00000.pt").read_bytes()
    (path / "rank00000.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"truncated file: .*rank00000\.pt has {len(data) // 2} bytes"):
        _load(config, cfg, path)


def test_flipped_bit_is_caught_by_the_checksum(saved):
    config, cfg, path = saved
    data = bytearray((path / "rank00000.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / "rank00000.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupted file: the SHA-256 of .*rank00000\.pt differs"):
        _load(config, cfg, path)


def test_metadata_that_does_not_match_the_file(saved):
    config, cfg, path = saved
    meta = _meta(path)
    meta["tensors"]["model.tok_emb.weight"]["pieces"][0]["lengths"][0] -= 1
    meta["tensors"]["model.tok_emb.weight"]["shape"][0] -= 1
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"metadata mismatch: .*metadata\.json says model\.tok_emb\.weight"):
        _load(config, cfg, path)
    model = GPT(config, seed=0)  # a model of the (wrong) recorded shape reaches the file check
    model.tok_emb.weight = torch.nn.Parameter(torch.zeros(config.vocab_size - 1, config.d_model))
    with pytest.raises(CheckpointError, match=r"metadata mismatch: piece \d+ of .*rank00000\.pt is"):
        load_training_state(path, model, None, "replicated")


def test_metadata_missing_a_piece_is_not_a_silent_partial_load(saved):
    config, cfg, path = saved
    meta = _meta(path)
    meta["tensors"]["model.ln_f.weight"]["pieces"] = []
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"pieces of model\.ln_f\.weight .* cover 0 of the 32 elements"):
        _load(config, cfg, path)


def test_corrupted_metadata_json(saved):
    config, cfg, path = saved
    (path / "metadata.json").write_text('{"format": "course_lib.checkpoint/1", "tens')
    with pytest.raises(CheckpointError, match=r"corrupted metadata: .*metadata\.json is not valid JSON"):
        _load(config, cfg, path)


def test_a_model_of_another_shape(saved):
    config, cfg, path = saved
    other = GPTConfig.tiny(config.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2)
    with pytest.raises(CheckpointError, match=r"metadata mismatch: .*says model\.tok_emb\.weight has global shape"):
        load_training_state(path, GPT(other, seed=0), None, "replicated")


class NotATensor:
    pass


def test_loads_refuse_pickled_code_even_with_a_valid_checksum(saved):
    """weights_only=True: a file whose hash matches (an attacker rewrote the metadata too) but
    holds an arbitrary object does not get unpickled."""
    import hashlib
    import io

    config, cfg, path = saved
    buf = io.BytesIO()
    torch.save({"pieces": [], "objects": {"step": NotATensor()}}, buf)
    (path / "rank00000.pt").write_bytes(buf.getvalue())
    meta = _meta(path)
    meta["files"]["rank00000.pt"] = {"bytes": len(buf.getvalue()), "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"corrupted file: .*rank00000\.pt cannot be loaded"):
        _load(config, cfg, path)


# ------------------------------------------------------------------ atomic directories
def test_complete_checkpoints_prune_and_resave(saved):
    config, cfg, path = saved
    root = path.parent
    model, opt, gen, _ = _trained(config, cfg, 1)
    for step in (2, 3):
        save_training_state(checkpoint_path(root, step), step, model, opt, "replicated", gen)
    save_training_state(checkpoint_path(root, 3), 3, model, opt, "replicated", gen)  # the same step again
    assert [s for s, _ in complete_checkpoints(root)] == [1, 2, 3]
    assert not staging_path(checkpoint_path(root, 3)).exists()
    prune(root, keep=2)
    assert [s for s, _ in complete_checkpoints(root)] == [2, 3]
    shutil.rmtree(checkpoint_path(root, 2))
    assert latest_checkpoint(root) == checkpoint_path(root, 3)
    assert latest_checkpoint(root / "nothing") is None


def test_run_arguments_are_checked_in_the_parent():
    cfg = TrainConfig(steps=10, batch_size=8)
    with pytest.raises(ValueError, match="batch_size=8 must be divisible by world_size=3"):
        check_checkpoint_run(cfg, 3, 2)
    with pytest.raises(ValueError, match="kill_rank=2 must be in"):
        check_checkpoint_run(cfg, 2, 2, kill_rank=2, kill_at_step=3)
    with pytest.raises(ValueError, match="kill_at_step=11 must be in"):
        check_checkpoint_run(cfg, 2, 2, kill_rank=1, kill_at_step=11)
    with pytest.raises(ValueError, match="layout='tp' must be one of"):
        check_checkpoint_run(cfg, 2, 2, layout="tp")
    with pytest.raises(ValueError, match=r"flat range \[3, 30\) must lie in"):
        flat_range_boxes((4, 5), 3, 30)


def test_young_daly_interval_minimises_the_waste():
    delta, mtbf = 30.0, llama3_job_mtbf_hours() * 3600
    # float64 formulas evaluated in another order: ~1e-16 relative apart; approx's default 1e-6
    # relative is far above that and far below any wrong formula (a factor, a missing sqrt)
    assert llama3_job_mtbf_hours() == pytest.approx(54 * 24 / 466)
    tau = young_daly_interval(delta, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * delta * mtbf))
    best = wasted_fraction(tau, delta, mtbf)
    assert best == pytest.approx(math.sqrt(2 * delta / mtbf))
    assert all(wasted_fraction(tau * f, delta, mtbf) > best for f in (0.5, 0.9, 1.1, 2.0))
    with pytest.raises(ValueError, match="save_seconds=0"):
        young_daly_interval(0, mtbf)
