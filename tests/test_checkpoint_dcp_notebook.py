"""torch.distributed.checkpoint on FSDP2's DTensor state dict (course_lib.checkpoint.dcp, notebook
12 section 7): saved on one world size, loaded on another, every value equal bit for bit."""

import pytest
import torch

from course_lib import run_on_ranks
from course_lib.checkpoint.dcp import dcp_chunks, fsdp2_dcp_load, fsdp2_dcp_save
from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig

VOCAB = CharDataset("train", 16).vocab_size  # 97 rows: no world size below divides it evenly


def config():
    return GPTConfig.tiny(VOCAB, block_size=16, n_layer=1, n_head=2, d_model=16)


def test_dcp_saves_fsdp2_on_2_ranks_and_loads_on_3_bit_for_bit(tmp_path):
    cfg = TrainConfig(steps=2, batch_size=6, progress=False)
    sync, later = tmp_path / "sync", tmp_path / "async"
    # as in the notebook: no per-collective check for FSDP2's and DCP's many small collectives
    saved = run_on_ranks(fsdp2_dcp_save, config(), cfg, str(sync), str(later), world_size=2, timeout_s=180,
                         check_collectives=False)
    values = saved[0]["values"]
    assert saved[1]["values"] == {}  # the full state is gathered on rank 0 only
    assert all(saved[0][k] >= 0 for k in ("save_s", "async_blocked_s", "async_total_s"))
    # FSDP2 cuts dim 0 into ceil(97 / 2) = 49 rows and 48; DCP writes each rank's rows once
    assert dcp_chunks(sync, "model.tok_emb.weight") == [("__0_0.distcp", [0, 0], [49, 16]),
                                                         ("__1_0.distcp", [49, 0], [48, 16])]
    assert len(dcp_chunks(sync, "optim.state.tok_emb.weight.step")) == 1  # replicated: written once
    with pytest.raises(KeyError, match="not in the DCP checkpoint"):
        dcp_chunks(sync, "model.no_such_weight")
    # the fresh model of the load differs, so equality below comes from the checkpoint
    fresh = GPT(config(), seed=cfg.seed + 1).state_dict()
    assert not torch.equal(fresh["tok_emb.weight"], values["model.tok_emb.weight"])
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg") for k in values)
    loaded = run_on_ranks(fsdp2_dcp_load, config(), cfg, [str(sync), str(later)], world_size=3, timeout_s=180,
                          check_collectives=False)[0]
    for got in loaded:
        assert got.keys() == values.keys()
        for k, v in values.items():
            assert (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v), k
