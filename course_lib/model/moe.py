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

Frontier variants (fields of course_lib.model.moe_config.MoEGPTConfig; a plain GPTConfig has
their defaults, and the layer then computes exactly as above):

    router="sigmoid"   p = sigmoid(z) per expert (DeepSeek-V3); the same top-k and gate rule
                       (k > 1: the chosen p renormalised to sum 1; k = 1: the raw p)
    balance="bias"     auxiliary-loss-free balancing (Wang et al. 2024): choose the top k of
                       p + b, gate with p alone; after each step b_e += gamma * sign(mean_e' c_e' - c_e),
                       c_e the step's assignments to e (update_expert_bias). No Switch loss.
    balance="none"     neither the Switch loss nor the bias ("aux", the default, is the Switch loss)
    n_shared_experts   S MLPs every token passes through, added to the routed sum (DeepSeekMoE,
                       Dai et al. 2024): y_n = sum_j g_nj expert_e_nj(x_n) + sum_s shared_s(x_n)
    expert_groups=G, max_groups_per_token=M   device-limited routing (DeepSeek-V2/V3): experts
                       in G contiguous groups (one per expert-parallel rank); a group's score is
                       the sum of its ceil(k/M) largest selection scores (V3: k/M = 8/4 = 2);
                       each token picks the M best groups, then its top k among their experts.

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


def limit_groups(select: torch.Tensor, top_k: int, groups: int, max_groups: int) -> torch.Tensor:
    """Device-limited routing: select (N, E) with every expert outside each token's M = max_groups
    best groups set to -inf. Group score = sum of its ceil(k / M) largest entries (DeepSeek-V3 §2.1.2)."""
    n_tokens, n_experts = select.shape
    per_group = n_experts // groups
    by_group = select.view(n_tokens, groups, per_group)
    group_score = by_group.topk(min(per_group, math.ceil(top_k / max_groups)), dim=-1).values.sum(-1)
    chosen = group_score.topk(max_groups, dim=-1).indices  # (N, M)
    allowed = torch.zeros(n_tokens, groups, dtype=torch.bool, device=select.device).scatter(1, chosen, True)
    return by_group.masked_fill(~allowed[:, :, None], float("-inf")).view(n_tokens, n_experts)


def route(probs: torch.Tensor, top_k: int, capacity: int | None, bias: torch.Tensor | None = None,
          groups: int = 1, max_groups: int | None = None) -> Routing:
    """Top-k choice, gate weights, capacity, and the sort by expert. probs: (N, E) router scores
    (softmax or sigmoid). bias (E,): added for the choice only (the gates stay probs);
    max_groups: each token's experts from at most that many of `groups` contiguous groups."""
    n_tokens, n_experts = probs.shape
    select = probs.detach() if bias is None else probs.detach() + bias
    if max_groups is not None and max_groups < groups:
        select = limit_groups(select, top_k, groups, max_groups)
    expert = select.topk(top_k, dim=-1).indices  # (N, k), largest first
    gate = probs.gather(1, expert)
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


ROUTERS = ("softmax", "sigmoid")
BALANCES = ("aux", "bias", "none")


