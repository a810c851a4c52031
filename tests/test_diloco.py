"""LocalSGD, DiLoCo and Streaming DiLoCo (course_lib.parallel.diloco) on gloo ranks: equal to the
single-process simulation over several outer steps at 2 and 4 replicas, also with each replica
FSDP-sharded over its ranks (shard=True), their traffic equal to the formula
(course_lib.estimate.traffic.diloco), and bad input refused before any rank starts."""

from functools import lru_cache

import pytest
import torch

from course_lib.data import VOCAB_SIZE
from course_lib.dims import ParallelDims
from course_lib.model import GPT, GPTConfig
from course_lib.parallel import diloco
from course_lib.parallel.diloco import (NesterovOuter, ddp_bytes_per_step, diloco_sync_bytes, fragment_param_counts,
                                        fragment_params, run_diloco, sharded_fragment_counts, simulate_diloco)
from course_lib.parallel.diloco import training
from course_lib.parallel.diloco.simulate import param_rms_tolerance
from course_lib.train import TrainConfig
from _tolerances import adamw_loss_atol, rms

CONFIG = GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=2, n_head=2, d_model=32)
H = 2
TRAIN = TrainConfig(steps=8, batch_size=8, progress=False)  # 8 steps, H = 2: 4 outer steps (per fragment)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # the paper's (Douillard et al. 2023)

# parameters: param_rms_tolerance (course_lib/parallel/diloco/simulate.py, the reasons there);
# losses: adamw_loss_atol (course_lib/tolerances.py, its reason there)

RUNS = {  # name: (world size, replicas, options)
    "local_sgd-2": (2, 2, dict(algorithm="local_sgd")),
    "local_sgd-4": (4, 4, dict(algorithm="local_sgd")),
    "diloco-2": (2, 2, dict()),
    "diloco-4": (4, 4, dict()),
    "diloco-2x2ddp": (4, 2, dict()),  # two replicas of two ranks each (DDP inside a replica)
    "streaming2-2": (2, 2, dict(fragments=2)),
    "streaming2-4": (4, 4, dict(fragments=2)),
    "streaming2-bf16-2": (2, 2, dict(fragments=2, outer_dtype=torch.bfloat16)),
    "streaming2-bf16-4": (4, 4, dict(fragments=2, outer_dtype=torch.bfloat16)),
    # two replicas of two ranks, each replica FSDP-sharded (the vocabulary's 97 rows: one padded row)
    "diloco-2x2fsdp": (4, 2, dict(shard=True)),
    "local_sgd-2x2fsdp": (4, 2, dict(algorithm="local_sgd", shard=True)),
    "streaming2-bf16-2x2fsdp": (4, 2, dict(fragments=2, outer_dtype=torch.bfloat16, shard=True)),
}


def algorithm(options) -> dict:
    """The options the simulation takes: sharding changes where the numbers live, not the algorithm."""
    return {k: v for k, v in options.items() if k != "shard"}


