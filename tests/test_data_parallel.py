"""Tests for course_lib.parallel.dp.ddp: naive all-reduce and the bucketed, overlapped DDP.

The central claim: N-rank data parallel training equals single-process training on the
concatenated batch (course_lib.train.train_reference), and equals torch's
DistributedDataParallel on the same data, for N = 2 and 4, with and without gradient
accumulation. Runs with grad_clip=0 compare raw averaged gradients: with clipping and AdamW
(both scale-invariant) a DDP that forgot to divide by N would still pass a parameter check.
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DistributedSampler

from course_lib import run_on_ranks
from course_lib.data import CharDataset, get_batch
from course_lib.dims import ParallelDims
from course_lib.model import GPT, GPTConfig
from course_lib.parallel import DDP, assign_buckets, check_replicas, naive_all_reduce_gradients, run_data_parallel
from course_lib.parallel.dp.ddp import AllReduceHandle
from course_lib.parallel.dp.training import train_data_parallel
from course_lib.train import TrainConfig, make_optimizer, train_reference, train_step

from _tolerances import adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw, by_name

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

STEPS = 3


@pytest.fixture(scope="module")
def config():
    return GPTConfig.tiny(CharDataset("train").vocab_size)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def reference(config, clip):
    cfg = TrainConfig(steps=STEPS, batch_size=8, grad_clip=clip, eval_every=10**6, eval_batches=1, progress=False)
    res = train_reference(config, cfg)
    params = list(res.model.parameters())
    return cfg, res.train_losses, flat(params), flat(p.grad for p in params)


def forgot_to_average(bucket_index, flat_grad, group=None):
    """A wrong comm hook: sums the gradients instead of averaging them."""
    return AllReduceHandle(dist.all_reduce(flat_grad.mul_(dist.get_world_size(group)), group=group, async_op=True),
                           flat_grad)


VARIANTS = {  # name -> (strategy, accum_steps, extra kwargs)
    "ddp": ("ddp", 1, {}),
    "ddp_accum_small_buckets": ("ddp", 2, {"bucket_cap_mb": 0.05}),
    "ddp_no_overlap": ("ddp", 1, {"bucket_cap_mb": 0.05, "overlap": False}),
    "naive_accum": ("naive", 2, {}),
    "torch": ("torch", 1, {}),
    "torch_accum_small_buckets": ("torch", 2, {"bucket_cap_mb": 0.05}),
    "wrong_sum": ("ddp", 1, {"comm_hook": forgot_to_average}),
}


def _all_variants(config, cfgs):
    return {(name, clip): train_data_parallel(config, cfg, strategy, accum, **kw)
            for clip, cfg in cfgs.items() for name, (strategy, accum, kw) in VARIANTS.items()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_reference_and_torch_ddp(config, world_size):
    refs = {clip: reference(config, clip) for clip in (0.0, 1.0)}
    cfg_lr = refs[0.0][0].lr
    per_rank = run_on_ranks(_all_variants, config, {clip: r[0] for clip, r in refs.items()},
                            world_size=world_size, timeout_s=60)
    for (name, clip), out in per_rank[0].items():
        _, ref_losses, ref_params, ref_grads = refs[clip]
        for r in range(1, world_size):  # replicas stay bit-identical
            assert torch.equal(per_rank[r][(name, clip)].final_params, out.final_params), (name, clip, r)
        if name == "wrong_sum":
            continue
        # The ranks sum the gradient in another order than one process, and AdamW magnifies that
        # rounding near g = 0 (tests/_tolerances): losses within adamw_loss_atol, the last step's
        # gradients (after 2 AdamW steps) in norm per tensor, parameters bounded by AdamW's step
        # and in RMS against lr/100.
        losses = [sum(per_rank[r][(name, clip)].train_losses[s] for r in range(world_size)) / world_size
                  for s in range(STEPS)]
        assert losses == pytest.approx(ref_losses, abs=adamw_loss_atol(cfg_lr)), (name, clip)
        assert_grads_close_after_adamw(by_name(out.final_grads, GPT(config)), by_name(ref_grads, GPT(config)),
                                       f"{name} clip={clip}")
        assert_adamw_params_close(out.final_params, ref_params, cfg_lr, STEPS, msg=f"{name} clip={clip}")
    for clip in (0.0, 1.0):
        for ours, theirs in (("ddp", "torch"), ("ddp_accum_small_buckets", "torch_accum_small_buckets")):
            assert_adamw_params_close(per_rank[0][(ours, clip)].final_params, per_rank[0][(theirs, clip)].final_params,
                                      cfg_lr, STEPS, msg=f"{ours} vs {theirs} clip={clip}")
    # The comparison can fail: summing instead of averaging gives N-times larger gradients.
    wrong = per_rank[0][("wrong_sum", 0.0)].final_grads
    with pytest.raises(AssertionError):
        assert_grads_close_after_adamw(by_name(wrong, GPT(config)), by_name(refs[0.0][3], GPT(config)))
    # N times the gradient, up to the runs' differences (<= 1e-3 in norm, as above): 1e-2 relative
    assert (wrong.norm() / refs[0.0][3].norm()).item() == pytest.approx(world_size, rel=1e-2)


def _traced_runs(config, cfg):
    out = {}
    for name, strategy, accum, kw in [("naive", "naive", 1, {}), ("ddp", "ddp", 1, {"bucket_cap_mb": 0.05}),
                                      ("ddp_accum", "ddp", 2, {"bucket_cap_mb": 0.05})]:
        res = train_data_parallel(config, cfg, strategy, accum, trace=True, **kw)
        out[name] = res.comm_summary["all_reduce"]
    model = GPT(config)
    ddp = DDP(model, bucket_cap_mb=0.05)
    out["n_buckets"] = len(ddp.buckets)
    out["bucketed"] = [p for b in ddp.buckets for p in b.params]
    out["tied_once"] = sum(p is model.tok_emb.weight for p in out["bucketed"])
    return out


def test_tracer_calls_and_bytes(config):
    cfg = TrainConfig(steps=2, batch_size=8, progress=False)
    res = run_on_ranks(_traced_runs, config, cfg, world_size=2, timeout_s=60)
    model = GPT(config)
    n_params, grad_bytes = len(list(model.parameters())), 4 * model.num_params()
    for r in res:
        assert r["tied_once"] == 1  # head.weight is tok_emb.weight: one Parameter, reduced once
        assert len(r["bucketed"]) == n_params
        assert r["naive"]["calls"] == cfg.steps * n_params  # one call per parameter
        assert r["ddp"]["calls"] == cfg.steps * r["n_buckets"] > cfg.steps  # one call per bucket
        assert r["ddp_accum"]["calls"] == cfg.steps * r["n_buckets"]  # no_sync micro-batches: no calls
        for name in ("naive", "ddp", "ddp_accum"):
            assert r[name]["bytes_sent"] == r[name]["bytes_recv"] == cfg.steps * grad_bytes


def _freeze_pos_emb(config, seed):
    model = GPT(config, seed=seed)
    model.pos_emb.weight.requires_grad_(False)
    return model


def _frozen(config, cfg):
    model = _freeze_pos_emb(config, 0)
    ddp = DDP(model)
    frozen_bucketed = any(p is model.pos_emb.weight for b in ddp.buckets for p in b.params)
    res = train_data_parallel(config, cfg, "ddp", 1, model_fn=_freeze_pos_emb, bucket_cap_mb=0.05)
    return frozen_bucketed, res


def test_frozen_parameters_not_communicated(config):
    cfg = TrainConfig(steps=STEPS, batch_size=8, progress=False)
    (bucketed, res), _ = run_on_ranks(_frozen, config, cfg, world_size=2, timeout_s=60)
    assert not bucketed
    model = _freeze_pos_emb(config, cfg.seed)
    opt, gen, ds = make_optimizer(model, cfg), torch.Generator().manual_seed(cfg.seed), CharDataset("train")
    for _ in range(STEPS):
        train_step(model, opt, *get_batch(ds, cfg.batch_size, gen), cfg.grad_clip)
    assert torch.equal(model.pos_emb.weight, GPT(config, seed=cfg.seed).pos_emb.weight)
    # 2 ranks vs one process after AdamW steps: bounded by AdamW's step, in RMS against lr/100
    assert_adamw_params_close(res.final_params, flat(model.parameters()), cfg.lr, STEPS, cfg.betas, msg="frozen")


class Branchy(nn.Module):
    """a always used; b used only when use_b; c never used. Registered a, b, c, so the
    buckets (reverse order, one parameter each) are c.bias, c.weight, b.bias, b.weight, a..."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b):
        h = self.a(x)
        return (self.b(h) if use_b else h).square().sum()


