# %% [markdown]
# # Exercise 05: Megatron's f and g, column- and row-parallel layers
#
# **Goal.** Write the core of tensor parallelism in `exercises/ex05_tensor_parallel/student.py`:
#
# 1. `CopyToGroup` (**f**) and `ReduceFromGroup` (**g**) as `torch.autograd.Function`s:
#    f is the identity forward and all-reduces the gradient backward; g all-reduces forward and
#    is the identity backward (notebook 05, section 2).
# 2. `qkv_rows_for_rank(d_model, n_head, tp, rank)`: which rows of the fused QKV weight a rank
#    keeps so that it holds whole heads of Q, K and V (section 3).
# 3. `ColumnParallelLinear(full, group, rows=None)`: keeps some output features of a full
#    `nn.Linear` and enters its region with f.
# 4. `RowParallelLinear(full, group)`: keeps a contiguous `1/tp` of the input features, sums
#    the partial products with g and adds the whole bias once.
#
# Before you start, work out on paper, for `Z = GELU(X A) B` on 2 ranks: which matrix is split
# by columns, which by rows, and where the one all-reduce of the forward pass goes.
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your layers run on 2 and 4 real ranks and
# are compared with the single-process layers: outputs, input gradients and weight gradients.
# Edit `student.py`, then *Kernel → Restart and run all*.

# %%
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import CommTracer, run_on_ranks
from course_lib.data import CharDataset, get_batch
from course_lib.grading import check_close, check_equal, load_student
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.tp import qkv_rows

student = load_student("ex05_tensor_parallel")
RANKS = dict(backend="gloo", timeout_s=60)

# %% [markdown]
# ## Check 1: f and g
# Rank `r` holds `x = [r+1, r+1, r+1]` and weights its output by `r+1` in the loss. Through f the
# output is `x` itself and the gradient is the sum of every rank's weight; through g the output is
# the sum over ranks and the gradient is the rank's own weight. (If these fail, re-read
# notebook 05's section 2: which of the two sums in forward?)

# %%
def f_and_g():
    r = dist.get_rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = student.f(x)
    (y * (r + 1)).sum().backward()
    x2 = torch.full((3,), float(r + 1), requires_grad=True)
    z = student.g(x2)
    (z * (r + 1)).sum().backward()
    return y.tolist(), x.grad.tolist(), z.tolist(), x2.grad.tolist(), x2.tolist()


for n in (2, 4):
    total = n * (n + 1) / 2
    for r, (y, gx, z, gx2, x2_after) in enumerate(run_on_ranks(f_and_g, world_size=n, **RANKS)):
        check_equal(f"{n} ranks, rank {r}: f forward is the identity", y, [r + 1.0] * 3)
        check_equal(f"{n} ranks, rank {r}: f backward sums the gradients", gx, [total] * 3)
        check_equal(f"{n} ranks, rank {r}: g forward sums", z, [total] * 3)
        check_equal(f"{n} ranks, rank {r}: g backward is the identity", gx2, [r + 1.0] * 3)
        check_equal(f"{n} ranks, rank {r}: g left its input unchanged", x2_after, [r + 1.0] * 3)

# %% [markdown]
# ## Check 2: whole heads of the fused QKV weight
# (Section 3 of notebook 05 draws the fused rows.)

# %%
check_equal("d_model=8, 2 heads, tp=2, rank 1", student.qkv_rows_for_rank(8, 2, 2, 1),
            [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23])
for d_model, n_head, tp in ((64, 4, 2), (64, 4, 4), (96, 12, 3)):
    check_equal(f"d_model={d_model}, {n_head} heads, tp={tp}: every rank",
                [student.qkv_rows_for_rank(d_model, n_head, tp, r) for r in range(tp)], qkv_rows(d_model, tp).tolist())

# %% [markdown]
# ## Check 3: a column-then-row MLP equals the full one
# `Z = proj(GELU(fc(X)))` with `fc` column-parallel and `proj` row-parallel, on 2 and 4 ranks:
# the output and the gradient of `X` must equal the single-process ones, each rank's weight
# gradients must be its slice of the full gradients, and the pair must cost exactly one
# all-reduce forward and one backward, each of X's size.

