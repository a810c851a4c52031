"""ZeRO-3 flat shards saved as they are (no boxes), for exercise 12: reshard them by hand.

Each rank r of N writes `rank<r>.pt` holding, for every flat unit u of P_u elements, its padded
shard [r*S_u, (r+1)*S_u), S_u = ceil(P_u / N) (course_lib.parallel.zero.flat), of the
parameters and of Adam's exp_avg and exp_avg_sq, plus the step, the data generator and the
loss history. Loading at M ranks needs each new rank's shards [r*S'_u, (r+1)*S'_u) with
S'_u = ceil(P_u / M): the resharding the exercise asks for.

    train_zero3_flat(config, train_cfg, save_dir=...)          rank code: train, save flat shards
    read_flat_shards(save_dir)                                  the N rank files (weights_only)
    train_zero3_flat(config, train_cfg, resume=new_shards)     rank code: load shards, continue
"""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.parallel.zero.apply import apply_zero
from course_lib.train import StepHooks, TrainResult, share_rows, train_loop
from course_lib.runtime.device import rank_device

STATE = ("exp_avg", "exp_avg_sq")


def flat_file(directory, rank: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"rank{rank}.pt"


def read_flat_shards(directory) -> list[dict]:
    """Every rank file under directory, in rank order."""
    files = sorted(pathlib.Path(directory).glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"no rank*.pt flat shard files under {directory}")
    return [torch.load(f, weights_only=True) for f in files]


def _shard_payload(optimizer, gen, step, losses) -> dict:
    units = []
    for s in optimizer.shards:
        st = optimizer.optimizer.state[s.master]
        units.append({"numel": s.unit.numel, "param": s.master.detach().clone(),
                      **{k: st[k].clone() for k in STATE}, "step": float(st["step"])})
    return {"units": units, "step": step, "generator": gen.get_state(), "losses": list(losses)}


def _load_payload(optimizer, gen, payload, rank, world) -> tuple[int, list]:
    if len(payload["units"]) != len(optimizer.shards):
        raise ValueError(f"{len(payload['units'])} units in the shards, the model has {len(optimizer.shards)}")
    for u, (s, unit) in enumerate(zip(optimizer.shards, payload["units"])):
        if unit["numel"] != s.unit.numel or unit["param"].numel() != s.unit.shard_numel:
            raise ValueError(f"unit {u}: a shard of {unit['param'].numel()} elements of a {unit['numel']}-element "
                             f"unit, rank {rank} of {world} needs {s.unit.shard_numel} of {s.unit.numel}")
        with torch.no_grad():
            s.master.copy_(unit["param"])
        optimizer.optimizer.state[s.master] = {"step": torch.tensor(unit["step"]),
                                               **{k: unit[k].clone().to(s.master.dtype) for k in STATE}}
    gen.set_state(payload["generator"])
    return payload["step"], list(payload["losses"])


def train_zero3_flat(model_config, train_cfg, save_dir=None, resume: list[dict] | None = None,
                     group=None) -> TrainResult:
    """Rank code: ZeRO-3 (apply_zero) training of train_cfg.steps steps in all; with `resume`
    (one payload per rank of this world, e.g. resharded shards) start after their step. With
    save_dir, write this rank's flat shards at the end. train_losses: global, every step."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if train_cfg.batch_size % n:
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by world_size={n}")
    model = GPT(model_config, seed=train_cfg.seed)
    _, opt = apply_zero(model, 3, torch.optim.AdamW, group, lr=train_cfg.lr, betas=train_cfg.betas,
                        weight_decay=train_cfg.weight_decay, foreach=False)
    gen = torch.Generator().manual_seed(train_cfg.seed)
    first, losses = 1, []
    if resume is not None:
        if len(resume) != n:
            raise ValueError(f"resume holds {len(resume)} shard sets, the world has {n} ranks")
        step, losses = _load_payload(opt, gen, resume[rank], rank, n)
        first = step + 1
    dataset = CharDataset("train", block_size=model_config.block_size)

    def global_loss(loss):  # the mean over ranks, the same at any world size
        mean = torch.tensor([loss / n], dtype=torch.float64, device=rank_device())
        dist.all_reduce(mean, group=group)
        return mean.item()

    result = TrainResult(train_losses=losses)  # the steps before `first` come from the shards
    if first <= train_cfg.steps:  # else the shards hold every step already
        train_loop(model, opt, dataset, train_cfg, StepHooks(clip_grad_norm=opt.clip_grad_norm_),
                   rows=share_rows(rank, n, train_cfg.batch_size), generator=gen, first=first, result=result,
                   report_loss=global_loss)
    if save_dir is not None:
        pathlib.Path(save_dir).mkdir(parents=True, exist_ok=True)
        torch.save(_shard_payload(opt, gen, train_cfg.steps, losses), flat_file(save_dir, rank))
        dist.barrier(group=group)
    result.final_params = torch.cat([p.reshape(-1) for p in opt.full_state_dict()["params"]])
    return result
