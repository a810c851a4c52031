"""Checkers of exercise 05: Megatron's f and g, the fused QKV rows, column- and row-parallel layers.

Nothing here calls the library's tensor parallelism. Each check holds the learner's code to
what the exercise states:

    check_f_and_g    f and g on real ranks against values worked out by hand: rank r holds
                     x = r+1 and weights its output by r+1, so a sum over n ranks is n(n+1)/2
    check_qkv_rows   properties of the answer: every fused row kept exactly once, whole heads of
                     Q, K and V in that order, the heads the row-parallel projection reads
    check_mlp        fc (column) -> GELU -> proj (row) on 2 and 4 ranks against the same full
                     layers run in a single process on each rank (same seed), plus what each
                     shard holds and the collectives counted
    check_gpt        the learner's layers swapped into the course GPT on 2 ranks, against the
                     single-process GPT (same seed, same batch): loss and gradient slices
    check_uneven_mlp (in ex05_uneven.py) fc -> GELU -> proj with a hidden width tp does not divide

`REFUSE` names the library modules that already hold the answer (and this module, which holds
the checks): the exercise notebook passes it to `load_student`, which refuses a student module
that imports them.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.data import CharDataset, get_batch
from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.model import GPT, GPTConfig
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import run_on_ranks

REFUSE = (
    # ColumnParallelLinear, RowParallelLinear, qkv_rows, enter_region / leave_region (f and g),
    # apply_tensor_parallel: the library's tensor parallelism, the exercise's answer
    "course_lib.parallel.tp",
    # copy_to_group (f), reduce_from_group (g) and their autograd Functions _CopyToGroup, _ReduceFromGroup
    "course_lib.comm.autograd",
    # PyTorch's own column- and row-wise layers (ColwiseParallel, RowwiseParallel)
    "torch.distributed.tensor.parallel",
    "course_lib.grading.ex05_tensor_parallel",  # the checks themselves
    "course_lib.grading.ex05_uneven",
)
RANKS = dict(backend="gloo", timeout_s=60)  # CPU ranks; a rank waiting 60 s waits for a message nobody sent


def _module(name: str):
    """The learner's module on a rank (installed there by run_on_ranks, see course_lib.runtime.modules)."""
    return sys.modules[name]


def _summary(tracer: CommTracer) -> dict:
    return {op: s["calls"] for op, s in tracer.summary().items()}


# ------------------------------------------------------------------------------------- f and g

def _f_and_g_on_rank(name: str):
    student, r = _module(name), dist.get_rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    with CommTracer() as f_fwd:
        y = student.f(x)
    with CommTracer() as f_bwd:
        (y * (r + 1)).sum().backward()
    x2 = torch.full((3,), float(r + 1), requires_grad=True)
    with CommTracer() as g_fwd:
        z = student.g(x2)
    with CommTracer() as g_bwd:
        (z * (r + 1)).sum().backward()
    return {"f forward": y.tolist(), "f backward": x.grad.tolist(), "g forward": z.tolist(),
            "g backward": x2.grad.tolist(), "g's input after g": x2.tolist(),
            "f forward comm": _summary(f_fwd), "g backward comm": _summary(g_bwd),
            "f backward comm": _summary(f_bwd), "g forward comm": _summary(g_fwd)}


