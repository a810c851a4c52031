"""Checks of exercise 08: a ZeRO-2 optimizer whose gradients leave as backward produces them.

The learner's `Zero2AdamW` shards every parameter on its own: parameter i (P_i elements) is
flattened, zero-padded to N·S_i with S_i = ceil(P_i / N), and rank r owns [r·S_i, (r+1)·S_i).
With S = sum_i S_i and P = sum_i P_i (fp32, 4 bytes an element), the checks hold it to:

  * gradient shards: after one backward, rank r's shards laid side by side over the ranks are
    the gradient of the whole batch (the mean over the ranks' shares), zero in the padding;
  * training: 3 AdamW steps on N ranks end where one process ends on the whole batch;
  * after step(): the rank holds 4S bytes of fp32 master weights + 8S of AdamW moments (m, v),
    12S in all, and no gradient;
  * gradient bytes during backward (ZeRO stage 2, P_os+g in Rajbhandari et al. 2020): the rank holds
    its gradient shards plus the one full gradient backward has just handed over,
        peak <= 4·(S + max_i P_i)   bytes,   against stage 1's 4P (every gradient, then reduce-scatter);
  * collectives of a step: one reduce-scatter per parameter (4·N·S bytes in all, in) and
    all-gathers of every shard (4·N·S bytes out); nothing else.

How bytes are measured (`HeldBytes`): the storages of every tensor the rank can reach from the
parameters' `.grad`, from the learner's optimizer object (its attributes, lists, dicts, a torch
optimizer's state, each tensor's `.grad`) and from the hooks the learner put on the parameters,
each storage once, the model's parameters and 0-dim counters excluded. A gradient byte is one
of those beyond what the rank held when backward started. It is read just before the learner's
hook sees each gradient (the checker's hook is registered first, so it runs first) and once
after backward: what the learner keeps, not the transient buffers inside one hook or inside
the backend (gloo runs a reduce-scatter as an all-reduce plus a slice, notebook 08 §7).
(Over 300 lines: HeldBytes, the measuring of what a rank holds, is most of it; part 2, Muon's
owner step, is checked in ex08_muon.py.)
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist

from course_lib.data import VOCAB_SIZE, CharDataset, collate, sample_indices
from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.grading.stored import check_digest
from course_lib.model import GPT, GPTConfig
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import run_on_ranks
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig, train_step

# What holds this exercise's answer: the course's ZeRO, torch's ZeroRedundancyOptimizer and FSDP.
# Part 2's: the course's sharded Muon and its owner assignment (parallel.zero.muon, estimate.muon).
REFUSE = ("course_lib.parallel.zero", "torch.distributed.optim", "torch.distributed.fsdp",
          "torch.distributed._composable", "course_lib.estimate.muon",
          "course_lib.grading.ex08_zero2_step", "course_lib.grading.ex08_muon")  # and the checks themselves
WORLD_SIZES = (2, 4)
TRAIN = TrainConfig(steps=3, batch_size=12, lr=3e-3, grad_clip=0.0, progress=False)
ADAMW = dict(lr=TRAIN.lr, betas=TRAIN.betas, weight_decay=TRAIN.weight_decay)
RANKS = dict(backend="gloo", timeout_s=120)


def model_config() -> GPTConfig:
    return GPTConfig.tiny(VOCAB_SIZE, n_layer=3, d_ff=127, block_size=32)  # fc.bias: 127, not a multiple of N


def formulas(n: int) -> dict[str, int]:
    """The byte counts of the module docstring for N = n ranks."""
    sizes = [p.numel() for p in GPT(model_config()).parameters()]
    shard = sum(-(-size // n) for size in sizes)
    return {"params": len(sizes), "P": sum(sizes), "S": shard, "largest": max(sizes), "stage1": 4 * sum(sizes),
            "stage2_bound": 4 * (shard + max(sizes)), "after_step": 12 * shard, "padded": 4 * n * shard}


def batches(steps: int):
    """The same global batches on every rank and in the single process (seeded generator)."""
    data = CharDataset("train", block_size=model_config().block_size)
    gen = torch.Generator().manual_seed(TRAIN.seed)
    return [collate(data, sample_indices(len(data), TRAIN.batch_size, gen)) for _ in range(steps)]


def _share(t: torch.Tensor) -> torch.Tensor:
    rank, n = dist.get_rank(), dist.get_world_size()
    size = TRAIN.batch_size // n
    return t[rank * size:(rank + 1) * size]


# ---------------------------------------------------------------- measuring what a rank holds
class HeldBytes:
    """Bytes of the tensors a rank holds beside its parameters (see the module docstring).

    Build it before the optimizer (its hooks must run before the learner's), then `watch(opt)`.
    `start()` at the start of a backward; `peak` is then the most gradient bytes seen since.
    """

    def __init__(self, params):
        self.params = list(params)
        self.skip = {p.untyped_storage().data_ptr() for p in self.params}
        self.opt, self.base, self.peak = None, 0, 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._seen)

    def watch(self, optimizer) -> None:
        self.opt = optimizer

    def held(self) -> int:
        roots = [p.grad for p in self.params] + [self.opt]
        for p in self.params:  # the learner's hooks (and whatever their closures hold)
            roots += [h for h in getattr(p, "_post_accumulate_grad_hooks", {}).values()
                      if getattr(h, "__self__", None) is not self]
        seen, storages, stack = set(), {}, roots
        while stack:
            obj = stack.pop()
            if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type,
                                                                 types.ModuleType)):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                if obj.dim() > 0 and obj.device.type != "meta":
                    key = obj.untyped_storage().data_ptr()
                    if key not in self.skip:
                        storages[key] = obj.untyped_storage().nbytes()
                stack.append(obj.grad)
            elif isinstance(obj, dict):
                stack += list(obj.keys()) + list(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                stack += list(obj)
            elif isinstance(obj, functools.partial):
                stack += [obj.func, *obj.args, *obj.keywords.values()]
            elif isinstance(obj, types.MethodType):
                stack += [obj.__self__, obj.__func__]
            elif isinstance(obj, types.FunctionType):
                stack += [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            elif hasattr(obj, "__dict__") and not type(obj).__module__.startswith("torch._C"):
                stack += list(vars(obj).values())
        return sum(storages.values())

    def start(self) -> None:
        self.base, self.peak = self.held(), 0

    def after_backward(self) -> None:
        self.peak = max(self.peak, self.held() - self.base)

    def _seen(self, _param) -> None:
        self.after_backward()


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------- rank code
def rank_gradient_shards(optimizer_class) -> list[torch.Tensor]:
    """One backward on this rank's share of a fixed batch, then step(): the shards it returns."""
    model = GPT(model_config(), seed=TRAIN.seed)
    opt = optimizer_class(model.parameters(), **ADAMW)
    x, y = batches(1)[0]
    model(_share(x), _share(y))[1].backward()
    return [s.detach().clone() for s in opt.step()]


def rank_train(optimizer_class) -> dict:
    """TRAIN.steps steps of zero_grad, forward, backward, step(), measured as the docstring says."""
    model = GPT(model_config(), seed=TRAIN.seed)
    probe = HeldBytes(model.parameters())
    opt = optimizer_class(model.parameters(), **ADAMW)
    probe.watch(opt)
    out = {"losses": [], "peak": [], "after_step": [], "grads_left": [], "comm": []}

    def backward(loss):
        probe.start()
        loss.backward()
        probe.after_backward()

    for x, y in batches(TRAIN.steps):
        with CommTracer() as tracer:
            loss = train_step(model, opt, _share(x), _share(y), backward=backward)
        out["losses"].append(loss)
        out["peak"].append(probe.peak)
        out["after_step"].append(probe.held())
        out["grads_left"].append(sum(p.grad is not None for p in model.parameters()))
        out["comm"].append(tracer.summary())
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


def run_training(optimizer_class, n: int) -> list[dict]:
    """rank_train on n real ranks (gloo), in rank order."""
    if n < 1 or TRAIN.batch_size % n:
        raise ValueError(f"n={n} ranks must divide the batch of {TRAIN.batch_size}: every rank takes an equal share")
    return run_on_ranks(rank_train, optimizer_class, world_size=n, **RANKS)


@functools.lru_cache(maxsize=1)
def single_process() -> tuple[torch.Tensor, list[float], torch.Tensor]:
    """The reference: torch.optim.AdamW in one process on the whole batch. (final params, losses,
    the gradient of the first batch at the initial weights)."""
    model = GPT(model_config(), seed=TRAIN.seed)
    x, y = batches(1)[0]
    model(x, y)[1].backward()
    first_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model = GPT(model_config(), seed=TRAIN.seed)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=False)
    losses = [train_step(model, opt, x, y) for x, y in batches(TRAIN.steps)]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses, first_grad