class SharedExperts(nn.Module):
    """S expert MLPs every token passes through; their outputs are summed. (Named `experts`
    inside, so GPT's init gives their projections the residual std like the routed experts'.)"""

    def __init__(self, config, n_shared: int):
        super().__init__()
        self.experts = nn.ModuleList([MLP(config) for _ in range(n_shared)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(mlp(x) for mlp in self.experts)


class MoELayer(nn.Module):
    """Router + experts, a drop-in for the block's MLP: (B, T, d) -> (B, T, d)."""

    def __init__(self, config):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.capacity_factor = config.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = config.aux_loss_coef, config.z_loss_coef
        # the frontier fields (moe_config.MoEGPTConfig); a plain GPTConfig has none: the defaults
        self.router_kind = getattr(config, "router", "softmax")
        self.balance = getattr(config, "balance", "aux")
        self.bias_rate = getattr(config, "bias_rate", 0.0)
        self.groups = getattr(config, "expert_groups", 1)
        self.max_groups = getattr(config, "max_groups_per_token", None)
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = Experts(config)
        n_shared = getattr(config, "n_shared_experts", 0)
        self.shared = SharedExperts(config, n_shared) if n_shared else None
        if self.balance == "bias":  # a buffer, not a parameter: the optimizer never touches it
            self.register_buffer("expert_bias", torch.zeros(config.n_experts))
            self.register_buffer("load_since_update", torch.zeros(config.n_experts, dtype=torch.int64))
        self.last_stats: RoutingStats | None = None
        self.balance_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Router scores from fp32 logits: softmax over experts, or one sigmoid per expert."""
        return F.softmax(logits, dim=-1) if self.router_kind == "softmax" else torch.sigmoid(logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        logits = self.router(flat).float()  # the router's scores in fp32 whatever x's dtype
        probs = self.scores(logits)
        capacity = expert_capacity(flat.shape[0], self.n_experts, self.top_k, self.capacity_factor)
        bias = self.expert_bias if self.balance == "bias" else None
        routing = route(probs, self.top_k, capacity, bias, self.groups, self.max_groups)
        self.last_stats = routing.stats
        if bias is not None and self.training and torch.is_grad_enabled():  # a training forward
            self.load_since_update += routing.stats.routed.to(self.load_since_update.device)
        # Switch's P_e is a probability: sigmoid scores are first normalised over the experts
        shares = probs if self.router_kind == "softmax" else probs / probs.sum(dim=-1, keepdim=True)
        self.balance_loss = load_balancing_loss(shares, routing.stats.routed, self.top_k)
        self.z_loss = router_z_loss(logits)
        if getattr(self.experts, "needs_tokens", False):  # an EP dispatch that sends each token once per rank
            out = self.experts(flat[routing.token], routing.counts, routing.token)
        else:
            out = self.experts(flat[routing.token], routing.counts)  # (M, d), same order as routing
        weighted = out * routing.gate.to(out.dtype)[:, None]
        # weighted is bf16 under autocast (the experts' matmuls), flat fp32: add in flat's dtype
        y = flat.new_zeros(flat.shape).index_add(0, routing.token, weighted.to(flat.dtype))  # dropped: stays 0
        if self.shared is not None:
            y = y + self.shared(flat).to(flat.dtype)
        return y.view(shape)

    def auxiliary_loss(self) -> torch.Tensor:
        """aux_loss_coef * L_bal (balance="aux" only) + z_loss_coef * L_z."""
        balance = self.aux_loss_coef * self.balance_loss if self.balance == "aux" else 0.0
        return balance + self.z_loss_coef * self.z_loss

    @torch.no_grad()
    def update_bias(self) -> None:
        """b_e += gamma * sign(mean load - c_e), c_e = assignments to e since the last update
        (Wang et al. 2024, Algorithm 1: overloaded experts lose, underloaded gain), then c = 0."""
        load = self.load_since_update.double()
        self.expert_bias += self.bias_rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype)
        self.load_since_update.zero_()


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The model's MoE layers in block order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def auxiliary_loss(model: nn.Module) -> torch.Tensor:
    """sum over MoE layers of aux_loss_coef * L_bal + z_loss_coef * L_z (of the last forward)."""
    return sum(layer.auxiliary_loss() for layer in moe_layers(model))


def routing_stats(model: nn.Module) -> list[RoutingStats]:
    """The last forward's RoutingStats of every MoE layer, in block order."""
    return [layer.last_stats for layer in moe_layers(model)]


def update_expert_bias(model: nn.Module) -> None:
    """After a step's backward: every balance="bias" layer nudges its bias from the load it
    counted since the last update (a distributed run sums those counts over its ranks first:
    course_lib.parallel.ep.sync_expert_load)."""
    for layer in moe_layers(model):
        if layer.balance == "bias":
            layer.update_bias()
