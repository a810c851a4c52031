"""Checkers of exercise 12 (reshard flat ZeRO shards from N to M ranks by global offsets).

Nothing here computes a plan: the checks hold the learner's functions to the rules a plan must
obey, to values derived by hand for fixed cases, and to real runs.

    check_shard_range(student)       hand-derived ranges; equal shards, back to back, the fewest
                                     that cover the unit; a rank outside [0, N) is refused
    check_read_plan(student)         hand-derived plans; on every case, every real element is
                                     read exactly once, from the old shard where it lives, into
                                     its new rank's shard, never from the padding
    check_reshard_flat(student)      shards whose values are their global offsets (padding
                                     marked): each new element is its own offset, padding zero
    check_reads_on_ranks(student)    each new rank plans its own reads and opens only the old
                                     files it needs
    check_resume_on_fewer_ranks(student)  real ZeRO-3 shards saved on 4 ranks, resharded to 2:
                                     training continues like the run that never stopped

REFUSE names the library functions that already hold the answer (load_student refuses a
student module that imports them).
(A few lines over 300: the watched shards that log every read live beside the checks that read
them.)
"""

from __future__ import annotations

import pathlib
import tempfile

import torch

from course_lib.checkpoint.flat import STATE, read_flat_shards, train_zero3_flat
from course_lib.data import CharDataset
from course_lib.grading import CheckFailed, check_close, check_equal, passed
from course_lib.grading.stored import check_digest
from course_lib.model import GPTConfig
from course_lib.runtime.pool import run_on_ranks
from course_lib.train import TrainConfig

# The library's shard rule and everything that reshards by it (boxes, layouts, readers).
REFUSE = (
    "course_lib.parallel.zero.flat",  # shard_bounds, FlatUnit (re-exported by course_lib.parallel.zero)
    "course_lib.checkpoint.reshard", "course_lib.checkpoint.layouts", "course_lib.checkpoint.slots",
    "course_lib.parallel.placement",  # Placement.of_flat_unit: a parameter's range of the ZeRO shards
    "course_lib.checkpoint.reader", "course_lib.checkpoint.hybrid", "course_lib.checkpoint.dcp",
    "course_lib.checkpoint.viz",
)  # their re-exports (course_lib.checkpoint.Box, ...) and the helpers wrapping them are refused by refusal.py

# (numel, old_world, new_world, old shard size S, new shard size S'), S = ceil(numel / world) worked
# out by hand: 10/4 -> 3 (4*3 = 12 >= 10 > 4*2), 10/3 -> 4, 7/2 -> 4, 7/5 -> 2, 3/4 -> 1, 3/2 -> 2,
# 1/3 -> 1, 1/2 -> 1, 100/8 -> 13 (104 >= 100 > 96), 100/3 -> 34, 101/5 -> 21 (105 >= 101 > 100),
# 101/7 -> 15 (105 >= 101 > 98), 64/4 -> 16, 64/2 -> 32, 9/1 -> 9, 9/4 -> 3, 12/6 -> 2, 12/4 -> 3.
# Units smaller than the world (3 on 4, 1 on 3) leave whole shards in the padding.
CASES = [(10, 4, 3, 3, 4), (10, 3, 4, 4, 3), (7, 2, 5, 4, 2), (3, 4, 2, 1, 2), (1, 3, 2, 1, 1),
         (100, 8, 3, 13, 34), (101, 5, 7, 21, 15), (64, 4, 2, 16, 32), (9, 1, 4, 9, 3), (12, 6, 4, 2, 3)]

# The answers worked out by hand for a few small layouts, stored as digests (course_lib.grading.
# stored): RANGES_BY_HAND is digest({(numel, world): [shard_range(numel, world, r) for r]}) and
# PLANS_BY_HAND digest({(numel, old, new): [read_plan(numel, old, new, r) for r]}) of the
# reference solution on these keys, checked against the hand derivation when they were stored.
RANGE_KEYS = ((10, 4), (10, 3), (3, 4), (1, 3), (101, 5), (9, 1))
RANGES_BY_HAND = "514d002d64d96a01b963f15f9b479c4cf2282bf9dece8d837efd2f2e5fa9f9f3"
PLAN_KEYS = ((10, 4, 3), (10, 3, 4), (3, 4, 2), (1, 3, 2))
PLANS_BY_HAND = "a86de035c24271819ac008169a2e51554456104141eb132a4e824eaacdab64e0"


def _ints(label, values, width):
    """A tuple of `width` Python ints from what the learner returned (ints, 0-d tensors ...)."""
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError) as e:
        raise CheckFailed(f"{label}: expected a tuple of {width} integers, got {values!r}") from e
    if len(out) != width or any(o != v for o, v in zip(out, values)):
        raise CheckFailed(f"{label}: expected a tuple of {width} integers, got {values!r}")
    return out


