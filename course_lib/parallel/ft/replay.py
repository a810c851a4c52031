"""The pieces of a fault-tolerant run that need no torch.distributed: its rules, its model and
data, the state a healthy peer sends to a rejoining one, and the one-process replay.

    FtConfig               R replicas, the steps, who is killed when, when the restarted one joins
    check_ft(cfg)          ValueError naming the value and the rule, in the parent
    build(cfg, seed)       the tiny MLP and its AdamW (every replica builds the same from cfg.seed)
    batch(cfg, step, slot) replica `slot`'s rows of step `step`'s global batch
    state_tensors(...)     parameters and AdamW state in one fixed order: what healing sends
    replay(cfg, quorums)   the same data and the same quorum sequence in one process
                           (replay_diloco for algorithm "diloco": local.py's run)

The replay is the reference of a fault-tolerant run: at step t with quorum Q_t (the replicas
alive), the gradient is (1/|Q_t|) sum over s in Q_t of g_s, each g_s the mean-loss gradient of
replica s's rows, summed in slot order (as the leader sums, replicas.py). During an outage the
global batch is |Q_t| * rows instead of R * rows: that, and only that, is where a run with a
failure differs from one that never failed (replay with every quorum full).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib._validate import check_int

ALGORITHMS = ("ddp", "diloco")
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # torch.optim.AdamW's per-parameter state (foreach off)


@dataclass(frozen=True)
class FtConfig:
    replicas: int = 2
    steps: int = 6
    rows: int = 4  # rows per replica per step: the global batch is replicas * rows when all are alive
    dim: int = 8
    hidden: int = 16
    lr: float = 1e-2
    seed: int = 0
    kill_slot: int | None = None  # the replica whose process is SIGKILLed ...
    kill_step: int | None = None  # ... at the start of this step (before it announces itself)
    rejoin_step: int | None = None  # the restarted replica (a spare process) joins at this step
    quorum_timeout_s: float = 3.0  # how long the live replicas wait for one that was in the last quorum
    algorithm: str = "ddp"  # "ddp": the gradient's mean every step; "diloco": local.py's outer sync every H steps
    inner_steps: int = 1  # H: DiLoCo's inner AdamW steps between syncs (1 for "ddp")
    outer_lr: float = 0.7  # DiLoCo's outer Nesterov step (Douillard et al. 2023's values)
    outer_momentum: float = 0.9

    @property
    def world(self) -> int:
        """Processes: one per replica, plus the spare that plays the restarted replica."""
        return self.replicas + (self.rejoin_step is not None)


def check_ft(cfg: FtConfig) -> None:
    """The parent's checks, before any process starts."""
    check_int("replicas", cfg.replicas, minimum=2,
              rule="an int >= 2: a quorum outlives a failure only if another replica is alive")
    check_int("steps", cfg.steps, rule="an int >= 1")
    if cfg.quorum_timeout_s <= 0:
        raise ValueError(f"quorum_timeout_s={cfg.quorum_timeout_s} must be > 0")
    if cfg.algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={cfg.algorithm!r} must be one of {ALGORITHMS}")
    check_int("inner_steps", cfg.inner_steps, rule="an int >= 1 (H: the replicas meet every H steps)")
    if cfg.algorithm == "ddp" and cfg.inner_steps != 1:
        raise ValueError(f"inner_steps={cfg.inner_steps} with algorithm='ddp': data parallelism meets every step")
    if not (isinstance(cfg.outer_lr, (int, float)) and cfg.outer_lr > 0):
        raise ValueError(f"outer_lr={cfg.outer_lr!r} must be > 0")
    if not (isinstance(cfg.outer_momentum, (int, float)) and 0 <= cfg.outer_momentum < 1):
        raise ValueError(f"outer_momentum={cfg.outer_momentum!r} must be in [0, 1)")
    if (cfg.kill_slot is None) != (cfg.kill_step is None):
        raise ValueError(f"kill_slot={cfg.kill_slot} and kill_step={cfg.kill_step}: give both or neither")
    if cfg.kill_slot is None:
        if cfg.rejoin_step is not None:
            raise ValueError(f"rejoin_step={cfg.rejoin_step} without a failure: only a killed replica rejoins")
        return
    if not 0 <= cfg.kill_slot < cfg.replicas:
        raise ValueError(f"kill_slot={cfg.kill_slot} is out of range: replicas are 0..{cfg.replicas - 1}")
    if not 1 <= cfg.kill_step <= cfg.steps:
        raise ValueError(f"kill_step={cfg.kill_step} must be in 1..steps={cfg.steps}: a kill after the last "
                         "step never happens")
    if cfg.rejoin_step is not None and not cfg.kill_step < cfg.rejoin_step <= cfg.steps:
        raise ValueError(f"rejoin_step={cfg.rejoin_step} must be in kill_step + 1..steps = {cfg.kill_step + 1}.."
                         f"{cfg.steps}: a replica rejoins after its failure and before the run ends")
    if cfg.rejoin_step is not None and cfg.rejoin_step % cfg.inner_steps:
        raise ValueError(f"rejoin_step={cfg.rejoin_step} must be a multiple of inner_steps={cfg.inner_steps}: "
                         f"a replica joins at a sync, when every replica holds the outer copy")


