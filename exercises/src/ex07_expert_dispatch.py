# %% [markdown]
# # Exercise 07: expert parallelism's dispatch and combine
#
# **Goal.** Write the communication of an expert-parallel MoE layer in
# `exercises/ex07_expert_dispatch/student.py` (notebook `07_mixture_of_experts` explains every
# idea used here; re-read §2 for the router's output and the sort by expert, §5 for the two
# all-to-alls):
#
# 1. `sort_by_expert(expert, n_experts)`: the stable permutation that groups the assignments
#    by expert, and the count per expert;
# 2. `rows_per_rank(counts, ep)`: how many rows go to each rank;
# 3. `expert_parallel_moe(x, token, expert, gate, local_experts, n_experts, group)`: permute
#    the token rows, exchange the counts, dispatch with an uneven all-to-all, run this rank's
#    experts, combine with the all-to-all back, and un-permute with the gate weights.
#
# The routing itself (router, top-k, capacity) is given: each rank passes you its kept
# assignments in a shuffled order.
#
# **Think first.** In the dispatch, rank 0 sends 5 rows to rank 1 and rank 1 sends 3 rows to
# rank 0. In the combine, how many rows does rank 0 send to rank 1? And in the backward of the
# dispatch?
#
# <details><summary>Answer</summary>
#
# 3 both times. In the combine rank 0 returns the expert outputs of the 3 rows it received
# from rank 1; in the backward of the dispatch it returns the gradients of those same 3 rows.
# A transpose swaps the input and output splits: what a rank sends in it is what it received
# in the original.
# </details>
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your layer runs on 2 and 4 real ranks, each
# with a different number of tokens, and its outputs and gradients are compared with the
# single-process MoE layer on the same tokens. Edit `student.py`, then *Kernel → Restart and
# run all*.

# %%
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import CommTracer, run_on_ranks
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPT, GPTConfig
from course_lib.model.moe import expert_capacity, route

student = load_student("ex07_expert_dispatch")
D_MODEL = 16


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
    """The layer's own routing of x, in a shuffled order (you sort it)."""
    probs = F.softmax(layer.router(x).float(), dim=-1)
    cap = expert_capacity(x.shape[0], layer.n_experts, layer.top_k, layer.capacity_factor)
    r = route(probs, layer.top_k, cap)
    perm = torch.randperm(len(r.token), generator=torch.Generator().manual_seed(rank))
    return r.token[perm], r.expert[perm], r.gate[perm]

# %% [markdown]
# ## Check 1: `sort_by_expert` and `rows_per_rank`

# %%
order, counts = student.sort_by_expert(torch.tensor([2, 0, 2, 1]), 3)
check_equal("sort_by_expert: order of [2, 0, 2, 1]", order.tolist(), [1, 3, 0, 2])
check_equal("sort_by_expert: counts", list(counts), [1, 1, 2])
e = torch.randint(0, 8, (50,), generator=torch.Generator().manual_seed(0))
order, counts = student.sort_by_expert(e, 8)
check_equal("stable: ties keep their order", order.tolist(), sorted(range(50), key=lambda a: (int(e[a]), a)))
check_equal("counts of an expert nobody chose are 0", list(student.sort_by_expert(torch.tensor([0, 0]), 3)[1]),
            [2, 0, 0])
check_equal("rows_per_rank([1, 1, 2, 0], 2)", list(student.rows_per_rank([1, 1, 2, 0], 2)), [2, 2])
check_equal("rows_per_rank, 8 experts on 4 ranks", list(student.rows_per_rank([3, 0, 1, 4, 0, 0, 2, 5], 4)),
            [3, 5, 0, 7])

# %% [markdown]
# ## Check 2: outputs and gradients equal the single-process layer
#
# Every rank builds the same layer (same seed), keeps `E/ep` of its experts and runs your
# `expert_parallel_moe` on its own tokens; the test loss is `Σ_r Σ (y_r · w_r)`. The
# single-process layer computes the same loss from every rank's tokens. Compared: each rank's
# `y`, the gradient of its tokens `x`, of the router (through the gates, on every rank: it
# is a replicated weight, so each rank's gradient is that of its own tokens) and of each
# expert (on its owner, where the backward all-to-alls bring every rank's rows).