def _unused():
    rank = dist.get_rank()
    model = Branchy()
    ddp = DDP(model, bucket_cap_mb=1e-6)  # every parameter in its own bucket
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    grads = []
    for step in range(2):  # twice: bucket state must reset between steps
        model.zero_grad(set_to_none=True)
        ddp(xs[rank], use_b=(rank == 0)).backward()  # rank 1 never touches b: b's buckets wait for finish
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    local = []  # every rank's own gradient, recomputed here without communication
    for r in range(2):
        m = Branchy()
        m(xs[r], use_b=(r == 0)).backward()
        local.append({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in m.named_parameters()})
    return grads, {n: (local[0][n] + local[1][n]) / 2 for n in local[0]}


def test_unused_parameters_still_reduced():
    for grads, expected in run_on_ranks(_unused, world_size=2, timeout_s=60):
        for step_grads in grads:
            for name, g in expected.items():
                # bit for bit: (g0 + g1) / 2 is the same in any order (two terms, and / 2 is exact),
                # and each rank's g is the same arithmetic as the recomputation
                assert torch.equal(step_grads[name], g), name
        assert torch.count_nonzero(expected["b.weight"]) > 0  # b: used on rank 0 only, averaged anyway
        assert torch.count_nonzero(expected["c.weight"]) == 0  # c: unused everywhere -> zeros