def build(cfg: FtConfig, seed: int):
    """The MLP dim -> hidden -> 1 (tanh) with seed's initial weights, and its AdamW (foreach off)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(cfg.dim, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=False)


def batch(cfg: FtConfig, step: int, slot: int):
    """Rows [slot * rows, (slot + 1) * rows) of step's global batch (one generator per step, seeded
    from cfg.seed: every replica and the replay draw the same), a noisy linear target."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    x = torch.randn(cfg.replicas * cfg.rows, cfg.dim, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(x.shape[0], 1, generator=g)
    rows = slice(slot * cfg.rows, (slot + 1) * cfg.rows)
    return x[rows], y[rows]


def local_gradient(model, cfg: FtConfig, step: int, slot: int) -> tuple[float, torch.Tensor]:
    """(loss, flat gradient) of replica slot's rows at step."""
    model.zero_grad(set_to_none=True)
    x, y = batch(cfg, step, slot)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def set_gradient(model, flat: torch.Tensor) -> None:
    at = 0
    for p in model.parameters():
        p.grad = flat[at:at + p.numel()].view_as(p).clone()
        at += p.numel()


def mean_in_slot_order(grads: list[torch.Tensor]) -> torch.Tensor:
    """(1/Q) sum, in the order given (slot order): the leader's arithmetic and the replay's."""
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total / len(grads)


def state_tensors(model, optimizer) -> list[torch.Tensor]:
    """Every parameter, then each parameter's AdamW state (step, exp_avg, exp_avg_sq), in model
    order: the whole-tensor boxes healing sends. A replica that never stepped gets zero state
    first (what a restarted process holds), so a receiver has the same list to fill."""
    params = list(model.parameters())
    for p in params:
        if not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return [p.data for p in params] + [optimizer.state[p][k] for p in params for k in ADAM_KEYS]


def flat_state(model, optimizer) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in state_tensors(model, optimizer)]).clone()


@torch.no_grad()
def load_flat_state(model, optimizer, flat: torch.Tensor) -> None:
    at = 0
    for t in state_tensors(model, optimizer):
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def replay(cfg: FtConfig, quorums: dict[int, list[int]]) -> dict:
    """One process: for t = 1..steps, the mean over quorums[t]'s replicas of their gradients, then
    AdamW. {"final_params": flat, "losses": {t: {slot: loss}}}. For algorithm "diloco",
    replay_diloco (quorums then name the sync steps only)."""
    if cfg.algorithm == "diloco":
        return replay_diloco(cfg, quorums)
    model, optimizer = build(cfg, cfg.seed)
    losses = {}
    for t in range(1, cfg.steps + 1):
        grads, losses[t] = [], {}
        for s in sorted(quorums[t]):
            losses[t][s], g = local_gradient(model, cfg, t, s)
            grads.append(g)
        set_gradient(model, mean_in_slot_order(grads))
        optimizer.step()
    return {"final_params": flat_params(model), "losses": losses}


def replay_diloco(cfg: FtConfig, quorums: dict[int, list[int]]) -> dict:
    """DiLoCo's fault-tolerant run in one process (local.py runs it on processes): every alive
    replica takes an AdamW step on its rows at every step (the killed slot from kill_step on is
    not alive; a joiner is alive after its sync). At a sync step t (t % H == 0) the replicas of
    quorums[t] that were alive give Delta_s = theta_0 - theta_s, averaged in slot order;
    torch.optim.SGD(nesterov=True) steps theta_0 with the mean as its gradient (the ranks' step
    is written by hand, parallel.diloco.outer.NesterovOuter); every alive replica <- theta_0; a
    joiner then takes the lowest contributor's parameters and AdamW state. {"final_params":
    theta_0 after the last sync, "replica_params": {slot: flat} of the replicas alive at the
    end, "losses": {t: {slot: loss}}}."""
    pairs = [build(cfg, cfg.seed) for _ in range(cfg.replicas)]
    outer, _ = build(cfg, cfg.seed)  # theta_0
    # torch refuses nesterov=True without momentum; with mu = 0 Nesterov's step is plain SGD's
    outer_opt = torch.optim.SGD(outer.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                nesterov=cfg.outer_momentum > 0)
    alive, losses = set(range(cfg.replicas)), {}
    for t in range(1, cfg.steps + 1):
        if t == cfg.kill_step:
            alive.discard(cfg.kill_slot)
        losses[t] = {}
        for s in sorted(alive):
            losses[t][s], _ = local_gradient(pairs[s][0], cfg, t, s)
            pairs[s][1].step()
        if t % cfg.inner_steps:
            continue
        stayed = [s for s in sorted(quorums[t]) if s in alive]
        set_gradient(outer, mean_in_slot_order([flat_params(outer) - flat_params(pairs[s][0]) for s in stayed]))
        outer_opt.step()
        with torch.no_grad():
            for s in stayed:
                for p, p0 in zip(pairs[s][0].parameters(), outer.parameters()):
                    p.copy_(p0)
        for j in sorted(set(quorums[t]) - alive):
            load_flat_state(*pairs[j], flat_state(*pairs[stayed[0]]))
            alive.add(j)
    return {"final_params": flat_params(outer), "losses": losses,
            "replica_params": {s: flat_params(pairs[s][0]) for s in sorted(alive)}}