@lru_cache(maxsize=None)
def _run(name):
    world, replicas, options = RUNS[name]
    ranks = run_diloco(ParallelDims(dp=world), CONFIG, TRAIN, replicas=replicas, inner_steps=H, trace=True,
                       timeout_s=300, **options)
    return ranks, simulate_diloco(CONFIG, TRAIN, replicas, H, **algorithm(options))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_equals_the_single_process_simulation(name):
    world, replicas, options = RUNS[name]
    ranks, sim = _run(name)
    s = world // replicas
    assert [r.replica for r in ranks] == [i // s for i in range(world)]
    tol = param_rms_tolerance(TRAIN.lr, H, **algorithm(options))
    for rank, r in enumerate(ranks):
        ref = sim[r.replica]
        assert r.final_params.shape == ref.final_params.shape
        diff = rms(r.final_params - ref.final_params)
        assert diff <= tol, f"rank {rank}: RMS difference {diff:.3g} > {tol:.3g}"
    for i, ref in enumerate(sim):  # a replica's loss is the mean of its S ranks' shares
        mine = [sum(ranks[i * s + j].train_losses[k] for j in range(s)) / s for k in range(TRAIN.steps)]
        worst = max(abs(a - b) for a, b in zip(mine, ref.train_losses))
        assert worst <= adamw_loss_atol(TRAIN.lr), (i, worst)
    if replicas > 1:  # the replicas really trained apart: their last losses differ
        assert len({sim[i].train_losses[-1] for i in range(replicas)}) == replicas


@pytest.mark.parametrize("name", sorted(RUNS))
def test_bytes_per_step_equal_the_formula(name):
    """The tracer's bytes across replicas after every step, on every rank, exactly (sharded: each
    rank's rows only)."""
    world, replicas, options = RUNS[name]
    ranks, _ = _run(name)
    e = 2 if options.get("outer_dtype") == torch.bfloat16 else 4
    shards = world // replicas if options.get("shard") else 1
    want = diloco_sync_bytes(CONFIG, replicas, H, TRAIN.steps, options.get("fragments", 1), e, shards)
    for r in ranks:
        assert r.sync_bytes == want


def test_the_whole_model_every_h_steps_against_ddp_every_step():
    """F = 1 fp32: P * 4 bytes once per H steps, i.e. DDP's bytes of one step per H steps."""
    for h in (1, 2, 5):
        per_step = diloco_sync_bytes(CONFIG, 4, h, 10 * h)
        assert per_step == ([0] * (h - 1) + [ddp_bytes_per_step(CONFIG)]) * 10
        assert sum(per_step) * h == ddp_bytes_per_step(CONFIG) * len(per_step)
    assert diloco_sync_bytes(CONFIG, 1, 2, 4) == [0, 0, 0, 0]  # one replica meets no one


@pytest.mark.parametrize("n_layer, fragments", [(2, 2), (4, 2), (4, 4), (8, 4)])
def test_streaming_peak_is_about_one_fragment(n_layer, fragments):
    """The same bytes over H steps as the all-at-once sync, one fragment at a time: the peak is
    max_f P_f e, 1/F of the whole plus the embeddings' share (fragment 0 carries them)."""
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=n_layer, n_head=2, d_model=32)
    h = 2 * fragments
    whole = diloco_sync_bytes(config, 2, h, 4 * h)
    streamed = diloco_sync_bytes(config, 2, h, 4 * h, fragments)
    assert sum(streamed) == sum(whole)
    counts = fragment_param_counts(config, fragments)
    assert max(streamed) == max(counts) * 4 and sum(counts) * 4 == max(whole)
    embeddings = (VOCAB_SIZE + 16) * 32
    assert max(streamed) <= max(whole) / fragments + embeddings * 4
    assert sum(1 for b in streamed if b) == 4 * fragments  # each step of a round moves one fragment