def check_f_and_g(student, world_sizes=(2, 4)):
    """Rank r: x = [r+1]*3, loss = (r+1) * sum(output). Exact: small integers in fp32."""
    for n in world_sizes:
        total = n * (n + 1) / 2  # 1 + 2 + ... + n
        for r, res in enumerate(run_on_ranks(_f_and_g_on_rank, student.__name__, world_size=n, **RANKS)):
            where = f"{n} ranks, rank {r}"
            check_equal(f"{where}: f forward gives the rank its own x", res["f forward"], [r + 1.0] * 3)
            check_equal(f"{where}: f backward gives x the gradient summed over the ranks", res["f backward"],
                        [total] * 3)
            check_equal(f"{where}: g forward gives the sum over the ranks", res["g forward"], [total] * 3)
            check_equal(f"{where}: g backward gives the rank its own gradient", res["g backward"], [r + 1.0] * 3)
            check_equal(f"{where}: g leaves its input unchanged", res["g's input after g"], [r + 1.0] * 3)
            check_equal(f"{where}: f forward and g backward send nothing (collectives called)",
                        (res["f forward comm"], res["g backward comm"]), ({}, {}))
            if not res["f backward comm"] or not res["g forward comm"]:
                raise CheckFailed(f"{where}: f backward and g forward must communicate (every rank's "
                                  f"contribution is needed), but the tracer saw no collective")


# ------------------------------------------------------------------------------ fused QKV rows

