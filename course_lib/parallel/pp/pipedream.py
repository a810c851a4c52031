"""PipeDream-2BW (Narayanan et al., 2021, "Memory-efficient pipeline-parallel DNN training"):
an asynchronous pipeline. No flush between steps, two weight versions per stage, and every
update one step stale.

The ranks run 1F1B over all N*m micro-batches of N steps at once (schedules.one_f_one_b(p, N*m)):
the forwards of step t+1 start while the backwards of step t are still draining, so the fill and
the drain happen once per run, not once per step. A stage updates its weights on its own as soon
as the last backward of a step has run on it, with no synchronisation with the other stages. The
rule that makes this consistent (batch t = the t-th batch, W_t = the weights after t updates):

    every micro-batch of batch t runs forward AND backward with W_{t-1}     (W_{-1} := W_0)
    W_{t+1} = optimizer_step(W_t, g_t),  g_t = grad of batch t's mean loss at W_{t-1}

(SGD: w_{t+1} = w_t - lr * grad f_t(w_{t-1}), the paper's one-step-delayed update.) Using one
version for the forward and the backward of a micro-batch is PipeDream's weight stashing
(Narayanan et al., 2019); using the same version for the whole batch on every stage is 2BW's
"double buffering". With m >= p every stage reaches the first forward of batch t after the last
backward of batch t-2 (when W_{t-1} was made), and the micro-batches in flight span at most two
batches, so each stage stashes at most two versions: W_{t-1} for the batch in flight and W_t
for the next one (measured: PipedreamResult.versions_held). Here the optimizer's own weights are
a third copy (the master weights the next update writes into).

Not here: a global gradient-norm clip (it would need every stage's norm before any update, the
synchronisation 2BW removes: grad_clip must be 0) and a tied embedding/head across the first and
last stage (each update would wait for the other end's half of the gradient: tie_weights=False).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib._validate import check_int
from course_lib.data import CharDataset, collate, sample_indices
from course_lib.dims import ParallelDims, check_runner, split_layers
from course_lib.model import GPT
from course_lib.parallel.pp.p2p_plan import Mailbox, plan_messages
from course_lib.parallel.pp.schedules import one_f_one_b
from course_lib.parallel.pp.stage import build_stage
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import flat_params, make_optimizer


@dataclass
class PipedreamResult:
    train_losses: list[float] = field(default_factory=list)  # batch t's mean loss, at W_{t-1}
    final_params: torch.Tensor | None = None  # this stage's, in param_names order
    param_names: list[str] = field(default_factory=list)
    param_shapes: list[tuple] = field(default_factory=list)
    versions_held: list[tuple[int, ...]] = field(default_factory=list)  # after each action: stashed versions
    version_used: dict[int, int] = field(default_factory=dict)  # batch t -> the version its micro-batches ran
    version_bytes: int = 0  # one stashed copy of this stage's weights
    step_seconds: list[float] = field(default_factory=list)  # between this stage's updates (no step boundary)


def check_2bw(model_config, world_size: int, n_microbatches: int, train_cfg) -> None:
    """PipeDream-2BW's rules, checked before any rank starts."""
    for name, value in (("world_size", world_size), ("n_microbatches", n_microbatches)):
        check_int(name, value)
    if n_microbatches < world_size:
        raise ValueError(f"pipedream_2bw needs n_microbatches >= the {world_size} stages (got {n_microbatches}): "
                         f"with fewer, micro-batches of three batches would be in flight and two weight "
                         f"versions per stage would not suffice")
    if train_cfg.batch_size % n_microbatches:
        raise ValueError(f"batch size {train_cfg.batch_size} must be divisible by n_microbatches={n_microbatches}")
    if train_cfg.grad_clip:
        raise ValueError(f"pipedream_2bw updates each stage on its own: grad_clip={train_cfg.grad_clip} needs the "
                         f"global gradient norm of all stages, a synchronisation it does not have (use 0)")
    if getattr(model_config, "tie_weights", False) and world_size > 1:
        raise ValueError("pipedream_2bw needs tie_weights=False: a tied embedding/head would make the first and "
                         "last stage wait for each other's half of its gradient at every update")
    split_layers(model_config.n_layer, world_size)


def _batches(model_config, train_cfg):
    """The train_loop's batches (same generator, same draws), on the CPU."""
    dataset = CharDataset("train", block_size=model_config.block_size)
    gen = torch.Generator().manual_seed(train_cfg.seed)
    return [collate(dataset, sample_indices(len(dataset), train_cfg.batch_size, gen)) for _ in range(train_cfg.steps)]