@pytest.mark.parametrize("fragments", [1, 2, 4])
@pytest.mark.parametrize("tie, bias", [(True, True), (False, False)])
def test_fragment_counts_match_the_model(fragments, tie, bias):
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=4, n_head=2, d_model=32, tie_weights=tie,
                       bias=bias)
    model = GPT(config)
    parts = fragment_params(model, fragments)
    assert [sum(p.numel() for p in ps) for ps in parts] == fragment_param_counts(config, fragments)
    assert sum(len(ps) for ps in parts) == len(list(model.parameters()))  # every parameter once


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
@pytest.mark.parametrize("fragments", [1, 2])
@pytest.mark.parametrize("tie, bias", [(True, True), (False, False)])
def test_sharded_counts_are_each_ranks_rows(shards, fragments, tie, bias):
    """P_f^(S) = the elements of rank j's rows (ceil(d0 / S) of each tensor of d0 rows) of fragment
    f's tensors, read off the model; S = 1 is the unsharded count, and S > 1 is at least 1/S of it
    (the padding rows travel too)."""
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=4, n_head=2, d_model=32, tie_weights=tie,
                       bias=bias)
    parts = fragment_params(GPT(config), fragments)
    rows = [sum(-(-p.shape[0] // shards) * (p.numel() // p.shape[0]) for p in ps) for ps in parts]
    assert sharded_fragment_counts(config, fragments, shards) == rows
    whole = fragment_param_counts(config, fragments)
    assert all(r * shards >= w for r, w in zip(rows, whole)) and (shards > 1 or rows == whole)


def test_fsdp_replicas_send_half_the_model_each():
    """The sharded runs above send exactly each rank's rows: 2 ranks per replica, so the two ranks
    of a replica together send the unsharded sync's bytes plus the padding row of the vocabulary."""
    ranks, _ = _run("diloco-2x2fsdp")
    whole = diloco_sync_bytes(CONFIG, 2, H, TRAIN.steps)
    padding = (2 * -(-VOCAB_SIZE // 2) - VOCAB_SIZE) * CONFIG.d_model * 4  # one zero row of tok_emb per sync
    for k, b in enumerate(whole):
        assert ranks[0].sync_bytes[k] + ranks[1].sync_bytes[k] == b + (padding if b else 0)


def test_outer_step_is_torch_nesterov_sgd():
    """NesterovOuter by hand equals torch.optim.SGD(momentum, nesterov=True) with the averaged
    delta as the gradient, over three outer steps: the same fp32 operations up to the order of
    lr * (g + mu b) (a few ulps of each element)."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3, generator=gen))]
    ref = [torch.nn.Parameter(ours[0].detach().clone())]
    outer = NesterovOuter(ours, OUTER_LR, OUTER_MOMENTUM)
    sgd = torch.optim.SGD(ref, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for _ in range(3):
        local = ours[0].detach() + 0.1 * torch.randn(5, 3, generator=gen)  # a replica's inner steps
        with torch.no_grad():
            ours[0].copy_(local)
        delta = outer.deltas()
        ref[0].grad = delta[0].clone()
        sgd.step()
        outer.step(delta)
        torch.testing.assert_close(ours[0].detach(), ref[0].detach(), rtol=0, atol=8 * 2.0**-23 * 4)


def test_local_sgd_is_diloco_with_lr_one_and_no_momentum():
    """theta_0 - 1 * (theta_0 - mean theta_r) = mean theta_r: the two simulations agree up to the
    fp32 rounding of that subtraction (one ulp of theta per outer step), magnified by AdamW as the
    fp32 rounding of param_rms_tolerance (with lr_out = 1, mu = 0: a = 1)."""
    cfg = TrainConfig(steps=4, batch_size=8, progress=False)
    local = simulate_diloco(CONFIG, cfg, 2, 2, algorithm="local_sgd")
    outer = simulate_diloco(CONFIG, cfg, 2, 2, outer_lr=1.0, outer_momentum=0.0)
    for a, b in zip(local, outer):
        assert rms(a.final_params - b.final_params) <= param_rms_tolerance(cfg.lr, 2, 1.0, 0.0)


BAD = [
    (dict(inner_steps=0), "inner_steps=0 must be an int >= 1"),
    (dict(fragments=0), "fragments=0 must be an int >= 1"),
    (dict(fragments=4, inner_steps=4), "fragments=4 must divide n_layer=2"),
    (dict(fragments=2, inner_steps=3), "fragments=2 must divide inner_steps=3"),
    (dict(outer_momentum=1.0), "outer_momentum=1.0 must be in [0, 1)"),
    (dict(outer_momentum=-0.1), "outer_momentum=-0.1 must be in [0, 1)"),
    (dict(outer_lr=0), "outer_lr=0 must be > 0"),
    (dict(replicas=3), "world size 4 must be divisible by replicas=3"),
    (dict(algorithm="fedavg"), "algorithm='fedavg' must be one of"),
    (dict(algorithm="local_sgd", fragments=2), "algorithm='local_sgd' averages the whole model"),
    (dict(outer_dtype=torch.float16), "outer_dtype=torch.float16 must be one of"),
    (dict(replicas=4, shard=True), "shard=True needs replicas of >= 2 ranks to shard over: world size 4 / replicas=4"),
    (dict(replicas=2, shard=1), "shard=1 must be True or False"),
]


@pytest.mark.parametrize("options, words", BAD, ids=[w.split(" ")[0] for _, w in BAD])
def test_bad_input_refused_before_any_rank_starts(options, words, monkeypatch):
    monkeypatch.setattr(training, "run_on_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(ValueError) as err:
        run_diloco(ParallelDims(dp=4), CONFIG, TRAIN, **options)
    assert words in str(err.value), str(err.value)


def test_bad_layout_and_batch_refused(monkeypatch):
    monkeypatch.setattr(training, "run_on_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(ValueError, match=r"tp=2: run_diloco runs dp only"):
        run_diloco(ParallelDims(dp=2, tp=2), CONFIG, TRAIN)
    with pytest.raises(ValueError, match=r"batch_size=6 must be divisible by dp=4"):
        run_diloco(ParallelDims(dp=4), CONFIG, TrainConfig(steps=2, batch_size=6, progress=False))
    with pytest.raises(ValueError, match=r"inner_steps=0"):  # the simulation keeps the same rules
        simulate_diloco(CONFIG, TRAIN, 2, 0)


def test_package_exports():
    assert set(diloco.__all__) <= set(dir(diloco))


def test_inside_a_replica_ddp_sends_the_model_every_step():
    """Two replicas of two ranks: DDP's all-reduces inside the replica (P * 4 bytes every step,
    ddp_bytes_per_step) beside the outer sync across replicas (P * 4 every H steps), measured."""
    ranks, _ = _run("diloco-2x2ddp")
    for r in ranks:
        sent = r.comm_summary["all_reduce"]["bytes_sent"]
        assert sent == TRAIN.steps * ddp_bytes_per_step(CONFIG) + sum(r.sync_bytes)
        assert sum(r.sync_bytes) * H == TRAIN.steps * ddp_bytes_per_step(CONFIG)


def test_local_sgd_has_no_outer_optimizer(monkeypatch):
    monkeypatch.setattr(training, "run_on_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(ValueError, match=r"algorithm='local_sgd' has no outer optimizer"):
        run_diloco(ParallelDims(dp=2), CONFIG, TRAIN, algorithm="local_sgd", outer_lr=1.0)