# ---------------------------------------------------------------- the checks (parent side)
# digest(...) of the reference solution's answer for each case (course_lib.grading.stored): the
# expected bounds are not kept readable here
SHARD_BOUNDS = [
    ("10 elements on 4 ranks", (10, 4), "9041bd275b244d395dce0e03d748f68fea58c73a37a55d7e8965235ef31af1a5"),
    ("12 elements on 4 ranks (no padding)", (12, 4), "9041bd275b244d395dce0e03d748f68fea58c73a37a55d7e8965235ef31af1a5"),
    ("1 element on 2 ranks", (1, 2), "3846e25a55ae016d7d5f9d629f5a8322da601969fab22b300ee1b3234ddc3e68"),
]
BOUNDS_127_RANK_3 = "c0d2f6a9d7ba16b671665c6501b9fc49623fee6599606c63391819c0ee09e039"  # shard_bounds(127, 4, 3)
BOUNDS_HINT = ("every rank's piece has the same size S = ceil(numel / N) (the tensor is padded to N·S), "
               "rank r's piece starts at r·S, and the last piece may reach into the padding")


def _bounds(value):
    """A learner's (start, stop) as plain ints, so that a tuple, a list or numpy ints all compare."""
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        return value


def check_shard_bounds(shard_bounds) -> None:
    for label, (numel, n), want in SHARD_BOUNDS:
        check_digest(label, [_bounds(shard_bounds(numel, n, r)) for r in range(n)], want, hint=BOUNDS_HINT)
    check_digest("127 elements (mlp.fc.bias) on 4 ranks, rank 3", _bounds(shard_bounds(127, 4, 3)),
                 BOUNDS_127_RANK_3, hint=BOUNDS_HINT)


