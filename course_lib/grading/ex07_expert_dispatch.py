"""Checkers of exercise 07: expert parallelism's dispatch and combine, with the experts dealt
round-robin over the ranks (expert e on rank e mod ep, not rank by rank as in notebook 07).

Nothing here calls the library's dispatch, and no expected order or count is stored readable:

    check_sort           sort_for_dispatch on hand-made and random assignments, by the contract's
                         properties: a permutation, destination rank (e mod ep) non-decreasing,
                         local expert (e // ep) non-decreasing within a rank, ties in their input
                         order; counts against torch.bincount
    check_rows_per_rank  two cases against digests of the reference's answer (stored.digest)
    check_layer          2 and 4 real gloo ranks, each with its own number of tokens and a shuffled
                         routing: outputs, token gradients, router gradients and every expert's
                         gradient (on its owner) against the single-process MoE layer; a gradient
                         that never comes back is named, not left as an AttributeError
    check_traffic        one traced forward on 2 ranks: three all-to-alls (counts, dispatch,
                         combine) carrying only the routed rows

`REFUSE` names where the answer lives: the library's expert parallelism (its dispatch, combine,
count exchange) and this module.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.grading.stored import check_digest
from course_lib.model import GPT, GPTConfig
from course_lib.model.moe import expert_capacity, route
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import run_on_ranks

REFUSE = (
    "course_lib.parallel.ep",  # exchange_counts, dispatch, run_local_experts, combine: the layer's answer
    "course_lib.grading.ex07_expert_dispatch",  # the checks themselves
)
RANKS = dict(backend="gloo", timeout_s=60)  # CPU ranks; a rank waiting 60 s waits for a message nobody sent
D_MODEL = 16
LAYOUTS = [(2, 4, 1, None), (2, 4, 2, 1.0), (4, 8, 2, 1.25)]  # ep, experts, top-k, capacity factor

# digest(rows_per_rank(counts, ep)) of the reference solution, for the two cases below
ROWS_PER_RANK = {
    ((1, 1, 2, 0), 2): "71926408739051f5f2234fce9582385891dfd4de0db7315aec96adb0f7163e27",
    ((3, 0, 1, 4, 0, 0, 2, 5), 4): "e6d02e917e7d623d7b204af15386c06add565f798776138936535ff724ce1ec2",
}


def _module(name: str):
    """The learner's module on a rank (installed there by run_on_ranks, see course_lib.runtime.modules)."""
    return sys.modules[name]


# --------------------------------------------------------------------------------- the sort

def _sorted(student, expert: torch.Tensor, n_experts: int, ep: int):
    res = student.sort_for_dispatch(expert.clone(), n_experts, ep)
    where = f"sort_for_dispatch({expert.tolist() if len(expert) < 10 else f'<{len(expert)} assignments>'}, " \
            f"n_experts={n_experts}, ep={ep})"
    if not (isinstance(res, (tuple, list)) and len(res) == 2 and isinstance(res[0], torch.Tensor)):
        raise CheckFailed(f"{where} must return (order, counts): a tensor and a list; got {res!r:.200}")
    order, counts = res[0].tolist(), [int(c) for c in res[1]]
    if sorted(order) != list(range(len(expert))):
        raise CheckFailed(f"{where}: order {order} must be a permutation of the assignments 0 ... {len(expert) - 1}")
    return where, order, counts


