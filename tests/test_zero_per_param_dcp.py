"""Per-parameter stage 3 saved with torch.distributed.checkpoint at one world size and loaded at another
(course_lib.checkpoint.per_param): 2 -> 3 -> 2 ranks, uneven shards, the training continued after
each load equal to one uninterrupted single process over the same data.

One launch of 3 ranks runs the whole chain (ranks 0 and 1 alone are the world of 2, a subgroup):

    steps 1-2 on 2 ranks ("block" units) -> save a -> load a on 3 ranks (Linear/Embedding units: the
    LayerNorms replicated) -> steps 3-4 -> save b -> load b on 2 ranks ("block") -> steps 5-6

Every load is compared bit for bit with what was saved (parameters and AdamW's m, v and step, gathered
to full tensors by name), and a load with a wrong offset (ranks 0 and 1 swapped in the mesh, so rank 0
reads rows [c, 2c) instead of [0, c)) is shown to fail that comparison.
"""

import os
import sys
from types import SimpleNamespace

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import run_on_ranks
from course_lib.checkpoint.dcp import dcp_chunks
from course_lib.checkpoint.per_param import (check_per_param_checkpoint, full_optimizer_state, load_per_param,
                                             save_per_param)
from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.parallel.zero import apply_zero, full_state_dict, train_zero_reference
from course_lib.parallel.zero.training import default_optimizer_kwargs
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainConfig, share_rows, train_loop

from _tolerances import adamw_loss_atol, assert_adamw_params_close

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)
from _zero_setup import uneven_config  # noqa: E402

STEPS = 6  # two on each world size


def _chain(config, cfg, root):
    """Rank code (3 ranks): the chain of the module docstring; each rank returns its losses, the full
    states it gathered (by name) and the steps its loads returned."""
    import course_lib.checkpoint.per_param as cp
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 use it as their world
    ds = CharDataset("train", block_size=config.block_size)
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    out = {"losses": {}, "states": {}, "steps": {}}

    def build(group, seed, policy):  # another seed each time: whatever matches came from the checkpoint
        return apply_zero(GPT(config, seed=seed), 3, torch.optim.AdamW, group, sharding="per_param", policy=policy,
                          **default_optimizer_kwargs(cfg))

    def state(model, opt):
        return {"params": full_state_dict(model, opt), "optim": full_optimizer_state(model, opt)}

    def train(model, opt, group, gen, first, last):
        n = dist.get_world_size(group)

        def mean(loss):  # the global loss: the mean of the ranks' shares
            t = torch.tensor([loss / n], dtype=torch.float64, device=rank_device())  # NCCL: the rank's device
            dist.all_reduce(t, group=group)
            return t.item()

        res = train_loop(model, opt, ds, cfg, StepHooks(), rows=share_rows(dist.get_rank(group), n, cfg.batch_size),
                         generator=gen, first=first, last=last, report_loss=mean)
        out["losses"].update(zip(range(first, last + 1), res.train_losses))

    if rank < 2:  # world 2
        model, opt = build(pair, cfg.seed, "block")
        gen = torch.Generator().manual_seed(cfg.seed)
        train(model, opt, pair, gen, 1, 2)
        save_per_param(a, model, opt, 2, gen)
        out["states"]["saved a"] = state(model, opt)
    dist.barrier()
    # world 3
    model, opt = build(None, cfg.seed + 1, (nn.Linear, nn.Embedding))
    gen = torch.Generator()
    out["steps"]["a"] = load_per_param(a, model, opt, gen)
    out["states"]["loaded a"] = state(model, opt)
    train(model, opt, None, gen, 3, 4)
    save_per_param(b, model, opt, 4, gen)
    out["states"]["saved b"] = state(model, opt)
    # the control: DTensor places rank r's rows by r's coordinate in the mesh; swap ranks 0 and 1
    real = cp.dcp_mesh
    wrong = DeviceMesh(rank_device().type, [1, 0, 2])  # collective: every rank builds it
    cp.dcp_mesh = lambda sharded: (wrong, real(sharded)[1])
    try:
        model_w, opt_w = build(None, cfg.seed + 1, "block")
        load_per_param(a, model_w, opt_w)
        out["states"]["wrong offset a"] = state(model_w, opt_w)
    finally:
        cp.dcp_mesh = real
    dist.barrier()
    if rank < 2:  # world 2 again
        model, opt = build(pair, cfg.seed + 2, "block")
        gen = torch.Generator()
        out["steps"]["b"] = load_per_param(b, model, opt, gen)
        out["states"]["loaded b"] = state(model, opt)
        train(model, opt, pair, gen, 5, 6)
        out["final"] = full_state_dict(model, opt)
    dist.barrier()
    return out