def _mean_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference_2bw(model_config, train_cfg, n_microbatches: int) -> PipedreamResult:
    """The same delayed update in one process: batch t's gradient taken at W_{t-1} (its m
    micro-batches, loss L = (1/m) sum_j L_j, as the pipeline), applied to W_t by AdamW."""
    check_2bw(model_config, 1, n_microbatches, train_cfg)
    model = GPT(model_config, seed=train_cfg.seed)
    optimizer = make_optimizer(model, train_cfg)
    stale = copy.deepcopy(model)  # W_{t-1}; W_{-1} = W_0
    out = PipedreamResult(param_names=[n for n, _ in model.named_parameters()])
    for t, (x, y) in enumerate(_batches(model_config, train_cfg)):
        losses = []
        for xj, yj in zip(x.chunk(n_microbatches), y.chunk(n_microbatches)):
            loss = _mean_loss(stale(xj)[0], yj)
            (loss / n_microbatches).backward()
            losses.append(loss.detach())
        out.train_losses.append(float(torch.stack(losses).mean()))
        current = copy.deepcopy(model)  # W_t: the version batch t+1 will use
        for p, q in zip(model.parameters(), stale.parameters()):
            p.grad = q.grad
        optimizer.step()  # W_{t+1} = step(W_t, g_t(W_{t-1}))
        optimizer.zero_grad(set_to_none=True)
        stale = current
    out.final_params = flat_params(model)
    out.param_shapes = [tuple(p.shape) for p in model.parameters()]
    return out


def train_2bw(model_config, train_cfg, n_microbatches: int, group=None) -> PipedreamResult:
    """Rank code: train_cfg.steps steps of PipeDream-2BW on this rank's stage (one chunk)."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    check_2bw(model_config, p, n_microbatches, train_cfg)
    m, N, dev = n_microbatches, train_cfg.steps, rank_device()
    stage = build_stage(GPT(model_config, seed=train_cfg.seed).to(dev), group, 1)
    optimizer = make_optimizer(stage, train_cfg)
    live, first, last = list(stage.parameters()), rank == 0, rank == p - 1
    res = PipedreamResult(param_names=list(stage.param_names), param_shapes=[tuple(q.shape) for q in live],
                          version_bytes=sum(q.numel() * q.element_size() for q in live))
    xs, ys = [], []  # micro-batch k of the run is micro-batch k % m of batch k // m
    for x, y in _batches(model_config, train_cfg):
        xs += [c.to(dev) for c in x.chunk(m)]
        ys += [c.to(dev) for c in y.chunk(m)]
    mb, T = xs[0].shape
    d = model_config.d_model
    versions = {0: copy.deepcopy(stage.chunks[0])}  # version k = W_k, a module the forwards run
    saved, losses = {}, [[] for _ in range(N)]
    sched = one_f_one_b(p, N * m)
    # Messages in batches every rank issues in the same order (NCCL's rules: p2p_plan.py).
    box = Mailbox(plan_messages(sched), rank, group, lambda: torch.empty(mb, T, d, device=dev))

    def peer(r):
        return dist.get_global_rank(group, r) if group is not None else r

    def send(t, key, i):
        box.put(key, t)
        box.issue(box.rounds[i] + 1)

    def update(t):  # batch t's last backward ran here: W_{t+1} = step(W_t, g_t(W_{t-1}))
        res.step_seconds.append(time.perf_counter() - clock[-1])
        clock.append(time.perf_counter())
        used = versions[max(t - 1, 0)]
        for q, v in zip(live, used.parameters()):
            q.grad, v.grad = v.grad, None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if t >= 1:
            del versions[t - 1]  # batch t, its last user, is done
        versions[t + 1] = copy.deepcopy(stage.chunks[0])  # for batch t+2

    clock = [time.perf_counter()]
    for i, act in enumerate(sched.actions[rank]):
        box.issue(box.rounds[i])
        k = act.microbatch
        t = k // m
        version = versions[max(t - 1, 0)]
        if act.kind == "F":
            res.version_used[t] = max(t - 1, 0)
            if first:
                inp = xs[k]
            else:
                inp = box.get(("F", k, rank)).requires_grad_()
            out = version(inp)
            if last:
                loss = _mean_loss(out, ys[k])
                losses[t].append(loss.detach())
                out = loss / m
            else:
                send(out, ("F", k, rank + 1), i)
            saved[k] = (inp, out)
        else:
            inp, out = saved.pop(k)
            dy = None
            if not last:
                dy = box.get(("B", k, rank + 1))
            torch.autograd.backward(out, dy)
            if not first:
                send(inp.grad, ("B", k, rank), i)
            if k % m == m - 1:
                update(t)
        res.versions_held.append(tuple(sorted(versions)))
    box.finish()
    mean = torch.tensor([float(torch.stack(ls).mean()) if last else 0.0 for ls in losses], device=dev)
    dist.broadcast(mean, peer(p - 1), group=group)
    res.train_losses = mean.tolist()
    res.final_params = flat_params(stage)
    return res


def run_2bw(dims: ParallelDims, model_config, train_cfg, backend: str = "gloo",
            timeout_s: float = 120) -> list[PipedreamResult]:
    """Parent side: dims runs pp and microbatches with schedule='pipedream_2bw' only; check
    PipeDream-2BW's rules and the rule book's check_model, then train_2bw on dims.pp ranks."""
    check_runner(dims, "run_2bw", ("pp", "schedule", "microbatches"))
    if dims.schedule != "pipedream_2bw":
        raise ValueError(f"schedule={dims.schedule!r}: run_2bw runs schedule='pipedream_2bw' (flushed schedules "
                         f"run in run_pipeline)")
    check_2bw(model_config, dims.pp, dims.microbatches, train_cfg)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_2bw, model_config, train_cfg, dims.microbatches, world_size=dims.pp,
                        backend=backend, timeout_s=timeout_s)
