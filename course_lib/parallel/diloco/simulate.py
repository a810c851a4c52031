"""LocalSGD and DiLoCo in one process: the replicas computed in turn, the reference of the ranks.

Same seed (every replica and the outer copy start from GPT(config, seed)), same draws (one
generator seeded with train_cfg.seed gives each step's global batch), same shards (replica r
trains on rows [r B / R, (r + 1) B / R)). After step t the due fragments are synced:

    LocalSGD   theta_r <- mean over r of theta_r                     (torch.stack(...).mean(0))
    DiLoCo     Delta = theta_0 - (1/R) sum_r theta_r, cast to outer_dtype replica by replica and
               summed in fp32 in replica order; torch.optim.SGD(momentum=mu, nesterov=True) steps
               theta_0 with Delta as its gradient; theta_r <- theta_0

The outer step is torch's own Nesterov SGD here and the course's hand-written one on the ranks
(outer.NesterovOuter), and the schedule is written out again below, so an equality between the
two checks the outer step and the schedule, not only the communication.
"""

from __future__ import annotations

import torch

from course_lib.data import CharDataset, collate, sample_indices
from course_lib.model import GPT
from course_lib.parallel.diloco.outer import check_diloco, fragment_index
from course_lib.train import TrainResult, flat_params, make_optimizer, share_rows, train_step


def param_rms_tolerance(lr: float, inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                        fragments: int = 1, outer_dtype=torch.float32, algorithm: str = "diloco") -> float:
    """How far (RMS over the elements) a correct run's parameters may be from the simulation's
    (simulate_diloco's arguments; the fragments do not change it: each element still has one
    outer step per H steps).

    fp32: the same steps with fp32 sums in another order (the all-reduce of the replicas'
    deltas, DDP's mean inside a replica), which AdamW magnifies to ~1e-4 lr in RMS (measured on
    the tiny GPT, tests/_tolerances.py), 10x for margin: 1e-3 lr; the outer Nesterov step scales
    a difference in the replicas' mean by at most a = lr_out (1 + mu + mu^2 + ...) = lr_out / (1 - mu)
    (7 for the paper's 0.7, 0.9; LocalSGD's average: 1). So 1e-3 a lr. Measured: <= 1.1e-4 lr; a
    sign error in the outer step moved the parameters by 13 lr, plain momentum for Nesterov's by ~lr.
    bf16 on the wire: those differences can put a delta on the other side of a bf16 rounding
    boundary, one bf16 spacing (2^-8 of |Delta| <= 2^-8 H lr, H AdamW steps of at most ~lr each)
    times a for the element that flips; only elements within the fp32 difference of a boundary
    flip (measured: 7.7e-4 lr in RMS at H = 2): allowed, one element in 16 flipping, RMS
    2^-8 H a lr / 4, on top of the fp32 term (0.02 lr at H = 2 with the paper's outer step)."""
    a = 1.0 if algorithm == "local_sgd" else outer_lr / (1 - outer_momentum)
    tol = 1e-3 * a * lr
    if outer_dtype != torch.float32:
        tol += 2.0**-8 * inner_steps * a * lr / 4
    return tol


def _synced(step: int, fragment: int, inner_steps: int, fragments: int) -> bool:
    offset = fragment * inner_steps // fragments
    return step >= offset and (step - offset) % inner_steps == 0


def simulate_diloco(model_config, train_cfg, replicas: int, inner_steps: int, outer_lr: float = 0.7,
                    outer_momentum: float = 0.9, fragments: int = 1, outer_dtype=torch.float32,
                    algorithm: str = "diloco") -> list[TrainResult]:
    """One TrainResult per replica (train_losses: the replica's batch loss per step; final_params
    its copy after the last step), algorithm "diloco" or "local_sgd" (the outer options unused)."""
    check_diloco(replicas, replicas, inner_steps, model_config.n_layer, fragments, outer_lr, outer_momentum,
                 outer_dtype, algorithm)
    dataset = CharDataset("train", block_size=model_config.block_size)
    models = [GPT(model_config, seed=train_cfg.seed) for _ in range(replicas)]
    optimizers = [make_optimizer(m, train_cfg) for m in models]
    outer = GPT(model_config, seed=train_cfg.seed)  # theta_0
    # torch refuses nesterov=True without momentum; with mu = 0 Nesterov's step is plain SGD's
    outer_opt = torch.optim.SGD(outer.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    names = [n for n, _ in outer.named_parameters()]
    results = [TrainResult() for _ in range(replicas)]
    gen = torch.Generator().manual_seed(train_cfg.seed)
    for step in range(1, train_cfg.steps + 1):
        idx = sample_indices(len(dataset), train_cfg.batch_size, gen)
        for r, (model, opt) in enumerate(zip(models, optimizers)):
            x, y = collate(dataset, idx[share_rows(r, replicas, train_cfg.batch_size)])
            results[r].train_losses.append(train_step(model, opt, x, y, train_cfg.grad_clip))
        per_replica = [dict(m.named_parameters()) for m in models]
        with torch.no_grad():
            if algorithm == "local_sgd":
                if step % inner_steps == 0:
                    for name in names:
                        mean = torch.stack([p[name] for p in per_replica]).mean(0)
                        for p in per_replica:
                            p[name].copy_(mean)
                continue
            synced = [n for n in names if _synced(step, fragment_index(n, fragments, model_config.n_layer),
                                                    inner_steps, fragments)]
            if not synced:
                continue
            for name, p0 in outer.named_parameters():  # SGD skips the parameters without a gradient
                p0.grad = None
                if name in synced:
                    total = torch.zeros_like(p0)
                    for p in per_replica:
                        total += (p0 - p[name]).to(outer_dtype).float()
                    p0.grad = total / replicas
            outer_opt.step()
            for name, p0 in outer.named_parameters():
                if name in synced:
                    for p in per_replica:
                        p[name].copy_(p0)
    for result, model in zip(results, models):
        result.final_params = flat_params(model)
    return results