def differences(got, want) -> list[str]:
    """Names (and state keys) whose full tensors are not bit for bit equal."""
    bad = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
    assert sorted(got["optim"]) == sorted(want["optim"])
    for n, st in want["optim"].items():
        assert sorted(got["optim"][n]) == sorted(st) == ["exp_avg", "exp_avg_sq", "step"], n
        bad += [f"{n}.{k}" for k, v in st.items() if not torch.equal(got["optim"][n][k], v)]
    return bad


def test_per_param_dcp_resharded_2_to_3_to_2_continues_like_one_process(tmp_path):
    config = uneven_config()
    cfg = TrainConfig(steps=STEPS, batch_size=12, lr=3e-3, grad_clip=0.0, eval_every=10**6, progress=False)
    per_rank = run_on_ranks(_chain, config, cfg, str(tmp_path), world_size=3, timeout_s=240,
                            check_collectives=False)  # DCP's planner issues its own collectives
    out = per_rank[0]
    assert out["steps"] == {"a": 2, "b": 4}
    # the rule, read back from DCP's metadata: rank j's rows start at j * ceil(97 / S), the padding unsaved
    assert dcp_chunks(tmp_path / "a", "model.tok_emb.weight") == [("__0_0.distcp", [0, 0], [49, 64]),
                                                                  ("__1_0.distcp", [49, 0], [48, 64])]
    assert [c[1:] for c in dcp_chunks(tmp_path / "b", "model.blocks.0.mlp.fc.weight")] == \
        [([0, 0], [43, 64]), ([43, 0], [43, 64]), ([86, 0], [41, 64])]
    assert [c[1:] for c in dcp_chunks(tmp_path / "b", "model.ln_f.weight")] == [([0], [64])]  # replicated: once
    # every load equals what was saved, on every rank, bit for bit (2 -> 3 and 3 -> 2, across unit policies)
    for r, got in enumerate(per_rank):
        assert differences(got["states"]["loaded a"], out["states"]["saved a"]) == [], f"rank {r}"
        if r < 2:
            assert differences(got["states"]["loaded b"], out["states"]["saved b"]) == [], f"rank {r}"
    # a wrong offset: the same comparison fails, on every tensor ranks 0 and 1 hold different rows of
    wrong = differences(out["states"]["wrong offset a"], out["states"]["saved a"])
    assert {"tok_emb.weight", "tok_emb.weight.exp_avg", "blocks.0.mlp.fc.weight"} <= set(wrong)
    # the continued run equals one uninterrupted process: same seed, same batches (the generator was saved)
    ref = train_zero_reference(config, cfg)
    losses = [out["losses"][s] for s in range(1, STEPS + 1)]
    assert losses == pytest.approx(ref.train_losses, abs=adamw_loss_atol(cfg.lr))
    final = torch.cat([out["final"][n].reshape(-1) for n, _ in GPT(config).named_parameters()])
    assert_adamw_params_close(final, ref.final_params, cfg.lr, STEPS, cfg.betas, msg="2 -> 3 -> 2 ranks")
    # bad input, named before any rank would wait (every rank reads the metadata itself)
    shapes = {n: tuple(p.shape) for n, p in GPT(config).named_parameters()}
    with pytest.raises(ValueError, match=r"checkpoint directory '.*missing' does not exist"):
        check_per_param_checkpoint(str(tmp_path / "missing"), shapes)
    with pytest.raises(ValueError, match=r"is not a DCP checkpoint: it has no .metadata"):
        check_per_param_checkpoint(str(tmp_path), shapes)
    renamed = {n.replace("mlp.fc", "mlp.up"): s for n, s in shapes.items()}
    with pytest.raises(ValueError, match=r"names differ .* not in the checkpoint \['blocks.0.mlp.up.weight'.*"
                                         r"only in the checkpoint \['blocks.0.mlp.fc.weight'"):
        check_per_param_checkpoint(str(tmp_path / "a"), renamed)
    with pytest.raises(ValueError, match=r"blocks.0.mlp.fc.weight: shape \(128, 64\) in the model, \(127, 64\)"):
        check_per_param_checkpoint(str(tmp_path / "a"), {**shapes, "blocks.0.mlp.fc.weight": (128, 64)})
    with pytest.raises(ValueError, match=r"a model from apply_zero\(\.\.\., 3, sharding='per_param'\)"):
        save_per_param(str(tmp_path / "c"), GPT(config), None, 0)  # a plain (or flat stage-3) model
    with pytest.raises(ValueError, match=r"offload='nvme' keeps Adam's m and v in its own files"):
        load_per_param(str(tmp_path / "a"), SimpleNamespace(per_param=object()), SimpleNamespace(store=object()))
