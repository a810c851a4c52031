"""Per-parameter stage 3 (FSDP2's design, course_lib.parallel.zero sharding="per_param") equals the
single process, the flat design and torch's fully_shard; HSDP, reshard_after_forward modes, bf16
mixed precision, NVMe offload, full state dicts, bad input, the torchrun demo flags.

As in tests/test_zero.py: grad_clip=0 keeps the raw gradients (Adam is scale invariant, so the
gradients are compared too), the model has a parameter count odd and not divisible by 3 and
dim-0 lengths (d_ff=127) that pad the last rank at N = 2, 3 and 4. Variants are grouped per rank
launch to keep the wall time modest.
"""

import os
import re
import subprocess
import sys
import warnings

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import RankError, run_on_ranks
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims
from course_lib.model import GPT
from course_lib.parallel.zero import apply_zero, run_zero, train_zero, train_zero_reference
from course_lib.parallel.zero.native import _full, fsdp2_model
from course_lib.parallel.zero.hsdp import hsdp_payloads
from course_lib.parallel.zero.nvme import check_nvme_dir, disk_bandwidth
from course_lib.parallel.zero.per_param_model import plan_units
from course_lib.parallel.zero.training import default_optimizer_kwargs
from course_lib.parallel.zero.per_param_optim import check_per_param_args, full_state_dict
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainConfig, flat_grads, flat_params, make_optimizer, share_rows, train_loop

from _tolerances import (adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw, bf16_loss_atol,
                         by_name)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from _zero_setup import STEPS, train_cfg, uneven_config  # noqa: E402
from _demo_cli import run_main  # noqa: E402


@pytest.fixture(scope="module")
def config():
    return uneven_config()


def reference_with_groups(config, cfg):
    """One process, make_optimizer's decay / no-decay AdamW groups."""
    model = GPT(config, seed=cfg.seed)
    res = train_loop(model, make_optimizer(model, cfg), CharDataset("train", block_size=config.block_size), cfg)
    res.final_params, res.final_grads = flat_params(model), flat_grads(model)
    return res


def fsdp2_with_groups(config, cfg, compute_dtype=None):
    """Rank code: torch's fully_shard (every block, then the root) with make_optimizer's groups."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = fsdp2_model(GPT(config, seed=cfg.seed).to(rank_device()), None, compute_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # native.py names the two harmless FSDP2 warnings for this model
        res = train_loop(model, make_optimizer(model, cfg), CharDataset("train", block_size=config.block_size), cfg,
                         StepHooks(), rows=share_rows(rank, n, cfg.batch_size))
    res.final_params = torch.cat([_full(p.detach()).float().reshape(-1) for p in model.parameters()])
    res.final_grads = torch.cat([_full(p.grad).float().reshape(-1) for p in model.parameters()])
    return res


def assert_like(run, ref, losses, cfg, config, msg):
    """Sums over ranks in another order than `ref` (fp32 rounding, magnified by AdamW near g = 0):
    the tolerances and their reasons are tests/_tolerances.py's, as in tests/test_zero.py."""
    model = GPT(config)
    assert losses == pytest.approx(ref.train_losses, abs=adamw_loss_atol(cfg.lr)), msg
    assert_grads_close_after_adamw(by_name(run.final_grads, model), by_name(ref.final_grads, model), msg)
    assert_adamw_params_close(run.final_params, ref.final_params, cfg.lr, STEPS, cfg.betas, msg=msg)


def _variants(config, cfg, names):
    out = {}
    for name in names:
        if name == "fsdp2_groups":
            out[name] = fsdp2_with_groups(config, cfg)
        elif name == "fsdp2_groups_bf16":
            out[name] = fsdp2_with_groups(config, cfg, torch.bfloat16)
        elif name == "flat":
            out[name] = train_zero(config, cfg, 3)
        else:
            out[name] = train_zero(config, cfg, 3, sharding="per_param", **VARIANTS[name])
    return out


