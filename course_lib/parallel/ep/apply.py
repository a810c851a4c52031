"""Expert parallelism: each rank of a group keeps n_experts / ep of every layer's experts.

    apply_expert_parallel(model, group)   swap each MoE layer's experts for this rank's share
    reduce_gradients(model, group)        after backward: the gradient of the mean loss
    clip_grad_norm(model, max_norm, group)  the global norm over dense + every rank's experts
    full_flat(model, group)               all parameters (or gradients) in single-process order
    sync_expert_load(model, group)        bias balancing: the step's expert loads summed over ranks
    ep_placements(model, group)           each parameter's Placement over ep (course_lib.parallel.placement):
                                          an expert whole on its one owner, the rest replicated

Why the expert gradients are divided by ep. Rank r's loss L_r depends on its own dense
weights and on every expert its tokens were routed to. The target is the gradient of
L = (1/ep) sum_r L_r, what one process computes from the ep batches averaged:

    dense W (a copy on every rank):  dL/dW = (1/ep) sum_r dL_r/dW   -> all-reduce, divide by ep
    expert e (owned by one rank):    dL/de = (1/ep) sum_r dL_r/de

Shared experts (n_shared_experts) are dense in this sense: a copy on every rank that computes
on that rank's tokens, so their gradients are all-reduced with the attention's.

Backward through the combine and dispatch all-to-alls brings every rank's row gradients to
the owner, so the owner's backward already sums dL_r/de over all r: it only divides by ep.
With data parallelism on top (an ep x dp mesh), average every gradient over dp afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib._validate import check_int
from course_lib.comm.compat import all_gather_single
from course_lib.model.moe import Experts, moe_layers
from course_lib.parallel.clip import clip_grad_norm_
from course_lib.parallel.ep.dispatch import combine, dispatch, dispatch_once_per_rank, exchange_counts, run_local_experts
from course_lib.parallel.placement import Placement, weight


def check_expert_parallel(config, ep: int) -> None:
    """Validate in the parent, before any rank starts: an MoE config whose experts split over ep."""
    check_int("ep", ep)
    if not config.n_experts:
        raise ValueError("n_experts=0 is a dense model: expert parallelism needs GPTConfig(n_experts > 0)")
    if config.n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_experts={config.n_experts}: every rank holds "
                         f"n_experts / ep whole experts")
    groups, limit = getattr(config, "expert_groups", 1), getattr(config, "max_groups_per_token", None)
    if limit is not None and groups != ep:
        raise ValueError(f"expert_groups={groups} must equal ep={ep}: device-limited routing "
                         f"(max_groups_per_token={limit}) counts a token's expert-parallel ranks")


class ExpertParallelExperts(nn.Module):
    """This rank's experts of one layer: `mlps` keyed by global expert index, so parameter
    names are those of the single-process model (rank 1 of 2 with 4 experts: mlps.2, mlps.3)."""

    def __init__(self, experts: Experts, group=None, once_per_rank: bool = False):
        super().__init__()
        self.needs_tokens = once_per_rank  # the MoE layer then passes each row's token
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_experts, self.group = len(experts.mlps), group
        per_rank = self.n_experts // ep
        self.first, self.rank, self.ep = rank * per_rank, rank, ep
        self.mlps = nn.ModuleDict({str(e): experts.mlps[e] for e in range(self.first, self.first + per_rank)})
        self.timeline = None  # a Timeline: the local experts' compute recorded as an "experts" span
        self.last_received = 0  # rows this rank's experts processed in the last forward

    def placements(self) -> dict[str, Placement]:
        """{parameter name: Placement}: expert e is whole on ep rank e // (n_experts / ep) alone."""
        alone = Placement.whole("ep", (self.rank,), self.rank, self.ep)
        return {name: alone for name, _ in self.named_parameters()}

    def forward(self, rows: torch.Tensor, counts: list[int], tokens: torch.Tensor | None = None) -> torch.Tensor:
        send, recv = exchange_counts(counts, self.group, device=rows.device)
        if self.needs_tokens:
            received = dispatch_once_per_rank(rows, tokens, send, recv, self.group)
        else:
            received = dispatch(rows, send, recv, self.group)
        self.last_received = received.shape[0]
        if self.timeline is None:
            out = run_local_experts(received, recv, list(self.mlps.values()))
        else:
            with self.timeline.span("experts"):
                out = run_local_experts(received, recv, list(self.mlps.values()))
        return combine(out, send, recv, self.group)