# %%
def run_student(n_experts, top_k, capacity_factor):
    rank, ep = dist.get_rank(), dist.get_world_size()
    layer = layer_for(n_experts, top_k, capacity_factor)
    x, w = tokens_of(rank)
    x.requires_grad_()
    token, expert, gate = shuffled_routing(layer, x, rank)
    per_rank = n_experts // ep
    mine = {e: layer.experts.mlps[e] for e in range(rank * per_rank, (rank + 1) * per_rank)}
    y = student.expert_parallel_moe(x, token, expert, gate, mine, n_experts)
    (y * w).sum().backward()
    expert_grads = {e: [p.grad.clone() for p in m.parameters()] for e, m in mine.items()}
    return y.detach(), x.grad, layer.router.weight.grad, expert_grads


def single_process(ep, n_experts, top_k, capacity_factor):
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


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


for ep, n_experts, top_k, cf in [(2, 4, 1, None), (2, 4, 2, 1.0), (4, 8, 2, 1.25)]:
    label = f"ep={ep}, {n_experts} experts, top-{top_k}, capacity {cf}"
    got = run_on_ranks(run_student, n_experts, top_k, cf, world_size=ep, backend="gloo", timeout_s=60)
    want, want_experts = single_process(ep, n_experts, top_k, cf)
    # one forward and backward: the same products, summed over the tokens in another order (fp32, ~1e-7)
    for i, what in enumerate(("outputs y", "gradients of the tokens x", "router gradients (through the gates)")):
        check_close(f"{label}: {what}, every rank", flat(g[i] for g in got), flat(w[i] for w in want),
                    rtol=1e-4, atol=1e-5)
    mine = flat(flat(grads) for g in got for _, grads in sorted(g[3].items()))
    check_close(f"{label}: every expert's gradient, on its owner", mine,
                flat(flat(want_experts[e]) for e in range(n_experts)), rtol=1e-4, atol=1e-5)

# %% [markdown]
# ## Check 3: only the routed rows travel, in three all-to-alls
#
# One forward on 2 ranks, traced: the count exchange (`E` int64 per rank), the dispatch (the
# rank's `M` kept assignments, `M · d · 4` bytes) and the combine (the rows it received back).
# A layer that sends every token to every rank, or pads to the capacity, fails here.

# %%
def traced_forward():
    rank = dist.get_rank()
    layer = layer_for(4, 2, 1.0)
    x, _ = tokens_of(rank)
    token, expert, gate = shuffled_routing(layer, x, rank)
    mine = {e: layer.experts.mlps[e] for e in range(2 * rank, 2 * rank + 2)}
    with CommTracer() as tracer:
        student.expert_parallel_moe(x, token, expert, gate, mine, 4)
    calls = [(r.op, r.bytes_sent, r.bytes_recv) for r in tracer.records]
    return calls, torch.bincount(expert, minlength=4).view(2, 2).sum(1).tolist()


res = run_on_ranks(traced_forward, world_size=2, backend="gloo", timeout_s=60)
for rank, (calls, to_rank) in enumerate(res):
    from_rank = [res[s][1][rank] for s in range(2)]
    expected = [("all_to_all_single", 4 * 8, 4 * 8),
                ("all_to_all_single", sum(to_rank) * D_MODEL * 4, sum(from_rank) * D_MODEL * 4),
                ("all_to_all_single", sum(from_rank) * D_MODEL * 4, sum(to_rank) * D_MODEL * 4)]
    check_equal(f"rank {rank}: counts, dispatch, combine (op, bytes sent, bytes received)", calls, expected)

# %% [markdown]
# All checks passed? Then you have written the communication of GShard and Switch's expert
# layer. Two questions to take back to notebook 07: why can the gates stay on the sending rank
# instead of travelling with the rows (§5), and what must `reduce_gradients` still do with the
# expert gradients you just computed when each rank's loss is a *mean* (§5, the proof)?