def _close(label: str, got, want, *, rtol: float, atol: float, hint: str = "") -> None:
    """PASS, or CheckFailed with the largest difference and a hint, never the expected values."""
    g, w = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    if g.shape != w.shape:
        raise CheckFailed(f"{label}: got shape {tuple(g.shape)}, expected {tuple(w.shape)}")
    if torch.allclose(g, w, rtol=rtol, atol=atol):
        passed(label)
        return
    worst = (g - w).abs().max().item()
    raise CheckFailed(f"{label}: values differ (largest difference {worst:.3g})" + (f"; {hint}" if hint else ""))


def check_gradient_shards(per_rank: list[list[torch.Tensor]]) -> None:
    """per_rank: what rank_gradient_shards returned on each rank."""
    n = len(per_rank)
    sizes = [p.numel() for p in GPT(model_config()).parameters()]
    check_equal(f"{n} ranks: one shard per parameter, S_i = ceil(P_i / N) elements each",
                [[s.numel() for s in shards] for shards in per_rank], [[-(-size // n) for size in sizes]] * n)
    whole = [torch.cat([shards[i] for shards in per_rank]) for i in range(len(sizes))]
    got = torch.cat([w[:size] for w, size in zip(whole, sizes)])
    want = single_process()[2]
    # One backward, no optimizer step: fp32 sums over the batch in another order (per rank, then
    # across ranks); ~n·2^-23 relative for the <= ~400 tokens summed, 1e-4 leaves a margin; elements
    # that cancel to ~0 keep the absolute error of their terms: 1e-4 of the largest element.
    # A sum instead of the mean is off by a factor N.
    scale = (got @ want / (want @ want)).item()  # got = scale * want when only the scaling is off
    hint = (f"your shards are {scale:.3g} times the mean gradient: each rank's gradient is the mean over its own "
            f"rows, and the reduce-scatter sums the N ranks' contributions" if abs(scale - 1) > 1e-3 else
            "rank r's shard must be piece r of the flattened, padded gradient, averaged over the ranks")
    _close(f"{n} ranks: the shards side by side = the whole batch's gradient", got, want,
           rtol=1e-4, atol=1e-4 * want.abs().max().item(), hint=hint)
    check_equal(f"{n} ranks: zero gradient in the padding",
                all(bool((w[size:] == 0).all()) for w, size in zip(whole, sizes)), True)


def check_same_as_one_process(out: list[dict]) -> None:
    n = len(out)
    params, losses, _ = single_process()
    for rank, o in enumerate(out):
        # In RMS, against a hundredth of one AdamW step: AdamW magnifies the rounding of a gradient
        # near zero and can move that one element by up to ~lr; a wrong step moves most by ~lr.
        rms = (o["params"] - params).pow(2).mean().sqrt().item()
        _close(f"{n} ranks, rank {rank}: parameters after {TRAIN.steps} steps (RMS of the difference)",
               rms, 0.0, rtol=0, atol=TRAIN.lr / 100,
               hint="after step() every rank must hold every parameter whole and updated: the shards it "
                    "updated and the ones the other ranks updated")
    # Loss of the whole batch = mean of the ranks' equal shares. adamw_loss_atol (course_lib.tolerances)
    # says why: fp32 sums in another order, plus elements AdamW moved by up to lr on rounding.
    _close(f"{n} ranks: loss of each of the {TRAIN.steps} steps (mean over ranks)",
           [sum(o["losses"][s] for o in out) / n for s in range(TRAIN.steps)], losses,
           rtol=0, atol=adamw_loss_atol(TRAIN.lr), hint="the first step's loss is right when the forward is: "
           "a later one differs when the update is wrong")


def check_state_after_step(out: list[dict]) -> None:
    f = formulas(len(out))
    check_equal(f"{len(out)} ranks: bytes held after each step() = 12 x S = {f['after_step']:,} "
                f"(fp32 master shard 4 + AdamW m, v 8)", [o["after_step"] for o in out],
                [[f["after_step"]] * TRAIN.steps] * len(out))
    check_equal(f"{len(out)} ranks: no full gradient left after step()", [o["grads_left"] for o in out],
                [[0] * TRAIN.steps] * len(out))


def check_peak_gradient_bytes(out: list[dict]) -> None:
    f = formulas(len(out))
    for rank, o in enumerate(out):
        if max(o["peak"]) > f["stage2_bound"]:
            raise CheckFailed(
                f"{len(out)} ranks, rank {rank}: held {max(o['peak']):,} gradient bytes during backward "
                f"(per step: {o['peak']}), more than its shards plus one full gradient, 4(S + max P_i) = "
                f"{f['stage2_bound']:,}. Stage 1 holds them all ({f['stage1']:,}): each gradient must be "
                f"reduce-scattered and dropped as backward hands it over, not after backward ends.")
        passed(f"{len(out)} ranks, rank {rank}: gradient bytes during backward <= 4(S + max P_i) = "
              f"{f['stage2_bound']:,} (stage 1 holds 4P = {f['stage1']:,})")


def check_collectives(out: list[dict]) -> None:
    f, n = formulas(len(out)), len(out)
    seen = [[_by_family(step) for step in o["comm"]] for o in out]
    check_equal(f"{n} ranks: collectives of each step", sorted({op for o in seen for step in o for op in step}),
                ["all_gather", "reduce_scatter"])
    rs = [[(s["reduce_scatter"]["calls"], s["reduce_scatter"]["bytes_sent"]) for s in o] for o in seen]
    check_equal(f"{n} ranks: one reduce-scatter per parameter ({f['params']}), 4NS = {f['padded']:,} bytes in",
                rs, [[(f["params"], f["padded"])] * TRAIN.steps] * n)
    ag = [[s["all_gather"]["bytes_recv"] for s in o] for o in seen]
    check_equal(f"{n} ranks: all-gathers bring back every shard, 4NS = {f['padded']:,} bytes",
                ag, [[f["padded"]] * TRAIN.steps] * n)


def _by_family(summary: dict) -> dict:
    """A tracer summary with reduce_scatter_single/_tensor/... summed as "reduce_scatter" (and
    all_gather_single/_into_tensor/... as "all_gather"): any of torch's names is fine."""
    out: dict[str, dict[str, int]] = {}
    for op, s in summary.items():
        family = next((f for f in ("reduce_scatter", "all_gather") if op.startswith(f)), op)
        into = out.setdefault(family, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
        for k in into:
            into[k] += s[k]
    return out