def check_shard_range(student) -> None:
    got = {(numel, n): [_ints(f"shard_range({numel}, {n}, {r})", student.shard_range(numel, n, r), 2)
                        for r in range(n)] for numel, n in RANGE_KEYS}
    check_digest(f"shard_range on every rank of {len(got)} layouts worked out by hand", got, RANGES_BY_HAND,
                 hint="Draw each layout: every rank's range has the same size, padding included.")
    for numel, old, new, s_old, s_new in CASES:
        for n, size in ((old, s_old), (new, s_new)):
            ranges = [_ints(f"shard_range({numel}, {n}, {r})", student.shard_range(numel, n, r), 2) for r in range(n)]
            if ranges[0][0] != 0 or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
                raise CheckFailed(f"shard_range({numel}, {n}, r): {ranges} are not back to back from 0")
            if any(b - a != size for a, b in ranges):
                raise CheckFailed(f"shard_range({numel}, {n}, r): {ranges}: every shard must have "
                                  f"{size} elements, the fewest such that {n} of them hold {numel}")
    passed(f"shard_range: equal shards, back to back, the fewest that hold the unit ({len(CASES)} cases)")
    for numel, n, bad in ((10, 4, 4), (10, 4, -1), (5, 2, 7)):
        try:
            student.shard_range(numel, n, bad)
        except ValueError:
            continue
        raise CheckFailed(f"shard_range({numel}, {n}, rank={bad}) must raise ValueError (rank outside [0, {n}))")
    passed("shard_range refuses a rank outside [0, world_size) with ValueError")


def _plan(student, numel, old, new, r):
    label = f"read_plan({numel}, {old}, {new}, new_rank={r})"
    plan = student.read_plan(numel, old, new, r)
    if not isinstance(plan, (list, tuple)):
        raise CheckFailed(f"{label}: expected a list of (old_rank, src_start, src_stop, dst_start), got {plan!r}")
    return label, [_ints(label, p, 4) for p in plan]


def plan_errors(label, plan, numel, old, new, r, s_old, s_new) -> list[str]:
    """Every rule the plan of new rank r breaks (empty: it is right). The rules determine the plan:
    its reads tile exactly the real part of r's range, each from the one old shard that holds it."""
    errors, seen, olds = [], [], [p[0] for p in plan]
    if olds != sorted(set(olds)):
        errors.append(f"old ranks {olds} must be increasing, each at most once")
    for o, a, b, d in plan:
        if not 0 <= o < old:
            errors.append(f"({o}, {a}, {b}, {d}): there is no old rank {o} of {old}")
            continue
        if not 0 <= a < b <= s_old:
            errors.append(f"({o}, {a}, {b}, {d}): [{a}, {b}) is not a non-empty slice of an old shard of {s_old}")
            continue
        if not 0 <= d <= d + b - a <= s_new:
            errors.append(f"({o}, {a}, {b}, {d}): {b - a} elements at {d} do not fit in a new shard of {s_new}")
            continue
        src, dst = o * s_old + a, r * s_new + d  # global offsets of the first element read and written
        if src != dst:
            errors.append(f"({o}, {a}, {b}, {d}): reads global offset {src} into global offset {dst}")
        if src + b - a > numel:
            errors.append(f"({o}, {a}, {b}, {d}): reads global [{src}, {src + b - a}), past numel={numel}: padding")
        seen += range(dst, dst + b - a)
    want = list(range(r * s_new, min((r + 1) * s_new, numel)))
    if not errors and sorted(seen) != want:
        errors.append(f"writes global offsets {sorted(seen)}, the real part of this rank's range is "
                      f"[{r * s_new}, {min((r + 1) * s_new, numel)}) (each element once)")
    return [f"{label}: {e}" for e in errors]


def check_read_plan(student) -> None:
    covered = 0
    for numel, old, new, s_old, s_new in CASES:
        reads = []
        for r in range(new):
            label, plan = _plan(student, numel, old, new, r)
            errors = plan_errors(label, plan, numel, old, new, r, s_old, s_new)
            if errors:
                raise CheckFailed("\n".join(errors[:5]))
            reads += [(o * s_old + a, o * s_old + b) for o, a, b, _ in plan]
        if sorted(i for a, b in reads for i in range(a, b)) != list(range(numel)):
            raise CheckFailed(f"read_plan({numel}, {old}, {new}, r): the new ranks together do not read "
                              f"every element of [0, {numel}) exactly once")
        covered += new
    passed(f"read_plan on {covered} new ranks of {len(CASES)} layouts: every real element read once, "
          f"from the old shard that holds it, to its new rank's slot; no padding read")
    got = {key: [_plan(student, *key, r)[1] for r in range(key[2])] for key in PLAN_KEYS}
    check_digest(f"read_plan on {len(got)} layouts worked out by hand", got, PLANS_BY_HAND,
                 hint="Draw the old and the new ranges of each layout and list each new rank's overlaps.")