VARIANTS = {
    "block": {},
    "whole": {"policy": "whole"},
    "linear_embedding": {"policy": (nn.Linear, nn.Embedding)},
    "keep": {"reshard_after_forward": False},
    "prefetch": {"prefetch": True},
    "groups": {"decay_groups": True},
    "groups_bf16": {"decay_groups": True, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "reshard2": {"reshard_after_forward": 2, "prefetch": True},
    "hsdp2": {"hsdp": 2},
    "hsdp2_keep": {"hsdp": 2, "reshard_after_forward": False, "policy": (nn.Linear, nn.Embedding)},
}


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_per_param_equals_single_process_flat_and_fsdp2(config, world_size):
    cfg = train_cfg()
    names = ["block", "linear_embedding", "keep", "prefetch", "groups", "flat", "fsdp2_groups"]
    names += {2: ["whole"], 3: ["groups_bf16", "fsdp2_groups_bf16"], 4: ["reshard2", "hsdp2", "hsdp2_keep"]}.get(world_size, [])
    if world_size == 6:  # HSDP 2 x 3 (uneven shards inside each replica) only: six ranks on a small machine
        names = ["hsdp2"]
    ref, ref_groups = train_zero_reference(config, cfg), reference_with_groups(config, cfg)
    per_rank = run_on_ranks(_variants, config, cfg, names, world_size=world_size, timeout_s=300,
                            check_collectives=False)  # FSDP2 issues its collectives below the Python check
    for name in (n for n in names if "bf16" not in n):
        runs = [r[name] for r in per_rank]
        mean = [sum(r.train_losses[i] for r in runs) / world_size for i in range(STEPS)]
        want = ref_groups if name in ("groups", "fsdp2_groups") else ref
        for run in runs:  # every rank gathers the same full state
            assert_like(run, want, mean, cfg, config, f"{name} at N={world_size}")
    out = per_rank[0]
    if world_size == 6:
        return
    flat = out["flat"]
    for name in ("block", "linear_embedding"):  # per-parameter vs flat: the same model, other layouts
        assert_like(out[name], flat, out[name].train_losses, cfg, config, f"{name} vs flat")
    assert_like(out["groups"], out["fsdp2_groups"], out["groups"].train_losses, cfg, config, "groups vs fsdp2")
    if world_size == 3:  # bf16 gathers, fp32 reduction and masters in both: tests/test_zero.py's bf16 bounds
        ours, theirs = out["groups_bf16"], out["fsdp2_groups_bf16"]
        assert ours.train_losses == pytest.approx(theirs.train_losses, abs=bf16_loss_atol(theirs.train_losses))
        # bf16 gradients: 2^-8 rounding through the layers; 0.05 ~ 13 * 2^-8 (a wrong reduction: O(1))
        assert ((ours.final_grads - theirs.final_grads).norm() / theirs.final_grads.norm()).item() < 0.05


# ------------------------------------------------------------------ what a rank sees
def _inspect(config, cfg, nvme_dir):
    """Names and shapes of the local shards, replicated gradients, full state dicts, bf16, NVMe."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ds = CharDataset("train", block_size=config.block_size)
    out = {}
    kw = default_optimizer_kwargs(cfg)  # lr, betas, weight decay as the reference
    model, opt = apply_zero(GPT(config, seed=cfg.seed), 3, torch.optim.AdamW, sharding="per_param",
                            policy=(nn.Linear, nn.Embedding), **kw)
    out["local"] = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    train_loop(model, opt, ds, cfg, StepHooks(clip_grad_norm=opt.clip_grad_norm_), rows=share_rows(rank, n, 12))
    units = model.per_param.units
    out["replicated_grads"] = {e.name: e.local.grad.clone() for u in units if u.replicate for e in u.entries}
    out["grad_dtypes"] = {p.grad.dtype for p in model.parameters()}
    out["state"] = full_state_dict(model, opt)
    flat_model, flat_opt = apply_zero(GPT(config, seed=cfg.seed), 3, torch.optim.AdamW, **kw)
    train_loop(flat_model, flat_opt, ds, cfg, StepHooks(clip_grad_norm=flat_opt.clip_grad_norm_),
               rows=share_rows(rank, n, 12))
    out["flat_state"] = full_state_dict(flat_model, flat_opt)
    model_b, opt_b = apply_zero(GPT(config, seed=cfg.seed), 3, torch.optim.AdamW, sharding="per_param",
                                param_dtype=torch.bfloat16, **kw)
    grab = StepHooks(sync_gradients=lambda: out.update(bf16_grad_dtypes={p.grad.dtype for p in model_b.parameters()}))
    train_loop(model_b, opt_b, ds, cfg, grab, rows=share_rows(rank, n, 12))
    noclip = train_cfg()  # the bf16 reference's final_grads are the unclipped ones
    out["bf16"] = train_zero(config, noclip, 3, sharding="per_param", compute_dtype=torch.bfloat16)
    out["plain"] = train_zero(config, cfg, 3, sharding="per_param")
    out["nvme"] = train_zero(config, cfg, 3, sharding="per_param", offload="nvme", offload_dir=nvme_dir)
    return out


def test_local_shards_by_name_replicated_grads_state_dicts_bf16_and_nvme(config, tmp_path):
    cfg = train_cfg(clip=1.0)
    per_rank = run_on_ranks(_inspect, config, cfg, str(tmp_path), world_size=3, timeout_s=300)
    model = GPT(config)
    names = [n for n, _ in model.named_parameters()]
    clipped = train_zero_reference(config, cfg)
    for r, out in enumerate(per_rank):
        # every name kept; a Linear/Embedding weight is its rank's ceil(d0/3) rows, a LayerNorm whole
        assert [n for n, _ in out["local"]] == names
        for (name, shape), (_, p) in zip(out["local"], model.named_parameters()):
            want = p.shape if ".ln" in name or name.startswith("ln_f") else (-(-p.shape[0] // 3),) + p.shape[1:]
            assert shape == tuple(want), name
        assert out["grad_dtypes"] == out["bf16_grad_dtypes"] == {torch.float32}  # the masters' dtype
        # the replicated LayerNorms' gradients: one all-reduce, the same bits on every rank
        for name, g in out["replicated_grads"].items():
            assert torch.equal(g, per_rank[0]["replicated_grads"][name]), name
        # clipped with the global norm (a LayerNorm counted 1/3 on each of its 3 copies): as one process
        assert_adamw_params_close(torch.cat([out["state"][n].reshape(-1) for n in names]), clipped.final_params,
                                  cfg.lr, STEPS, cfg.betas, msg=f"rank {r}")
        assert list(out["state"]) == names and sorted(out["flat_state"]) == sorted(names)  # flat: unit order
        for name, p in model.named_parameters():
            assert out["state"][name].shape == p.shape == out["flat_state"][name].shape
            torch.testing.assert_close(out["state"][name], per_rank[0]["state"][name], rtol=0, atol=0)
        # NVMe offload: the same AdamW arithmetic on state read back from files: bit for bit
        assert torch.equal(out["nvme"].final_params, out["plain"].final_params)
    assert len(os.listdir(tmp_path)) == 3 * (config.n_layer + 1)  # one file per unit and rank
    # bf16 compute, fp32 reduce and masters: as tests/test_zero.py's bf16 check (its reasons)
    ref = train_zero_reference(config, train_cfg(), compute_dtype=torch.bfloat16)
    out = per_rank[0]["bf16"]
    assert ((out.final_grads - ref.final_grads).norm() / ref.final_grads.norm()).item() < 0.05
    mean = [sum(r["bf16"].train_losses[i] for r in per_rank) / 3 for i in range(STEPS)]
    assert mean == pytest.approx(ref.train_losses, abs=bf16_loss_atol(ref.train_losses))
    assert out.final_params.dtype == torch.float32


# ------------------------------------------------------------------ the schedule: prefetch, reshard modes
def _schedule(config, cfg):
    from course_lib.observe.timeline import Timeline
    from course_lib.observe.tracer import CommTracer

    rank, n = dist.get_rank(), dist.get_world_size()
    ds, out = CharDataset("train", block_size=config.block_size), {}
    for name, kw in (("plain", {}), ("prefetch", {"prefetch": True}), ("keep", {"reshard_after_forward": False}),
                     ("reshard2", {"reshard_after_forward": 2}), ("hsdp2", {"hsdp": 2})):
        tl = Timeline()
        model, opt = apply_zero(GPT(config, seed=cfg.seed), 3, torch.optim.AdamW, sharding="per_param", timeline=tl,
                                **kw, **default_optimizer_kwargs(cfg))
        res = train_loop(model, opt, ds, cfg, StepHooks(timeline=tl), rows=share_rows(rank, n, cfg.batch_size),
                         tracer=CommTracer())
        pp = model.per_param
        out[name] = {"events": pp.events, "calls": res.comm_summary["all_gather_single"]["calls"],
                     "bytes": pp.gather_bytes, "units": [(u.name, u.numel) for u in pp.units],
                     "timeline": res.timeline_events, "summary": res.comm_summary}
    return out


def test_prefetch_order_and_gathers_per_reshard_mode(config):
    cfg = TrainConfig(steps=1, batch_size=12, lr=3e-3, grad_clip=0.0, eval_every=10**6, progress=False)
    out = run_on_ranks(_schedule, config, cfg, world_size=4, timeout_s=180)[0]
    L, n = config.n_layer, 4

    def first(events, what, unit, after=-1):
        return next(i for i, e in enumerate(events) if e == (what, unit) and i > after)

    for i in range(1, L):  # forward: the next block's gather is issued before this block's compute ends
        for name, before in (("prefetch", True), ("plain", False)):
            ev = out[name]["events"]
            assert (first(ev, "gather", f"block{i}") < first(ev, "done", f"block{i - 1}")) == before, (name, i)
    for i in range(1, L):  # backward: the block before is re-gathered before this block's reduction
        for name, before in (("prefetch", True), ("plain", False)):
            ev = out[name]["events"]
            again = first(ev, "gather", f"block{i - 1}", after=first(ev, "gather", f"block{i - 1}"))
            assert (again < first(ev, "reduce", f"block{i}")) == before, (name, i)
    # all-gathers per step: root once (never resharded), each block twice unless kept (FSDP2's schedule)
    assert [out[k]["calls"] for k in ("plain", "prefetch", "keep", "reshard2")] == [1 + 2 * L, 1 + 2 * L, 1 + L,
                                                                                       1 + 2 * L]
    # logical bytes received (fp32): (N-1)/N of each gathered unit, the backward re-gather of reshard=2
    # from 2 ranks only: (2-1)/2 of it
    sizes = dict(out["plain"]["units"])
    full = {u: 4 * s * n for u, s in sizes.items()}
    blocks = [f"block{i}" for i in range(L)]
    assert out["plain"]["bytes"] == sum(full[u] * (n - 1) // n for u in full) + sum(full[b] * (n - 1) // n
                                                                                      for b in blocks)
    assert out["reshard2"]["bytes"] == sum(full[u] * (n - 1) // n for u in full) + sum(full[b] // 2 for b in blocks)
    # HSDP 2 x 2: traffic per mesh dim from the tracer = the formula (reduce-scatter in the shard
    # group, all-reduce of the reduced shard across replicas; grad_clip=0: no other all-reduce)
    local = [s for _, s in out["hsdp2"]["units"]]
    want = hsdp_payloads(local, replicas=2, shards=2)
    got = out["hsdp2"]["summary"]
    assert got["reduce_scatter_single"]["bytes_sent"] == want["shard"]
    assert got["all_reduce"]["bytes_sent"] == want["replicate"] and "all_reduce" not in out["plain"]["summary"]
    comm = [e for e in out["prefetch"]["timeline"] if e[3] == "comm"]
    assert {e[0] for e in comm} >= {f"all-gather block{i}" for i in range(L)}


# ------------------------------------------------------------------ bad input
def test_bad_input_is_refused_before_any_rank_waits(config, tmp_path):
    model = GPT(config)
    with pytest.raises(ValueError, match=r"names no module of this model"):
        plan_units(model, (nn.Conv2d,))
    with pytest.raises(ValueError, match=r"policy='blocks' must be one of"):
        plan_units(model, "blocks")
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must be .* dividing the shard group size 4"):
        check_per_param_args(4, reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"hsdp=3 replicas must divide the 4"):
        check_per_param_args(4, hsdp=3)
    with pytest.raises(ValueError, match=r"offload='nvme' needs offload_dir"):
        check_per_param_args(2, offload="nvme")
    with pytest.raises(ValueError, match=r"must be an existing directory"):
        check_nvme_dir(str(tmp_path / "missing"), 1)
    with pytest.raises(ValueError, match=r"bytes free; the optimizer state needs 1,000,000,000,000,000,000 bytes"):
        check_nvme_dir(str(tmp_path), 10**18)

    with pytest.raises(ValueError, match=r"offload='nvme' .* is built for sharding='per_param'"):
        apply_zero(GPT(config), 3, torch.optim.AdamW, offload="nvme", lr=1.0)
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must be"):  # run_zero: in the parent
        run_zero(ParallelDims(dp=4, zero=3), config, train_cfg(), sharding="per_param", reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"sharding='per_param' is stage 3"):
        apply_zero(GPT(config), 2, torch.optim.AdamW, sharding="per_param", lr=1.0)
    with pytest.raises(ValueError, match=r"zero=2: sharding='per_param' is stage 3"):  # run_zero: in the parent
        run_zero(ParallelDims(dp=4, zero=2), config, train_cfg(), sharding="per_param")

    def bad_reshard():
        apply_zero(GPT(config), 3, torch.optim.AdamW, sharding="per_param", reshard_after_forward=3, lr=1.0)

    def bad_policy():
        apply_zero(GPT(config), 3, torch.optim.AdamW, sharding="per_param", policy=(nn.Conv2d,), lr=1.0)

    for fn, message in ((bad_reshard, "reshard_after_forward=3 must be"), (bad_policy, "names no module")):
        with pytest.raises(RankError, match=message):
            run_on_ranks(fn, world_size=2, timeout_s=30)


# ------------------------------------------------------------------ the instructor demo
def test_zero_demo_per_param_hsdp_nvme_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "course_lib.demos.zero", "--stage", "3", "--steps", "2", "--sharding", "per_param",
           "--hsdp", "2", "--offload", "nvme", "--offload-dir", str(tmp_path), "--check"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d)\s+(\d+\.\d+)\s+(\d+\.\d+)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "2"] and "check passed" in proc.stdout
    for rank in range(4):  # measured equals formula in every column, the NVMe files included
        line = re.search(rf"^\s+{rank} (.*)$", proc.stdout.split("formula (notebook 01):")[1], re.M).group(1)
        pairs = re.findall(r"([\d.]+ \w?i?B) /\s+([\d.]+ \w?i?B)", line)
        assert len(pairs) == 4 and all(a == b for a, b in pairs), line
    assert set(os.listdir(tmp_path)) >= {f"unit0_rank{r}.bin" for r in range(4)}
    bandwidth = disk_bandwidth(str(tmp_path), nbytes=2**20)
    assert bandwidth["write"] > 0 and bandwidth["read"] > 0 and not any(p.startswith(".") for p in os.listdir(tmp_path))
    code, err = run_main("course_lib.demos.zero", ["--stage", "2", "--sharding", "per_param"])
    assert code != 0 and "--sharding per_param needs --stage 3" in err
    code, err = run_main("course_lib.demos.zero", ["--stage", "3", "--sharding", "per_param", "--offload", "nvme",
                                                   "--offload-dir", str(tmp_path / "missing")])
    assert code != 0 and "must be an existing directory" in err
