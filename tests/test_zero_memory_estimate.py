"""Per-parameter stage 3 (sharding="per_param"): the bytes a rank measures equal the estimator's
course_lib.estimate.per_param_memory, exactly (bytes are integers), for each reshard_after_forward
mode and HSDP.

Measured on every rank: the local shards and AdamW's m, v after the step, the gradients at the end
of backward (course_lib.parallel.zero.measure_state_bytes), and the gathered parameters at every
event of the schedule (watch_gathered): what stays gathered at the end of forward and the step's
peak. tests/_zero_setup.py's model pads the last rank at N = 3 and 4 (d_ff = 127, 97 embedding
rows), so dropping the padding from the formula fails, and the modes hold different gathered
bytes, so dropping the reshard rule fails too. Two rank launches: N = 3 (True, False, bf16
gathers) and N = 4 (True, k = 2, HSDP 2 x 2 with True and False; the shard groups of 2 ranks).
"""

import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.estimate import model_state_bytes, per_param_memory
from course_lib.model import GPT
from course_lib.parallel.zero import apply_zero
from course_lib.parallel.zero.memory import held_gathered, measure_state_bytes, watch_gathered
from course_lib.parallel.zero.training import default_optimizer_kwargs
from course_lib.train import StepHooks, TrainConfig, share_rows, train_loop

from _zero_setup import uneven_config

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
CFG = TrainConfig(steps=2, batch_size=12, lr=3e-3, grad_clip=0.0, eval_every=10**6, progress=False)
MODES = {3: {"reshard": {}, "keep": {"reshard_after_forward": False},
             "bf16": {"param_dtype": torch.bfloat16}},
         4: {"reshard": {}, "reshard2": {"reshard_after_forward": 2}, "hsdp2": {"hsdp": 2},
             "hsdp2_keep": {"hsdp": 2, "reshard_after_forward": False}}}


@pytest.fixture(scope="module")
def config():
    return uneven_config()


def unit_shapes(config) -> list[list[tuple]]:
    """Policy "block" read off the model's names: the root (everything outside model.blocks), then
    each block; the tied head is the embedding, listed once."""
    named = list(GPT(config).named_parameters())
    root = [tuple(p.shape) for n, p in named if not n.startswith("blocks.")]
    return [root] + [[tuple(p.shape) for n, p in named if n.startswith(f"blocks.{i}.")]
                     for i in range(config.n_layer)]


def estimate(config, n, kw) -> dict:
    return per_param_memory(unit_shapes(config), n, hsdp=kw.get("hsdp", 1),
                            reshard_after_forward=kw.get("reshard_after_forward", True),
                            param_bytes=2 if kw.get("param_dtype") == torch.bfloat16 else 4)


def _measure(config, cfg, modes):
    rank, n = dist.get_rank(), dist.get_world_size()
    ds, out = CharDataset("train", block_size=config.block_size), {}
    for name, kw in modes.items():
        model, opt = apply_zero(GPT(config, seed=cfg.seed), 3, torch.optim.AdamW, sharding="per_param", **kw,
                                **default_optimizer_kwargs(cfg))
        trace, grads = watch_gathered(model.per_param), []
        hooks = StepHooks(sync_gradients=lambda: grads.append(measure_state_bytes(model, opt)["grads"]))
        train_loop(model, opt, ds, cfg, hooks, rows=share_rows(rank, n, cfg.batch_size))
        state = measure_state_bytes(model, opt)
        out[name] = {"params": state["params"], "grads": grads, "optimizer": state["optimizer"],
                     "after_forward": [b for what, unit, b in trace if (what, unit) == ("done", "root")],
                     "peak": max(b for _, _, b in trace),
                     "end": held_gathered(model.per_param)}
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_measured_per_rank_bytes_equal_the_estimate(config, n):
    per_rank = run_on_ranks(_measure, config, CFG, MODES[n], world_size=n, timeout_s=240)
    for name, kw in MODES[n].items():
        want = estimate(config, n, kw)
        for rank, out in enumerate(per_rank):
            got = out[name]
            msg = f"{name} at N={n}, rank {rank}"
            assert got["params"] == want["params"] and got["optimizer"] == want["optimizer"], msg
            assert got["grads"] == [want["grads"]] * CFG.steps, msg  # at the end of each backward
            # what stays gathered between forward and backward, each step; the step's peak
            assert got["after_forward"] == [want["gathered_after_forward"]] * CFG.steps, msg
            assert got["peak"] == want["gathered_peak"] and got["end"] == 0, msg  # all freed after the step


def test_formula_cases_and_bad_input(config):
    units = unit_shapes(config)
    # no padding when S divides every dim 0: the shard is exactly 1/S of the parameters (notebook 01's stage 3)
    even = [[(4 * 6, 5), (4,)], [(8, 3, 2), (12,)]]
    psi = sum(math.prod(s) for u in even for s in u)
    got = per_param_memory(even, 4)
    assert {k: got[k] for k in ("params", "grads", "optimizer", "total")} == model_state_bytes(psi, "fp32", 3, 4)
    # HSDP R x S holds what plain sharding over S holds; k = S is True, k = 1 is False
    assert per_param_memory(units, 4, hsdp=2) == per_param_memory(units, 2)
    assert per_param_memory(units, 4, reshard_after_forward=4) == per_param_memory(units, 4)
    assert per_param_memory(units, 4, reshard_after_forward=1) == per_param_memory(units, 4,
                                                                                  reshard_after_forward=False)
    # the modes order: True holds least between forward and backward, False most, k between
    held = [per_param_memory(units, 4, reshard_after_forward=k)["gathered_after_forward"] for k in (True, 2, False)]
    assert held[0] < held[1] < held[2]
    for kw, message in (({"hsdp": 3}, r"hsdp=3 replicas must divide the 4"),
                        ({"reshard_after_forward": 3}, r"reshard_after_forward=3 must be .* shard group size 4"),
                        ({"hsdp": 2, "reshard_after_forward": 4}, r"dividing the shard group size 2")):
        with pytest.raises(ValueError, match=message):
            per_param_memory(units, 4, **kw)
    with pytest.raises(ValueError, match=r"needs a dim 0"):
        per_param_memory([[()]], 2)
    with pytest.raises(ValueError, match=r"dp=0 must be"):
        per_param_memory(units, 0)