# What reshard_flat may do with an old shard without reading it
_METADATA = {"dtype", "device", "shape", "size", "numel", "dim", "ndim", "__len__", "is_floating_point",
             "element_size", "layout", "requires_grad", "is_contiguous", "stride", "__format__", "__repr__"}


class _Watched(torch.Tensor):
    """An old shard handed to reshard_flat: records each read as (name, start, stop) of its
    elements (a slice or narrow along the shard), or (name, None, None) for an operation that
    takes the whole shard (torch.cat, clone, tolist, arithmetic ...)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: dtype, shape ...
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA:
            flat = [a for arg in (*args, *kwargs.values())
                    for a in (arg if isinstance(arg, (list, tuple)) else (arg,)) if isinstance(a, _Watched)]
            for shard in flat:
                shard.reads.append(_what_is_read(name, shard, args, len(flat)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _what_is_read(name, shard, args, n_shards):
    n = shard.shape[0]
    if n_shards == 1 and args and args[0] is shard:
        if name == "__getitem__" and isinstance(args[1], slice) and args[1].step in (None, 1):
            start, stop, _ = args[1].indices(n)
            return name, start, max(start, stop)
        if name == "__getitem__" and isinstance(args[1], int):
            return name, args[1] % n, args[1] % n + 1
        if name == "narrow" and len(args) == 4 and args[1] == 0:
            return name, args[2], args[2] + args[3]
    return name, None, None


def _watched(shards):
    out = []
    for s in shards:
        w = torch.Tensor._make_subclass(_Watched, s)
        w.reads = []
        out.append(w)
    return out


def check_reads(label, student, watched, numel, new) -> None:
    """What reshard_flat read from the old shards: only the slices the read plans name, each once
    (so never the padding, never a whole shard, never two shards joined into one tensor)."""
    planned = sorted((o, a, b) for r in range(new) for o, a, b, _ in student.read_plan(numel, len(watched), new, r))
    read = []
    for k, w in enumerate(watched):
        for name, a, b in w.reads:
            if a is None:
                raise CheckFailed(f"{label}: reshard_flat in student.py used all of old shard {k} at once "
                                  f"({name}): at scale no process holds every old shard (nor joins them); read "
                                  f"only the slices read_plan names")
            read.append((k, a, b))
    if sorted(read) != planned:
        raise CheckFailed(f"{label}: reshard_flat in student.py read the old shards' slices {sorted(read)} "
                          f"(old rank, start, stop), its read plans name {planned}: read each planned slice "
                          f"once, and nothing else")


PAD = -7  # what the old padding holds in the made-up shards: no real element is negative


def _offset_shards(numel, world, size, dtype, pad):
    """The `world` saved shards of a unit whose element i is i + 1 (so 0 never is a real value),
    with `pad` in the padding: a read from the padding shows up as `pad`."""
    values = torch.cat([torch.arange(1, numel + 1, dtype=dtype), torch.full((world * size - numel,), pad, dtype=dtype)])
    return [values[r * size:(r + 1) * size].clone() for r in range(world)]


def check_reshard_flat(student) -> None:
    for dtype in (torch.float32, torch.int64):  # what ZeRO saves; and integers, to see every value exactly
        for numel, old, new, s_old, s_new in CASES:
            label = f"reshard_flat, {numel} elements, {old} -> {new} ranks, {str(dtype)[6:]}"
            shards = _offset_shards(numel, old, s_old, dtype, PAD)
            before = [s.clone() for s in shards]
            watched = _watched(shards)
            out = student.reshard_flat(watched, numel, new)
            if len(out) != new or any(not isinstance(t, torch.Tensor) or t.shape != (s_new,) or t.dtype != dtype
                                      for t in out):
                raise CheckFailed(f"{label}: expected {new} {dtype} tensors of shape ({s_new},), got "
                                  f"{[(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in out]}")
            want = _offset_shards(numel, new, s_new, dtype, 0)  # element i is i + 1, zeros in the padding
            for r, (g, w) in enumerate(zip(out, want)):
                if not torch.equal(g, w):
                    j = int((g != w).nonzero()[0])
                    raise CheckFailed(f"{label}: new rank {r} holds {g.tolist()}: position {j} is wrong (the unit's "
                                      f"element i holds i + 1, {PAD} marks the old padding, and the new padding "
                                      f"must be 0)" + (": it marks the old padding" if int(g[j]) == PAD else ""))
            if not all(torch.equal(a, b) for a, b in zip(shards, before)):
                raise CheckFailed(f"{label}: reshard_flat in student.py modified the old shards")
            check_reads(label, student, watched, numel, new)
    passed(f"reshard_flat on {2 * len(CASES)} layouts: every element at its global offset, zero padding, "
          f"old shards untouched, each read only the slices the read plans name")


def _read_own_shard(read_plan, directory, numel, old_world, size):
    """Rank code: this new rank plans its reads and loads only the old files it needs."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    shard, opened = torch.zeros(size, dtype=torch.float64), []
    for o, a, b, d in read_plan(numel, old_world, world, rank):
        old = torch.load(pathlib.Path(directory) / f"old{o}.pt", weights_only=True)
        opened.append(int(o))
        shard[int(d):int(d) + int(b) - int(a)] = old[int(a):int(b)]
    return shard, opened


