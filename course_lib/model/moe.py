"""The mixture-of-experts layer: a router plus n_experts expert MLPs in place of a block's MLP.

With N tokens x_n (rows of d), E experts, k = top_k (notebook 07):

    logits  z = x W_r                   (N, E)   W_r: the router, d x E, no bias
    probs   p = softmax(z)              (N, E)   in fp32
    choice  e_n1 .. e_nk = the k largest p_n,e;  gate g_nj = p_n,e_nj / sum_j' p_n,e_nj'
            (top_k = 1 keeps the raw probability g = p_n,e: renormalised it would always be 1
            and the router would learn nothing from the language-model loss, Fedus et al. 2021)
    output  y_n = sum over the kept choices j of g_nj * expert_e_nj(x_n)

Capacity. Each expert processes at most C = ceil(capacity_factor * k * N / E) assignments
(None: no limit). Assignments queue slot-major, all first choices (in token order) before
any second choice (Lepikhin et al. 2021, GShard); one that finds its expert's queue full is
dropped: its term is missing from y_n and the token passes on through the residual alone.

Auxiliary losses, summed over layers and added to the model's loss (GPT.forward):

    load balance  L_bal = E * sum_e f_e * P_e     f_e = (assignments to e, before capacity) / (k N)
                                                  P_e = mean_n p_n,e       (Fedus et al. 2021)
                  = 1 when both are uniform; grows as tokens pile onto few experts.
    router z      L_z = mean_n (logsumexp_e z_n,e)^2   keeps the logits small (Zoph et al. 2022)
    loss = cross-entropy + aux_loss_coef * sum L_bal + z_loss_coef * sum L_z

The layer computes in three steps that expert parallelism (course_lib.parallel.ep) reuses:
`route` (who goes where, sorted by expert), `self.experts(rows, counts)` (the only step that
changes under EP: it swaps this module), and the gated scatter-add back to the tokens.
After each forward, `layer.last_stats` holds the routing counts of that batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.layers import MLP


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """C = ceil(capacity_factor * top_k * tokens / n_experts), or None when there is no limit."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * top_k * tokens / n_experts)


@dataclass
class RoutingStats:
    """Routing counts of one layer on one batch (this process's tokens)."""

    routed: torch.Tensor  # (E,) int64: assignments that chose each expert, before capacity
    kept: torch.Tensor  # (E,) int64: those the expert processed (routed - kept were dropped)
    tokens: int  # N
    capacity: int | None  # C, or None

    @property
    def dropped(self) -> torch.Tensor:
        return self.routed - self.kept

    @property
    def drop_fraction(self) -> float:
        """Dropped assignments / all assignments (k N)."""
        return float(self.dropped.sum()) / max(1, int(self.routed.sum()))


@dataclass
class Routing:
    """The kept assignments, sorted by expert (stable: queue order within an expert)."""

    token: torch.Tensor  # (M,) int64: the token of each assignment
    expert: torch.Tensor  # (M,) int64: its expert, non-decreasing
    gate: torch.Tensor  # (M,) its gate weight (differentiable: the router learns through it)
    counts: list[int]  # (E,) assignments per expert: counts[e] rows of the sorted block go to e
    stats: RoutingStats


def route(probs: torch.Tensor, top_k: int, capacity: int | None) -> Routing:
    """Top-k choice, gate weights, capacity, and the sort by expert. probs: (N, E) softmax."""
    n_tokens, n_experts = probs.shape
    gate, expert = probs.topk(top_k, dim=-1)  # (N, k), largest first
    if top_k > 1:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    # Slot-major: every first choice (in token order) queues before any second choice.
    expert = expert.t().reshape(-1)
    gate = gate.t().reshape(-1)
    token = torch.arange(n_tokens, device=probs.device).repeat(top_k)
    routed = torch.bincount(expert, minlength=n_experts)
    if capacity is not None:
        # position of each assignment in its expert's queue: earlier assignments to the same expert
        position = F.one_hot(expert, n_experts).cumsum(0).gather(1, expert[:, None]).squeeze(1) - 1
        keep = position < capacity
        token, expert, gate = token[keep], expert[keep], gate[keep]
    order = torch.argsort(expert, stable=True)
    token, expert, gate = token[order], expert[order], gate[order]
    kept = torch.bincount(expert, minlength=n_experts)
    stats = RoutingStats(routed=routed.cpu(), kept=kept.cpu(), tokens=n_tokens, capacity=capacity)
    return Routing(token=token, expert=expert, gate=gate, counts=kept.tolist(), stats=stats)


def load_balancing_loss(probs: torch.Tensor, routed: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch: E * sum_e f_e P_e, f_e = routed_e / (k N) (a count: no gradient), P_e = mean_n p_n,e."""
    n_tokens, n_experts = probs.shape
    f = routed.to(probs.device, probs.dtype) / (top_k * n_tokens)
    return n_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE: mean over tokens of (logsumexp of the router logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class Experts(nn.Module):
    """E expert MLPs on one device. rows: (M, d) sorted by expert, counts[e] rows each.
    Every expert runs, even on zero rows, so each has a gradient (zero) after backward."""

    def __init__(self, config):
        super().__init__()
        self.mlps = nn.ModuleList([MLP(config) for _ in range(config.n_experts)])

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        chunks = rows.split(counts)
        return torch.cat([mlp(chunk) for mlp, chunk in zip(self.mlps, chunks)])


class MoELayer(nn.Module):
    """Router + experts, a drop-in for the block's MLP: (B, T, d) -> (B, T, d)."""

    def __init__(self, config):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.capacity_factor = config.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = config.aux_loss_coef, config.z_loss_coef
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = Experts(config)
        self.last_stats: RoutingStats | None = None
        self.balance_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        logits = self.router(flat).float()  # the router's softmax in fp32 whatever x's dtype
        probs = F.softmax(logits, dim=-1)
        capacity = expert_capacity(flat.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        routing = route(probs, self.top_k, capacity)
        self.last_stats = routing.stats
        self.balance_loss = load_balancing_loss(probs, routing.stats.routed, self.top_k)
        self.z_loss = router_z_loss(logits)
        out = self.experts(flat[routing.token], routing.counts)  # (M, d), same order as routing
        weighted = out * routing.gate.to(out.dtype)[:, None]
        # weighted is bf16 under autocast (the experts' matmuls), flat fp32: add in flat's dtype
        y = flat.new_zeros(flat.shape).index_add(0, routing.token, weighted.to(flat.dtype))  # dropped: stays 0
        return y.view(shape)

    def auxiliary_loss(self) -> torch.Tensor:
        return self.aux_loss_coef * self.balance_loss + self.z_loss_coef * self.z_loss


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The model's MoE layers in block order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def auxiliary_loss(model: nn.Module) -> torch.Tensor:
    """sum over MoE layers of aux_loss_coef * L_bal + z_loss_coef * L_z (of the last forward)."""
    return sum(layer.auxiliary_loss() for layer in moe_layers(model))


def routing_stats(model: nn.Module) -> list[RoutingStats]:
    """The last forward's RoutingStats of every MoE layer, in block order."""
    return [layer.last_stats for layer in moe_layers(model)]