def _qkv_problems(rows_per_rank, d_model: int, n_head: int, tp: int) -> str | None:
    """Why these rows do not give each rank whole heads, in the layout attention and proj expect."""
    d_head, heads = d_model // n_head, n_head // tp
    local = 3 * d_model // tp
    for r, rows in enumerate(rows_per_rank):
        if not isinstance(rows, (list, tuple)) or not all(isinstance(i, int) for i in rows):
            return f"rank {r}: return a list of ints (got {type(rows).__name__})"
        if len(rows) != local:
            return f"rank {r} keeps {len(rows)} rows: each of {tp} ranks keeps a 1/tp share, 3*{d_model}/{tp}"
    flat = [i for rows in rows_per_rank for i in rows]
    if sorted(flat) != list(range(3 * d_model)):
        return "the ranks' rows together must be every row 0 ... 3*d_model-1 of the fused weight, each exactly once"
    parts = ("Q", "K", "V")
    for r, rows in enumerate(rows_per_rank):
        # what the unchanged attention module does with the rank's output: thirds, then heads
        for p, part in enumerate(parts):
            third = rows[p * local // 3:(p + 1) * local // 3]
            if any(not p * d_model <= i < (p + 1) * d_model for i in third):
                return (f"rank {r}: the {['first', 'second', 'last'][p]} third of its rows must come from the "
                        f"{part} part of the fused weight (rows {p * d_model} ... {(p + 1) * d_model - 1}): "
                        f"attention splits the rank's output into q, k, v thirds")
            features = [i - p * d_model for i in third]
            # proj's row-parallel shard on rank r reads attention features [r d/tp, (r+1) d/tp):
            # the outputs of heads r*heads ... (r+1)*heads - 1, in order
            want_heads = list(range(r * heads, (r + 1) * heads))
            got_heads = sorted({i // d_head for i in features})
            if got_heads != want_heads:
                return (f"rank {r}: its {part} rows belong to heads {got_heads}, but the row-parallel attn.proj "
                        f"on rank {r} reads the outputs of heads {want_heads}")
            if features != sorted(features):
                return f"rank {r}: its {part} rows must be in increasing order (head by head, feature by feature)"
    return None


QKV_CASES = ((8, 2, 2), (16, 4, 2), (64, 4, 4), (96, 12, 3), (768, 12, 4))


def check_qkv_rows(student):
    """Properties, checked exactly: every fused row once; rank r's rows are [Q | K | V] of whole heads,
    the heads whose outputs its row-parallel attn.proj shard reads."""
    for d_model, n_head, tp in QKV_CASES:
        rows = [student.qkv_rows_for_rank(d_model, n_head, tp, r) for r in range(tp)]
        rows = [x.tolist() if isinstance(x, torch.Tensor) else list(x) if isinstance(x, range) else x for x in rows]
        problem = _qkv_problems(rows, d_model, n_head, tp)
        if problem:
            raise CheckFailed(f"d_model={d_model}, {n_head} heads, tp={tp}: {problem}")
        passed(f"d_model={d_model}, {n_head} heads, tp={tp}: every rank keeps whole heads of Q, K and V")


# ------------------------------------------------------------------------- column -> row MLP

def _close(label: str, got: torch.Tensor, want: torch.Tensor, *, rtol: float, atol: float) -> None:
    """PASS, or CheckFailed with the shapes or the largest difference and how many values differ,
    never the expected values (the tolerance is stated where this is called)."""
    g, w = got.detach().double(), want.detach().double()
    if g.shape != w.shape:
        raise CheckFailed(f"{label}: got shape {tuple(g.shape)}, expected {tuple(w.shape)}")
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol)
    if bad.any():
        raise CheckFailed(f"{label}: {int(bad.sum())} of {bad.numel()} values differ, the largest by "
                          f"{(g - w).abs().max().item():.3g}")
    passed(label)


def _grad(p):
    return p.grad if isinstance(p, torch.Tensor) else None


def _same(shard, full) -> bool:
    """A bitwise copy (a shard is copied from the full layer, not computed)."""
    return isinstance(shard, torch.Tensor) and shard.shape == full.shape and torch.equal(shard.detach(), full.detach())


def _mlp_on_rank(name: str):
    student, r, n = _module(name), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same full layers and input on every rank
    fc, proj = nn.Linear(16, 64), nn.Linear(64, 16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    full = proj(F.gelu(fc(x)))
    full.square().sum().backward()
    fc_before, proj_before = fc.weight.detach().clone(), proj.weight.detach().clone()
    col, row = student.ColumnParallelLinear(fc), student.RowParallelLinear(proj)
    xr = x.detach().clone().requires_grad_(True)
    with CommTracer() as forward:
        out = row(F.gelu(col(xr)))
    with CommTracer() as backward:
        out.square().sum().backward()
    k = 64 // n
    mine = slice(r * k, (r + 1) * k)
    cw, cb, rw, rb = (getattr(layer, a, None) for layer in (col, row) for a in ("weight", "bias"))
    params = {"fc": [isinstance(p, nn.Parameter) for p in (cw, cb)],
              "proj": [isinstance(p, nn.Parameter) for p in (rw, rb)]}
    shards = {"fc weight: its rows of the full weight": _same(cw, fc.weight[mine]),
              "fc bias: the matching entries": _same(cb, fc.bias[mine]),
              "proj weight: its columns of the full weight": _same(rw, proj.weight[:, mine]),
              "proj bias: the whole bias": _same(rb, proj.bias)}
    # One SGD step on the shards: a shard that is a view of the full layer (a slice without a
    # copy) moves the full layer with it, and the full layer must stay as it was.
    with torch.no_grad():
        for shard in (cw, cb, rw, rb):
            if isinstance(shard, torch.Tensor) and shard.grad is not None:
                shard.sub_(0.1 * shard.grad)
    shards["the full layers unchanged by an SGD step on the shards (a shard is a copy, not a view)"] = (
        torch.equal(fc.weight, fc_before) and torch.equal(proj.weight, proj_before))
    return {"params": params, "shards": shards,
            "compare": {"output": (out, full), "input gradient": (xr.grad, x.grad),
                        "fc weight gradient": (_grad(cw), fc.weight.grad[mine]),
                        "fc bias gradient": (_grad(cb), fc.bias.grad[mine]),
                        "proj weight gradient": (_grad(rw), proj.weight.grad[:, mine]),
                        "proj bias gradient": (_grad(rb), proj.bias.grad)},
            "calls": [(s.get("all_reduce", {}).get("calls", 0), s.get("all_reduce", {}).get("bytes_sent", 0),
                       sum(v["calls"] for op, v in s.items() if op != "all_reduce"))
                      for s in (forward.summary(), backward.summary())]}


def check_mlp(student, world_sizes=(2, 4)):
    """Z = proj(GELU(fc(X))) with fc column-parallel and proj row-parallel, against the full layers."""
    x_bytes = 2 * 5 * 16 * 4  # X: (2, 5, 16) fp32
    for n in world_sizes:
        for r, res in enumerate(run_on_ranks(_mlp_on_rank, student.__name__, world_size=n, **RANKS)):
            where = f"{n} ranks, rank {r}"
            check_equal(f"{where}: weight and bias of both layers are nn.Parameters", res["params"],
                        {"fc": [True, True], "proj": [True, True]})
            for what, ok in res["shards"].items():
                if not ok:
                    raise CheckFailed(f"{where}: {what} (compare the shard with the full layer)")
            passed(f"{where}: each shard holds its slice of the full layer")
            for name, (got, want) in res["compare"].items():
                if got is None:
                    raise CheckFailed(f"{where}: {name} is None: the shard did not take part in backward")
                # fp32 sums of up to 64 products, split over the ranks and added again: the same terms
                # in another order (~1e-7 here; the worst case 64 eps sum|a b| is a few 1e-6)
                _close(f"{where}: {name} equals the single process's", got, want, rtol=1e-5, atol=1e-5)
            check_equal(f"{where}: (all-reduces, bytes each rank gives them, other collectives) in forward "
                        f"and in backward", res["calls"], [(1, x_bytes, 0), (1, x_bytes, 0)])


# ---------------------------------------------------------------------------- the course GPT

def _gpt_on_rank(name: str):
    student, r, n = _module(name), dist.get_rank(), dist.get_world_size()
    config = GPTConfig.tiny(CharDataset("train").vocab_size)
    x, y = get_batch(CharDataset("train", config.block_size), 4, torch.Generator().manual_seed(0))
    ref = GPT(config, seed=0)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    model = GPT(config, seed=0)
    rows = student.qkv_rows_for_rank(config.d_model, config.n_head, n, r)
    for block in model.blocks:
        block.attn.qkv = student.ColumnParallelLinear(block.attn.qkv, rows=rows)
        block.attn.proj = student.RowParallelLinear(block.attn.proj)
        block.mlp.fc = student.ColumnParallelLinear(block.mlp.fc)
        block.mlp.proj = student.RowParallelLinear(block.mlp.proj)
    loss = model(x, y)[1]
    loss.backward()
    k, kf = config.d_model // n, config.ff_dim // n
    rows = torch.as_tensor(list(rows))
    return {"loss": (loss, ref_loss),
            "qkv weight gradient (its heads)": (model.blocks[0].attn.qkv.weight.grad,
                                                ref.blocks[0].attn.qkv.weight.grad[rows]),
            "attn.proj weight gradient": (model.blocks[1].attn.proj.weight.grad,
                                          ref.blocks[1].attn.proj.weight.grad[:, r * k:(r + 1) * k]),
            "mlp.fc bias gradient": (model.blocks[1].mlp.fc.bias.grad,
                                     ref.blocks[1].mlp.fc.bias.grad[r * kf:(r + 1) * kf]),
            "embedding gradient": (model.tok_emb.weight.grad, ref.tok_emb.weight.grad)}


def check_gpt(student, world_size: int = 2):
    """The course GPT with every block's qkv, attn.proj, mlp.fc and mlp.proj replaced by the learner's
    layers: the loss and the gradients against the single-process GPT."""
    for r, res in enumerate(run_on_ranks(_gpt_on_rank, student.__name__, world_size=world_size, **RANKS)):
        for name, (got, want) in res.items():
            if got is None:
                raise CheckFailed(f"rank {r}: {name} is None: the shard did not take part in backward")
            # one forward and backward through 2 layers in fp32: the same sums in another order
            # (~1e-7 relative); a wrong split or a missing sum is off by far more (1e-3 and up)
            _close(f"{world_size} ranks, rank {r}: {name} equals the single process's", got, want,
                   rtol=1e-4, atol=1e-6)