def _overlap(config, cfg):
    out = {}
    for overlap in (True, False):  # one step: one finish event, one comm event per bucket
        events = train_data_parallel(config, cfg, "ddp", 1, record_timeline=True, bucket_cap_mb=0.05,
                                     overlap=overlap).timeline_events
        out[overlap] = ([e for e in events if e[0] == "finish"], [e for e in events if e[3] == "comm"])
    return out


def test_overlap_launches_buckets_during_backward(config):
    cfg = TrainConfig(steps=1, batch_size=8, progress=False)
    for r in run_on_ranks(_overlap, config, cfg, world_size=2, timeout_s=60):
        (finish,), buckets = r[True]
        assert len(buckets) > 2
        # Every bucket launched from a gradient hook, i.e. while backward was running (the
        # last one, holding tok_emb.weight, only when backward's final gradient was ready).
        # Not a duration: the order of events in program order, on the monotonic clock.
        assert all(b[1] < finish[1] for b in buckets)
        (finish,), buckets = r[False]
        assert all(b[1] >= finish[1] for b in buckets)  # all launched by finish, after backward


def _replica_errors():
    rank, errors = dist.get_rank(), {}
    cfg = GPTConfig.tiny(8, d_model=64 if rank == 0 else 32)
    try:
        DDP(GPT(cfg))
    except ValueError as e:
        errors["shapes"] = str(e)
    model = GPT(GPTConfig.tiny(8), seed=rank)  # same shapes, different values
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    try:
        naive_all_reduce_gradients(model)
    except ValueError as e:
        errors["values"] = str(e)
    ddp = DDP(model)  # broadcasts rank 0's values: afterwards the replicas agree
    check_replicas(ddp.module)
    errors["after_broadcast"] = flat(model.parameters())
    return errors


def test_replica_checks():
    res = run_on_ranks(_replica_errors, world_size=2, timeout_s=60)
    for r in res:
        assert "parameter shapes" in r["shapes"] and "tok_emb.weight" in r["shapes"]
        assert "parameter values" in r["values"]
    assert torch.equal(res[0]["after_broadcast"], res[1]["after_broadcast"])
    assert torch.equal(res[0]["after_broadcast"], flat(GPT(GPTConfig.tiny(8), seed=0).parameters()))


def test_bad_input_raises_before_ranks(config):
    for cap in (0, -1, True, "25"):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            DDP(nn.Linear(2, 2), bucket_cap_mb=cap)
    cfg = TrainConfig(steps=1, batch_size=8)
    with pytest.raises(ValueError, match="accum_steps=0"):
        run_data_parallel(ParallelDims(dp=2), config, cfg, "ddp", accum_steps=0)
    with pytest.raises(ValueError, match="divisible"):
        run_data_parallel(ParallelDims(dp=4), config, cfg, "ddp", accum_steps=4)
    with pytest.raises(ValueError, match="strategy"):
        run_data_parallel(ParallelDims(dp=2), config, cfg, "fsdp")
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        assign_buckets([4, 4], 0)