def check_sort(student):
    """The contract of sort_for_dispatch, property by property, on two layouts."""
    cases = [(torch.tensor([2, 0, 3, 1, 2, 1]), 4, 2)]
    gen = torch.Generator().manual_seed(0)
    cases += [(torch.randint(0, 8, (50,), generator=gen), 8, ep) for ep in (2, 4)]
    for expert, n_experts, ep in cases:
        where, order, counts = _sorted(student, expert, n_experts, ep)
        e = expert[order].tolist()
        ranks = [x % ep for x in e]
        if ranks != sorted(ranks):
            raise CheckFailed(f"{where}: the experts in your order are {e}, destination ranks {ranks}: the rows for "
                              f"one rank must be contiguous (one all-to-all split per rank). Rank s owns experts "
                              f"s, s + ep, s + 2ep, ...: sorting by expert number does not group them by rank")
        for r in range(ep):
            local = [x // ep for x in e if x % ep == r]
            if local != sorted(local):
                raise CheckFailed(f"{where}: on rank {r} the local experts arrive in the order {local}: within a "
                                  f"rank, group the rows by its local expert (e // ep), first to last")
        ties = [[a for a in order if int(expert[a]) == x] for x in range(n_experts)]
        if any(t != sorted(t) for t in ties):
            raise CheckFailed(f"{where}: assignments to the same expert must keep their input order (a stable "
                              f"sort); your order {order}")
        want = torch.bincount(expert, minlength=n_experts).tolist()
        if counts != want:
            raise CheckFailed(f"{where}: counts {counts} must be the assignments per expert, indexed by the global "
                              f"expert number 0 ... {n_experts - 1} (an expert nobody chose counts 0)")
    passed("sort_for_dispatch: grouped by destination rank, then by local expert, stable; counts per expert")


def check_rows_per_rank(student):
    for (counts, ep), want in ROWS_PER_RANK.items():
        got = student.rows_per_rank(list(counts), ep)
        got = [int(x) for x in got] if isinstance(got, (list, tuple, torch.Tensor)) else got
        check_digest(f"rows_per_rank({list(counts)}, ep={ep})", got, want,
                     hint="rank s owns experts s, s + ep, s + 2ep, ... (not consecutive experts)")


# ------------------------------------------------------------------------- the layer on ranks

def layer_for(n_experts, top_k, capacity_factor):
    cfg = GPTConfig.tiny(97, n_layer=1, n_head=2, d_model=D_MODEL, d_ff=24, n_experts=n_experts, top_k=top_k,
                         capacity_factor=capacity_factor)
    layer = GPT(cfg, seed=0).blocks[0].mlp
    with torch.no_grad():
        layer.router.weight.mul_(30)  # a decisive router: unequal loads, and drops with a capacity
    return layer


def tokens_of(rank):
    """Rank r's own tokens (a different count on every rank) and the weights of its test loss."""
    gen = torch.Generator().manual_seed(100 + rank)
    n = 20 + 7 * rank
    return torch.randn(n, D_MODEL, generator=gen), torch.randn(n, D_MODEL, generator=gen)


def shuffled_routing(layer, x, rank):
    """The layer's own routing of x, in a shuffled order (the learner sorts it)."""
    probs = F.softmax(layer.router(x).float(), dim=-1)
    cap = expert_capacity(x.shape[0], layer.n_experts, layer.top_k, layer.capacity_factor)
    r = route(probs, layer.top_k, cap)
    perm = torch.randperm(len(r.token), generator=torch.Generator().manual_seed(rank))
    return r.token[perm], r.expert[perm], r.gate[perm]


def _grad(t):
    return None if t.grad is None else t.grad.clone()


def _run_student(name, n_experts, top_k, capacity_factor):
    student, rank, ep = _module(name), dist.get_rank(), dist.get_world_size()
    layer = layer_for(n_experts, top_k, capacity_factor)
    x, w = tokens_of(rank)
    x.requires_grad_()
    token, expert, gate = shuffled_routing(layer, x, rank)
    mine = {e: layer.experts.mlps[e] for e in range(rank, n_experts, ep)}
    y = student.expert_parallel_moe(x, token, expert, gate, mine, n_experts)
    if not y.requires_grad:
        return y.detach(), None, None, {}
    (y * w).sum().backward()
    expert_grads = {e: [_grad(p) for p in m.parameters()] for e, m in mine.items()}
    return y.detach(), _grad(x), _grad(layer.router.weight), expert_grads


def _single_process(ep, n_experts, top_k, capacity_factor):
    layer = layer_for(n_experts, top_k, capacity_factor)
    out = []
    for rank in range(ep):
        layer.router.weight.grad = None
        x, w = tokens_of(rank)
        x.requires_grad_()
        y = layer(x[None])[0]
        (y * w).sum().backward()  # expert gradients add up over the ranks' tokens
        out.append((y.detach(), x.grad, layer.router.weight.grad.clone()))
    experts = {e: [p.grad for p in m.parameters()] for e, m in enumerate(layer.experts.mlps)}
    return out, experts


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


NO_GRADIENT = ("in student.py, expert_parallel_moe's output carries no gradient back to {what}: a step of the "
               "layer is not differentiable. torch.distributed's all_to_all_single has no backward (use "
               "course_lib.comm.autograd.all_to_all_single for the rows, both ways), and .detach(), "
               "torch.no_grad() or a copy through .tolist() cut the graph")
NO_GATE = ("in student.py, expert_parallel_moe's output carries no gradient back to the router: the router "
           "learns only through the gates, so each returned row must be weighted by its gate, and the gate "
           "must not be detached")
CUT_PATH = ("the outputs are right but this gradient is not: in student.py a path of the backward is cut (the "
            "dispatch or the combine through torch.distributed's all_to_all_single, which has no backward, or "
            "a detached tensor), so only part of the gradient comes back")


def _close(label: str, got: torch.Tensor, want: torch.Tensor, hint: str = ""):
    """PASS, or CheckFailed with the largest difference and where (never the expected values).
    fp32, one forward and backward: the same products summed in another order, ~1e-7; rtol 1e-4,
    atol 1e-5 leave room for that and catch any wrong row (off by far more)."""
    got, want = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(got, want, rtol=1e-4, atol=1e-5)
    if not bad.any():
        passed(label)
        return
    diff = (got - want).abs()
    raise CheckFailed(f"{label}: {int(bad.sum())} of {bad.numel()} values differ, the largest by "
                      f"{diff.max().item():.3g}" + (f"; {hint}" if hint else ""))


def check_layer(student, layouts=LAYOUTS):
    for ep, n_experts, top_k, cf in layouts:
        label = f"ep={ep}, {n_experts} experts (expert e on rank e mod {ep}), top-{top_k}, capacity {cf}"
        got = run_on_ranks(_run_student, student.__name__, n_experts, top_k, cf, world_size=ep, **RANKS)
        want, want_experts = _single_process(ep, n_experts, top_k, cf)
        shapes = [tuple(g[0].shape) for g in got]
        if shapes != [tuple(w[0].shape) for w in want]:
            raise CheckFailed(f"{label}: expert_parallel_moe returned outputs of shapes {shapes}: one row per token "
                              f"of the rank, (N, d)")
        for r, g in enumerate(got):
            for i, what in ((1, "the tokens x"), (2, "the router (through the gates)")):
                if g[i] is None:
                    raise CheckFailed(f"{label}, rank {r}: " + (NO_GATE if i == 2 else NO_GRADIENT.format(what=what)))
            for e, grads in sorted(g[3].items()):
                if any(t is None for t in grads):
                    raise CheckFailed(f"{label}, rank {r}: expert {e} got no gradient: "
                                      + NO_GRADIENT.format(what="the experts' weights"))
        _close(f"{label}: outputs y, every rank", _flat(g[0] for g in got), _flat(w[0] for w in want))
        for i, what in ((1, "the tokens x"), (2, "the router (through the gates)")):
            _close(f"{label}: gradients of {what}, every rank", _flat(g[i] for g in got), _flat(w[i] for w in want),
                   hint=CUT_PATH)
        mine = _flat(_flat(grads) for g in got for _, grads in sorted(g[3].items()))
        order = [e for r in range(ep) for e in range(r, n_experts, ep)]
        _close(f"{label}: every expert's gradient, on its owner", mine,
               _flat(_flat(want_experts[e]) for e in order), hint=CUT_PATH)


def _traced_forward(name):
    student, rank = _module(name), dist.get_rank()
    layer = layer_for(4, 2, 1.0)
    x, _ = tokens_of(rank)
    token, expert, gate = shuffled_routing(layer, x, rank)
    mine = {e: layer.experts.mlps[e] for e in range(rank, 4, 2)}
    with CommTracer() as tracer:
        student.expert_parallel_moe(x, token, expert, gate, mine, 4)
    calls = [(r.op, r.bytes_sent, r.bytes_recv) for r in tracer.records]
    to_rank = [int((expert % 2 == s).sum()) for s in range(2)]  # rows for rank s: its experts are s, s + 2
    return calls, to_rank


def check_traffic(student):
    """One forward on 2 ranks, traced: E int64 counts, then the rank's kept rows out and back."""
    res = run_on_ranks(_traced_forward, student.__name__, world_size=2, **RANKS)
    for rank, (calls, to_rank) in enumerate(res):
        from_rank = [res[s][1][rank] for s in range(2)]
        expected = [("all_to_all_single", 4 * 8, 4 * 8),
                    ("all_to_all_single", sum(to_rank) * D_MODEL * 4, sum(from_rank) * D_MODEL * 4),
                    ("all_to_all_single", sum(from_rank) * D_MODEL * 4, sum(to_rank) * D_MODEL * 4)]
        check_equal(f"rank {rank}: counts, dispatch, combine (op, bytes sent, bytes received)", calls, expected)
