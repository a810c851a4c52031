"""Offload on a GPU rank (issue 46, point 4): the parameters and gradients on the rank's device,
Adam's state (and its fp32 master) in host memory, every crossing explicit
(course_lib/parallel/zero/offload.py's to_host / to_device).

No GPU here: the device rule's tracking (observe/device_rule.py) stands in for one. It marks
each tensor that would live in host memory on a GPU rank, so a rank can check, at the optimizer's
step, that torch.optim sees host tensors only (the old NVMe tier stepped the device's parameters
with state in host buffers: a device mismatch on the first GPU run), that the model's parameters
stay on the device, and that no host tensor reaches a collective (the rule raises). The numbers
are those of a run without offload, bit for bit: the copies hold the same values.
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.observe.device_rule import enforced, is_host
from course_lib.parallel.zero import apply_zero, train_zero
from course_lib.parallel.zero.offload import OffloadCounter, to_device, to_host
from course_lib.parallel.zero.per_param_optim import local_elements
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainConfig, share_rows, train_loop

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

from _zero_setup import STEPS, train_cfg, uneven_config  # noqa: E402

ONE_STEP = TrainConfig(steps=2, batch_size=4, lr=1e-3, grad_clip=1.0, eval_every=10**6, progress=False)


@pytest.fixture(scope="module")
def config():
    return uneven_config()


def test_to_host_and_to_device_copy_cast_and_count():
    counter = OffloadCounter()
    with enforced(torch.device("cpu")):  # the tracking: the CPU stands for the GPU
        dev = torch.arange(6, dtype=torch.bfloat16, device="cpu").view(2, 3)
        host = to_host(dev, torch.float32, counter)
        assert is_host(host) and not is_host(dev)
        assert host.dtype == torch.float32 and torch.equal(host, dev.float())
        assert host.data_ptr() != dev.data_ptr()  # a copy, never an alias of the device's tensor
        back = to_device(host, "cpu", torch.bfloat16, counter)
        assert not is_host(back) and back.dtype == torch.bfloat16 and torch.equal(back, dev)
    # the link carries the device's bf16 each way: 6 elements * 2 bytes (cast on the host)
    assert counter.summary() == {"to_host": 12, "to_device": 12}


def _flat(config, cfg, stage, dtype, offload):
    return train_zero(config, cfg, stage, offload=offload, compute_dtype=dtype)


def _bit_for_bit(config, cfg):
    out = {}
    for stage in (1, 2, 3):
        for dtype in (None, torch.bfloat16):
            out[(stage, dtype, False)] = _flat(config, cfg, stage, dtype, False)
            out[(stage, dtype, True)] = _flat(config, cfg, stage, dtype, True)
    return out


def test_host_offload_changes_no_bit_on_cpu_ranks(config):
    cfg = train_cfg(clip=1.0)  # clipping too: the global norm of host gradients, all-reduced on the device
    per_rank = run_on_ranks(_bit_for_bit, config, cfg, world_size=2, timeout_s=600)
    for out in per_rank:
        for stage in (1, 2, 3):
            for dtype in (None, torch.bfloat16):
                plain, off = out[(stage, dtype, False)], out[(stage, dtype, True)]
                # exact: the host copies hold the same values, Adam does the same arithmetic on them
                assert off.train_losses == plain.train_losses, (stage, dtype)
                assert torch.equal(off.final_params, plain.final_params), (stage, dtype)
                # (final_grads are not compared: fp32 stages 1-2 without offload clip the reduced
                # gradient shard in place, an alias of the optimizer's; offload clips its host copy)


def _where_things_live(config, layout, nvme_dir):
    """One short run under the device rule: at each optimizer step, where torch.optim's tensors
    live; after it, where the model's parameters live; the bytes across the link."""
    rank, n = dist.get_rank(), dist.get_world_size()
    seen = {"params": set(), "grads": set(), "state": set()}

    def before(opt, args, kwargs):
        for g in opt.param_groups:
            for p in g["params"]:
                seen["params"].add(is_host(p))
                seen["grads"].add(is_host(p.grad))

    def after(opt, args, kwargs):
        for g in opt.param_groups:
            for p in g["params"]:
                seen["state"].update(is_host(v) for v in opt.state.get(p, {}).values()
                                     if torch.is_tensor(v) and v.dim() > 0)

    with enforced(rank_device()):
        model = GPT(config, seed=0).to(rank_device())
        kw = {"sharding": "per_param", "offload_dir": nvme_dir} if layout == "nvme" else {}
        model, opt = apply_zero(model, 3 if layout == "nvme" else layout, torch.optim.AdamW, None,
                                "nvme" if layout == "nvme" else True, lr=1e-3, **kw)
        opt.optimizer.register_step_pre_hook(before)
        opt.optimizer.register_step_post_hook(after)
        train_loop(model, opt, CharDataset("train", block_size=config.block_size), ONE_STEP,
                   StepHooks(clip_grad_norm=opt.clip_grad_norm_), rows=share_rows(rank, n, ONE_STEP.batch_size),
                   device=rank_device())
        if layout == "nvme":
            device_params = [e.local for _, e in model.per_param.entries()]
            link, local = opt.store.link.summary(), local_elements(GPT(config), "block", n)
        elif layout == 3:  # stage 3's parameters ARE the host shards; the device holds gathered copies
            device_params, link, local = [], opt.offload.summary(), None
        else:
            device_params = list(model.parameters())
            link, local = opt.offload.summary(), None
        return seen, {is_host(p) for p in device_params}, link, local


@pytest.mark.parametrize("layout", [1, 2, 3, "nvme"])
def test_adam_steps_host_tensors_only_and_the_parameters_stay_on_the_device(config, layout, tmp_path):
    per_rank = run_on_ranks(_where_things_live, config, layout, str(tmp_path), world_size=2, timeout_s=300)
    for seen, device_params, link, local in per_rank:
        assert seen == {"params": {True}, "grads": {True}, "state": {True}}, layout  # host only
        assert device_params == (set() if layout == 3 else {False}), layout  # never left on the host
        if layout == "nvme":  # per step: the fp32 shard and its gradient down, the updated shard up
            assert link == {"to_host": ONE_STEP.steps * 8 * local, "to_device": ONE_STEP.steps * 4 * local}
        else:
            assert link["to_host"] > 0 and link["to_device"] > 0


def _nvme_pair(config, cfg, nvme_dir):
    plain = train_zero(config, cfg, 3, sharding="per_param")
    with enforced(rank_device()):  # no host tensor reaches a collective, and the same numbers
        ruled = train_zero(config, cfg, 3, sharding="per_param", offload="nvme", offload_dir=nvme_dir)
    return plain, ruled


def test_nvme_under_the_device_rule_equals_no_offload_bit_for_bit(config, tmp_path):
    cfg = train_cfg(clip=1.0)
    for plain, ruled in run_on_ranks(_nvme_pair, config, cfg, str(tmp_path), world_size=2, timeout_s=300):
        assert ruled.train_losses == plain.train_losses and len(plain.train_losses) == STEPS
        assert torch.equal(ruled.final_params, plain.final_params)  # exact: the same AdamW on copies