def test_assign_buckets_reverse_order_and_cap():
    assert assign_buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert assign_buckets([4, 100, 4, 4], 10) == [[3, 2, 1], [0]]  # closed once it holds the cap
    assert assign_buckets([1, 2, 3], 1e9) == [[2, 1, 0]]
    assert assign_buckets([4, 4, 4, 4], 8, first_bucket_cap_bytes=4) == [[3], [2, 1], [0]]
    sizes = [p.numel() * 4 for p in GPT(GPTConfig.tiny(8)).parameters()]
    for first in (None, 10_000):
        buckets = assign_buckets(sizes, 50_000, first)
        assert [i for b in buckets for i in b] == list(reversed(range(len(sizes))))
        caps = [first or 50_000] + [50_000] * len(buckets)
        for b, cap in zip(buckets[:-1], caps):  # every bucket but the last: just reached its cap
            assert sum(sizes[i] for i in b) >= cap > sum(sizes[i] for i in b[:-1])


def test_first_bucket_cap_like_torch():
    """A model whose gradients fit in one 25 MB bucket still gets a small first bucket (torch
    DDP's 1 MiB), so communication can start while backward runs."""
    sizes = [p.numel() * 4 for p in GPT(GPTConfig.tiny(8, d_model=256, n_layer=4, n_head=8)).parameters()]
    assert sum(sizes) < 25 * 2**20
    one = assign_buckets(sizes, 25 * 2**20)
    two = assign_buckets(sizes, 25 * 2**20, first_bucket_cap_bytes=dist._DEFAULT_FIRST_BUCKET_BYTES)
    assert len(one) == 1 and len(two) == 2
    assert dist._DEFAULT_FIRST_BUCKET_BYTES <= sum(sizes[i] for i in two[0]) < 2 * 2**20
    with pytest.raises(ValueError, match="first_bucket_cap_mb"):
        DDP(nn.Linear(2, 2), first_bucket_cap_mb=0)


def test_distributed_sampler_shards_without_overlap():
    ds = CharDataset("train")
    n = 4
    epochs = []
    for epoch in (0, 1):
        shards = []
        for r in range(n):
            s = DistributedSampler(ds, num_replicas=n, rank=r, shuffle=True, seed=0, drop_last=True)
            s.set_epoch(epoch)
            shards.append(list(s))
        sets = [set(x) for x in shards]
        assert all(len(x) == len(ds) // n == len(shards[0]) for x in sets)  # no repeats inside a shard
        assert len(set.union(*sets)) == n * (len(ds) // n)  # pairwise disjoint
        epochs.append(sets)
    for r in range(n):  # a new epoch gives every rank a different shard (about 1/n overlap by chance)
        overlap = len(epochs[0][r] & epochs[1][r]) / len(epochs[0][r])
        assert overlap < 0.5  # seeded permutations: the fraction is fixed (~1/n = 0.25), not a tolerance


def test_ddp_outside_process_group_is_clear():
    with pytest.raises(RuntimeError, match="process group"):
        DDP(nn.Linear(2, 2))


class _RecordingWork:
    """A stand-in for a backend's Work: records what the handle asks of it."""

    def __init__(self):
        self.calls, self.completed = [], False

    def get_future(self):
        self.calls.append("get_future")
        raise AssertionError("a callback on the future runs Python on the backend's thread")

    def is_completed(self):
        self.calls.append("is_completed")
        return self.completed

    def wait(self):
        self.calls.append("wait")
        self.completed = True
        return True


def test_all_reduce_handle_never_asks_the_backend_thread_to_run_python():
    # A done-callback on the work's future runs on gloo's thread and takes the GIL; at
    # interpreter exit (a run's last all-reduce, a barrier, exit) Python 3.11 ends that thread
    # inside C++ code: "terminate called without an active exception", or a hang. The handle
    # polls instead: done_at is stamped by the rank's own thread.
    work = _RecordingWork()
    handle = AllReduceHandle(work, torch.ones(2))
    handle.poll()
    assert handle.done_at is None  # not finished yet: nothing stamped
    work.completed = True
    handle.poll()
    stamped = handle.done_at
    assert stamped is not None
    assert torch.equal(handle.wait(), torch.ones(2)) and handle.done_at == stamped  # the first sight is kept
    assert "get_future" not in work.calls and work.calls.count("wait") == 1