# %%
def mlp_check():
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same full layers and input on every rank
    fc, proj = nn.Linear(16, 64), nn.Linear(64, 16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    full = proj(F.gelu(fc(x)))
    full.square().sum().backward()
    col, row = student.ColumnParallelLinear(fc), student.RowParallelLinear(proj)
    xr = x.detach().clone().requires_grad_(True)
    with CommTracer() as forward:
        out = row(F.gelu(col(xr)))
    with CommTracer() as backward:
        out.square().sum().backward()
    k = 64 // n
    return {"output": (out, full), "input gradient": (xr.grad, x.grad),
            "fc weight gradient": (col.weight.grad, fc.weight.grad[r * k:(r + 1) * k]),
            "fc bias gradient": (col.bias.grad, fc.bias.grad[r * k:(r + 1) * k]),
            "proj weight gradient": (row.weight.grad, proj.weight.grad[:, r * k:(r + 1) * k]),
            "proj bias gradient": (row.bias.grad, proj.bias.grad),
            "calls": [(s.get("all_reduce", {}).get("calls", 0), s.get("all_reduce", {}).get("bytes_sent", 0))
                      for s in (forward.summary(), backward.summary())]}


for n in (2, 4):
    for r, res in enumerate(run_on_ranks(mlp_check, world_size=n, **RANKS)):
        for name, (got, want) in res.items():
            if name != "calls":  # fp32 sums of up to 64 products split over the ranks: another order (~1e-7)
                check_close(f"{n} ranks, rank {r}: {name}", got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
        check_equal(f"{n} ranks, rank {r}: (all-reduces, bytes) forward and backward", res["calls"],
                    [(1, 2 * 5 * 16 * 4), (1, 2 * 5 * 16 * 4)])

# %% [markdown]
# ## Check 4: your layers inside the course GPT
# Every block's `qkv` (your rows: whole heads), `attn.proj`, `mlp.fc` and `mlp.proj` are
# replaced by your layers on 2 ranks; the embeddings and the head stay whole. The loss must be
# the single-process loss on both ranks and every shard's gradient the matching slice.

# %%
def gpt_check():
    r, n = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.tiny(CharDataset("train").vocab_size)
    x, y = get_batch(CharDataset("train", config.block_size), 4, torch.Generator().manual_seed(0))
    ref = GPT(config, seed=0)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    model = GPT(config, seed=0)
    for block in model.blocks:
        rows = student.qkv_rows_for_rank(config.d_model, config.n_head, n, r)
        block.attn.qkv = student.ColumnParallelLinear(block.attn.qkv, rows=rows)
        block.attn.proj = student.RowParallelLinear(block.attn.proj)
        block.mlp.fc = student.ColumnParallelLinear(block.mlp.fc)
        block.mlp.proj = student.RowParallelLinear(block.mlp.proj)
    loss = model(x, y)[1]
    loss.backward()
    rows = qkv_rows(config.d_model, n)[r]
    k = config.d_model // n
    return {"loss": (loss, ref_loss),
            "qkv weight gradient (your heads)": (model.blocks[0].attn.qkv.weight.grad, ref.blocks[0].attn.qkv.weight.grad[rows]),
            "attn.proj weight gradient": (model.blocks[1].attn.proj.weight.grad,
                                          ref.blocks[1].attn.proj.weight.grad[:, r * k:(r + 1) * k]),
            "embedding gradient": (model.tok_emb.weight.grad, ref.tok_emb.weight.grad)}


for r, res in enumerate(run_on_ranks(gpt_check, world_size=2, **RANKS)):
    for name, (got, want) in res.items():  # one forward and backward: fp32 sums in another order (~1e-7 relative)
        check_close(f"rank {r}: {name}", got.detach(), want.detach(), rtol=1e-4, atol=1e-6)

# %% [markdown]
# All checks passed? Then you have written Megatron's tensor parallelism for the transformer
# block. Two questions to think about (notebook 05, sections 2 and 7 discuss them):
#
# * Your `proj` bias is whole on every rank and added after g. What would go wrong if each
#   rank added it *before* g?
# * With sequence parallelism, f becomes an all-gather along the sequence and g a
#   reduce-scatter. What happens to the bias then, and to its gradient?