def check_reads_on_ranks(student) -> None:
    """4 old shard files of a 37-element unit (S = 10, by hand: 40 >= 37 > 36), read by 3 new
    ranks (S' = 13: 39 >= 37 > 36) that each plan their own reads."""
    numel, old_world, s_old, s_new = 37, 4, 10, 13
    with tempfile.TemporaryDirectory(prefix="ex11_") as d:
        for r, s in enumerate(_offset_shards(numel, old_world, s_old, torch.float64, PAD)):
            torch.save(s, pathlib.Path(d) / f"old{r}.pt")
        results = run_on_ranks(_read_own_shard, student.read_plan, d, numel, old_world, s_new, world_size=3,
                               timeout_s=120)
    want = _offset_shards(numel, 3, s_new, torch.float64, 0)
    check_equal("3 ranks, each reading its own shard: values by global offset, zero padding",
                [s.tolist() for s, _ in results], [w.tolist() for w in want])
    # by hand: new [0,13) [13,26) [26,39); old [0,10) [10,20) [20,30) [30,40) (37..39 padding)
    check_equal("each rank opened only the old files that hold its elements", [o for _, o in results],
                [[0, 1], [1, 2], [2, 3]])


def check_resume_on_fewer_ranks(student) -> None:
    """ZeRO-3 on 4 ranks trains 3 steps and saves its flat shards (parameters, Adam's moments);
    the learner's reshard_flat makes 2 ranks' shards; ZeRO-3 on 2 ranks trains 3 more. Compared
    with 6 steps on 4 ranks without stopping."""
    config = GPTConfig.tiny(CharDataset("train", 16).vocab_size, block_size=16, n_layer=1, n_head=2, d_model=32)
    steps = lambda k: TrainConfig(steps=k, batch_size=8, progress=False)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="ex11_") as saved:
        full = run_on_ranks(train_zero3_flat, config, steps(6), world_size=4, timeout_s=120)[0]
        run_on_ranks(train_zero3_flat, config, steps(3), saved, world_size=4, timeout_s=120)
        old = read_flat_shards(saved)
    new = [{**old[0], "units": []} for _ in range(2)]  # step, data position and losses are replicated
    for u, unit in enumerate(old[0]["units"]):
        pieces = {k: student.reshard_flat([o["units"][u][k] for o in old], unit["numel"], 2) for k in ("param",) + STATE}
        for r in range(2):
            new[r]["units"].append({"numel": unit["numel"], "step": unit["step"], **{k: v[r] for k, v in pieces.items()}})
    resumed = run_on_ranks(train_zero3_flat, config, steps(6), resume=new, world_size=2, timeout_s=120)[0]
    check_equal("steps 1-3 restored from the shards", resumed.train_losses[:3], full.train_losses[:3])
    # 2 ranks add the gradient in another order than 4: losses ~1e-7 apart (fp32 sums of 4 vs 2
    # partial averages); 1e-5 leaves two orders of magnitude for AdamW's amplification over 3 steps
    check_close("steps 4-6 on 2 ranks equal the uninterrupted 4-rank run", resumed.train_losses[3:],
                full.train_losses[3:], rtol=0, atol=1e-5)
    # parameters in RMS against a hundredth of one AdamW step (lr): AdamW magnifies the rounding of
    # gradients near zero up to about lr per element (notebook 04), but not on average
    check_close("final parameters equal the uninterrupted run (RMS of the difference)",
                (resumed.final_params - full.final_params).pow(2).mean().sqrt().item(), 0.0,
                rtol=0, atol=TrainConfig().lr / 100)