def apply_expert_parallel(model: nn.Module, group=None, once_per_rank: bool = False) -> nn.Module:
    """In place: every MoE layer keeps n_experts / ep experts (the rest are freed) and runs them
    through dispatch/combine; dense parts stay whole. Every rank must start from the same weights
    (same seed). once_per_rank: dispatch each token once per destination rank
    (dispatch_once_per_rank) instead of once per assignment. Returns the model."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers: expert parallelism needs GPTConfig(n_experts > 0)")
    ep = dist.get_world_size(group)
    for layer in layers:
        if isinstance(layer.experts, ExpertParallelExperts):
            raise ValueError("apply_expert_parallel was already applied to this model")
        if layer.n_experts % ep:
            raise ValueError(f"ep={ep} must divide n_experts={layer.n_experts}")
        layer.experts = ExpertParallelExperts(layer.experts, group, once_per_rank)
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters this rank owns alone (its experts); all others are replicated."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()]


def ep_placements(model: nn.Module, group=None) -> dict[str, Placement]:
    """{parameter name: Placement over ep} of this rank's parameters: its experts whole on this
    rank alone (copies 1), every other parameter replicated on the ep ranks of `group` (copies ep)."""
    rank, ep = dist.get_rank(group), dist.get_world_size(group)
    alone = {id(p): m.placements()[n] for m in model.modules() if isinstance(m, ExpertParallelExperts)
             for n, p in m.named_parameters()}
    return {name: alone.get(id(p), Placement.replicated("ep", rank, ep)) for name, p in model.named_parameters()}


def _dense_and_expert(model):
    experts = expert_parameters(model)
    ids = {id(p) for p in experts}
    return [p for p in model.parameters() if id(p) not in ids], experts


def reduce_gradients(model: nn.Module, group=None) -> None:
    """After loss.backward(): dense gradients averaged over the group (one all-reduce of a flat
    buffer), expert gradients divided by ep (module docstring)."""
    ep = dist.get_world_size(group)
    dense, experts = _dense_and_expert(model)
    for p in dense + experts:
        if p.grad is None:  # unused on this rank: zeros keep every rank's buffer the same size
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in dense])
    dist.all_reduce(flat, group=group)
    flat /= ep
    offset = 0
    for p in dense:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    for p in experts:
        p.grad /= ep


def sync_expert_load(model: nn.Module, group=None) -> None:
    """Sum every bias-balanced layer's step load over the group's ranks (one all-reduce), so
    that update_expert_bias moves each rank's copy of the bias the same way, as one process
    that routed every rank's tokens would (model/moe.py)."""
    layers = [m for m in moe_layers(model) if m.balance == "bias"]
    if layers:
        loads = torch.stack([m.load_since_update for m in layers])
        dist.all_reduce(loads, group=group)
        for m, load in zip(layers, loads):
            m.load_since_update.copy_(load)


def clip_grad_norm(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (||g|| + 1e-6)) and return ||g||: the one
    weighted clip (course_lib.parallel.clip) with each expert weighted 1 (this rank's alone) and
    each dense gradient 1/ep (after reduce_gradients, the same average on every rank of the group)."""
    dense, experts = _dense_and_expert(model)
    placements = ep_placements(model, group)
    placed = {id(p): placements[n] for n, p in model.named_parameters()}
    return clip_grad_norm_([(p.grad, weight((placed[id(p)],))) for p in dense + experts], max_norm, group)


def full_flat(model: nn.Module, group=None, grads: bool = False) -> torch.Tensor:
    """The parameters (or gradients) of the whole model, flat, in the single-process model's
    order (`course_lib.train.flat_params`): each layer's experts are all-gathered over the group."""
    owner = {id(p): m for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}
    value = (lambda p: p.grad if p.grad is not None else torch.zeros_like(p)) if grads else (lambda p: p)
    pieces, done = [], set()
    for p in model.parameters():
        m = owner.get(id(p))
        if m is None:
            pieces.append(value(p).detach().reshape(-1))
        elif id(m) not in done:  # a layer's experts appear together: emit all of them once
            done.add(id(m))
            local = torch.cat([value(q).detach().reshape(-1) for q in m.parameters()])
            out = local.new_empty(local.numel() * dist.get_world_size(m.group))
            all_gather_single(out, local.contiguous(), group=m.group)
            pieces.append(out)
    return torch.cat(pieces).cpu()
