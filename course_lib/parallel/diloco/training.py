"""LocalSGD and DiLoCo on ranks: R replicas of W / R ranks each, meeting every H steps.

    rank = replica * S + j           S = W / R ranks per replica (neighbours: one node, say)
    replica group  {replica * S + j, j < S}     DDP's gradients every step (when S > 1)
    across group   {i * S + j, i < R}           the outer sync, every H steps (outer.py)

Every rank draws the reference's global batch indices (course_lib.loop.train_loop) and keeps
its share share_rows(rank, W, B): replica r reads rows [r B / R, (r + 1) B / R), split among
its S ranks. Each replica trains its own copy with AdamW (make_optimizer, the reference's), its
S ranks kept equal by DDP; after step t the due fragments are synced across replicas. The
result equals simulate.simulate_diloco, which computes the replicas in turn in one process.

shard=True: each replica shards its model over its S ranks instead of replicating it (ZeRO-3 /
FSDP, course_lib.parallel.zero's per-parameter design: every tensor cut on dim 0, AdamW on the
local rows with make_optimizer's two weight-decay groups). The replica and across groups are
then HSDP's shard and replicate groups (zero/hsdp.py's layout), and the outer step runs on
shards: rank j keeps theta_0 and b of its rows only and averages its rows' delta with rank j of
every other replica (the same rows: every replica cuts the same way), so a sync moves ~1/S of
the model per rank (estimate.traffic.diloco: shards). The algorithm is unchanged, so the
reference is the same simulate_diloco.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single
from course_lib.comm.process_groups import own_group
from course_lib.data import CharDataset
from course_lib.dims import ParallelDims, check_runner
from course_lib.loop import StepHooks
from course_lib.model import GPT
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.diloco.outer import NesterovOuter, check_diloco, due, fragment_params
from course_lib.parallel.dp.apply import apply_data_parallel
from course_lib.parallel.zero.apply import apply_zero
from course_lib.parallel.zero.per_param_optim import gather_full_parameters
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import TrainResult, flat_params, make_optimizer, share_rows, train_loop


@dataclass
class DilocoResult(TrainResult):
    """A rank's TrainResult, plus its replica and, when traced, the bytes it sent across
    replicas after each step (CommTracer's bytes_sent of the calls on the across group)."""

    replica: int = 0
    sync_bytes: list[int] = field(default_factory=list)


def replica_lists(world_size: int, replicas: int) -> dict[str, list[list[int]]]:
    """{"replica": each replica's ranks, "across": the ranks with the same place in every replica}."""
    s = world_size // replicas
    return {"replica": [[i * s + j for j in range(s)] for i in range(replicas)],
            "across": [[i * s + j for i in range(replicas)] for j in range(s)]}


def average(tensors, group, replicas: int, outer_dtype=torch.float32) -> list[torch.Tensor]:
    """(1/R) sum over the replicas of each tensor, in one collective on a flat buffer: an
    all-reduce in fp32; in a lower precision an all-gather of the cast values, summed in fp32 in
    replica order (the low precision is the wire's only: Douillard et al. 2025 accumulate in fp32)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if outer_dtype == torch.float32:
        if replicas > 1:  # one replica (plain DDP, the straggler demo's --ddp) sends nothing: the formula's 0 B
            dist.all_reduce(flat, group=group)
        total = flat
    else:
        low = flat.to(outer_dtype)
        out = torch.empty(replicas * low.numel(), dtype=outer_dtype, device=low.device)
        all_gather_single(out, low, group=group)
        total = torch.zeros_like(flat)
        for part in out.view(replicas, -1):
            total += part.float()
    total /= replicas
    return list(torch.split(total, [t.numel() for t in tensors]))


class LocalSGDSync:
    """After every H-th step: theta_r <- (1/R) sum_r theta_r (outer.py)."""

    def __init__(self, model, group, replicas: int, inner_steps: int):
        self.params = list(model.parameters())
        self.group, self.replicas, self.inner_steps = group, replicas, inner_steps

    @torch.no_grad()
    def after(self, step: int) -> None:
        if step % self.inner_steps:
            return
        for p, mean in zip(self.params, average([p.detach() for p in self.params], self.group, self.replicas)):
            p.copy_(mean.view_as(p))


class DilocoSync:
    """After step t, for each due fragment: Delta averaged over the replicas, then the outer
    Nesterov step of that fragment (outer.NesterovOuter)."""

    def __init__(self, model, group, replicas: int, inner_steps: int, outer_lr: float, outer_momentum: float,
                 fragments: int = 1, outer_dtype=torch.float32):
        self.outer = [NesterovOuter(ps, outer_lr, outer_momentum) for ps in fragment_params(model, fragments)]
        self.group, self.replicas, self.inner_steps, self.dtype = group, replicas, inner_steps, outer_dtype

    def after(self, step: int) -> None:
        for f in due(step, self.inner_steps, len(self.outer)):
            outer = self.outer[f]
            mean = average(outer.deltas(), self.group, self.replicas, self.dtype)
            outer.step([m.view_as(p) for m, p in zip(mean, outer.params)])


def slowed(hooks: StepHooks, delay_s: float) -> StepHooks:
    """hooks whose loss_fn first sleeps delay_s (a straggler: inside the timed step, before the
    forward; the numbers are unchanged). delay_s = 0 returns hooks itself."""
    if not delay_s:
        return hooks
    loss_fn = hooks.loss_fn

    def late_loss(model, x, y):
        time.sleep(delay_s)
        return loss_fn(model, x, y)
    return dataclasses.replace(hooks, loss_fn=late_loss)


def check_shard(world_size: int, replicas: int, shard: bool) -> None:
    """shard=True needs replicas of two or more ranks (ValueError naming the values and the rule)."""
    if not isinstance(shard, bool):
        raise ValueError(f"shard={shard!r} must be True or False")
    if shard and world_size // replicas < 2:
        raise ValueError(f"shard=True needs replicas of >= 2 ranks to shard over: world size {world_size} / "
                         f"replicas={replicas} = {world_size // replicas}")


def _shard(model, train_cfg, group):
    """The replica's model sharded over its ranks (FSDP2-style, course_lib.parallel.zero) and the
    AdamW of make_optimizer on its local rows; (model, optimizer, hooks)."""
    model, optimizer = apply_zero(model, 3, torch.optim.AdamW, group, sharding="per_param", decay_groups=True,
                                  lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay,
                                  foreach=False, fused=False)
    return model, optimizer, StepHooks(clip_grad_norm=optimizer.clip_grad_norm_)


def _train(model_config, train_cfg, replicas: int, make_sync, trace: bool, delay_s: float = 0.0,
           shard: bool = False) -> DilocoResult:
    """The rank loop both trainers share: groups, DDP (or with shard FSDP) inside a replica, the
    sync after each step; delay_s: this rank sleeps that long in every step (slowed)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    s = world // replicas
    lists = replica_lists(world, replicas)
    replica_group = own_group(lists["replica"], rank) if s > 1 else None
    across = own_group(lists["across"], rank) if s > 1 else dist.group.WORLD
    across_ranks = tuple(next(r for r in lists["across"] if rank in r))
    dev = rank_device()
    model = GPT(model_config, seed=train_cfg.seed).to(dev)
    names = [n for n, _ in model.named_parameters()]
    module, hooks = model, StepHooks()
    if shard:  # the replica's S ranks: one model sharded over them
        module, optimizer, hooks = _shard(model, train_cfg, replica_group)
    elif s > 1:  # the replica's S ranks: data parallel every step
        dp = apply_data_parallel(model, replica_group, "ddp")
        module, hooks = dp.module, dp.hooks()
    hooks = slowed(hooks, delay_s)
    if not shard:
        optimizer = make_optimizer(model, train_cfg)
    sync = make_sync(model, across)
    result = DilocoResult(replica=rank // s).set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    tracer = CommTracer() if trace else None
    seen = [0]

    def on_step(step, loss):
        sync.after(step)
        if tracer is not None:
            new, seen[0] = tracer.records[seen[0]:], len(tracer.records)
            result.sync_bytes.append(sum(r.bytes_sent for r in new if r.group_ranks == across_ranks))

    train_loop(module, optimizer, CharDataset("train", block_size=model_config.block_size), train_cfg, hooks,
               rows=share_rows(rank, world, train_cfg.batch_size), device=dev, result=result, tracer=tracer,
               on_step=on_step)
    if shard:  # the replica's full parameters, gathered from its ranks' rows (collective in the replica)
        full = gather_full_parameters(model.per_param)
        result.final_params = torch.cat([full[n].reshape(-1) for n in names]).cpu()
    else:
        result.final_params = flat_params(model)
    return result


def train_local_sgd(model_config, train_cfg, replicas: int, inner_steps: int, trace: bool = False,
                    delay_s: float = 0.0, shard: bool = False) -> DilocoResult:
    """Rank code (the default group): LocalSGD with R replicas averaging their parameters every
    H = inner_steps steps. train_losses are this rank's share's; final_params its copy's;
    delay_s > 0 makes this rank a straggler (it sleeps that long in every step); shard=True
    shards each replica over its ranks (module docstring)."""
    check_diloco(dist.get_world_size(), replicas, inner_steps, model_config.n_layer, algorithm="local_sgd")
    check_shard(dist.get_world_size(), replicas, shard)
    return _train(model_config, train_cfg, replicas,
                  lambda model, group: LocalSGDSync(model, group, replicas, inner_steps), trace, delay_s, shard)


def train_diloco(model_config, train_cfg, replicas: int, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, fragments: int = 1, outer_dtype=torch.float32,
                 trace: bool = False, delay_s: float = 0.0, shard: bool = False) -> DilocoResult:
    """Rank code (the default group): DiLoCo, H = inner_steps AdamW steps per replica between
    outer Nesterov steps on the averaged delta (outer.py; the paper's lr 0.7, momentum 0.9 by
    default); fragments = F > 1 is Streaming DiLoCo, outer_dtype the delta's wire precision;
    delay_s and shard as train_local_sgd's (with shard the outer step runs on each rank's rows)."""
    check_diloco(dist.get_world_size(), replicas, inner_steps, model_config.n_layer, fragments, outer_lr,
                 outer_momentum, outer_dtype)
    check_shard(dist.get_world_size(), replicas, shard)
    return _train(model_config, train_cfg, replicas,
                  lambda model, group: DilocoSync(model, group, replicas, inner_steps, outer_lr, outer_momentum,
                                                  fragments, outer_dtype), trace, delay_s, shard)


def check_run(dims, model_config, train_cfg, replicas, inner_steps, algorithm="diloco", outer_lr=0.7,
              outer_momentum=0.9, fragments=1, outer_dtype=torch.float32, shard=False) -> int:
    """The parent's checks of run_diloco (and the demo's): returns the replica count."""
    check_runner(dims, "run_diloco", ("dp",))
    replicas = dims.dp if replicas is None else replicas
    check_diloco(dims.dp, replicas, inner_steps, model_config.n_layer, fragments, outer_lr, outer_momentum,
                 outer_dtype, algorithm)
    check_shard(dims.dp, replicas, shard)
    if train_cfg.batch_size % dims.dp:
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by dp={dims.dp}: every rank "
                         f"takes an equal share of its replica's rows")
    dims.check_model(model_config, train_cfg.batch_size)
    return replicas


def run_diloco(dims: ParallelDims, model_config, train_cfg, replicas: int | None = None, inner_steps: int = 4,
               algorithm: str = "diloco", outer_lr: float = 0.7, outer_momentum: float = 0.9, fragments: int = 1,
               outer_dtype=torch.float32, trace: bool = False, backend: str = "gloo", timeout_s: float = 120,
               check_collectives: bool = True, shard: bool = False) -> list[DilocoResult]:
    """Parent side: dims.dp ranks as `replicas` replicas (default dims.dp: one rank each) running
    algorithm "diloco" (train_diloco) or "local_sgd" (train_local_sgd; the outer options must
    stay at their defaults); shard=True shards each replica over its ranks (FSDP, module
    docstring). Every rule is checked here, before any rank starts."""
    replicas = check_run(dims, model_config, train_cfg, replicas, inner_steps, algorithm, outer_lr,
                         outer_momentum, fragments, outer_dtype, shard)
    common = dict(world_size=dims.dp, backend=backend, timeout_s=timeout_s, check_collectives=check_collectives)
    if algorithm == "local_sgd":
        if (outer_lr, outer_momentum) != (0.7, 0.9):
            raise ValueError("algorithm='local_sgd' has no outer optimizer: leave outer_lr and outer_momentum")
        return run_on_ranks(train_local_sgd, model_config, train_cfg, replicas, inner_steps, trace=trace, shard=shard,
                            **common)
    return run_on_ranks(train_diloco, model_config, train_cfg, replicas, inner_steps, outer_lr, outer_momentum,
                        fragments, outer_dtype, trace=trace, shard=shard, **common)
