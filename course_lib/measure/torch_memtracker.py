"""One ZeRO-3 step's memory three ways: notebook 01's formula, the course's own measurement, and
PyTorch's MemTracker (torch.distributed._tools.mem_tracker), on every rank (notebook 08).

    memtracker_missing()                         None, or one sentence: why this torch cannot run it
    memtracker_step(config, batch_size, seed, reshard_after_forward)   rank code: one step, the columns
    memory_three_ways(config, world_size, batch_size, seed, reshard_after_forward, **run_kwargs)
                                                 parent: one run_on_ranks call, every rank's columns
    format_three_ways(row)                       one rank's table as text

The model is the course's per-parameter ZeRO-3 (apply_zero(..., 3, sharding="per_param"), FSDP2's
design, policy "block") with AdamW in fp32, one step of batch_size / world_size rows per rank, no
clipping. Each rank returns {"formula", "course", "memtracker"}, each {"params", "grads",
"optimizer", "activations"} in bytes, plus what the differences are made of ("parts") and
MemTracker's peak ("peak", "peak_split"):

    formula      estimate.per_param_memory (the shard bytes) and estimate.activation_bytes (what
                 autograd saves for backward)
    course       parallel.zero.measure_state_bytes: the shards and their gradients after backward,
                 AdamW's m and v after the step; activations: the storages the saved-tensor hooks
                 see during forward (as observe.memory.SavedActivations), leaving out model state:
                 the local shards and the gathered weights a Linear saves for its backward
    memtracker   MemTracker's snapshot by category ("Parameter", "Gradient", "Optstate"; after the
                 step; "Activation" right after forward). MemTracker files a storage by WHEN it
                 was made: during forward "Activation", during backward "Temp", in an optimizer
                 step "Optstate"; parameters and gradients by registration (module parameters,
                 gradient hooks). track_external(model, optimizer, batch) registers what exists
                 before it starts (the batch as "Other").

What differs, and why (each part measured in the same run, "parts"):

    optimizer    MemTracker counts AdamW's "step" counters (one 0-dim fp32 tensor per shard); the
                 course and the formula count per-element state only (m and v)
    activations  course - formula: the 0-dim fp32 total weight the cross-entropy (NLL) saves to
                 divide by ("loss total weight"). memtracker - course: what forward made and
                 still holds that is no saved activation: the gathered weights kept after forward (the root
                 unit's until the end of backward; with reshard_after_forward=False every
                 block's too; per_param_memory's gathered_after_forward) and the loss

Bytes are numel * element size on the CPU (deterministic: no allocator, no timing; Python's cycle
collector is paused during the step, so every free happens where the last reference goes). On a GPU
MemTracker rounds every storage up to 512 bytes (the caching allocator's block), so its column
is larger there. MemTracker is a private torch API: memtracker_missing() says in one sentence when
this torch lacks it, and the functions raise RuntimeError with that sentence.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from course_lib.data import CharDataset, get_batch
from course_lib.estimate import activation_bytes, per_param_memory
from course_lib.estimate.memory import check_mesh_args
from course_lib.model import GPT
from course_lib.parallel.zero import apply_zero, measure_state_bytes
from course_lib.parallel.zero.memory import held_gathered
from course_lib.parallel.zero.training import default_optimizer_kwargs
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainConfig, share_rows, train_step
from course_lib.units import fmt_bytes

ROWS = ("params", "grads", "optimizer", "activations")
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
          "activations": "activations"}
CATEGORY = {"params": "Parameter", "grads": "Gradient", "optimizer": "Optstate", "activations": "Activation"}
API = "torch.distributed._tools.mem_tracker.MemTracker"


def memtracker_missing() -> str | None:
    """None when this torch has MemTracker with the calls used here; else one sentence saying why not."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as err:
        return f"torch {torch.__version__} has no {API} (a private API; import failed: {err})."
    lacking = [m for m in ("track_external", "get_tracker_snapshot") if not hasattr(MemTracker, m)]
    if lacking:
        return f"torch {torch.__version__}'s {API} lacks {', '.join(lacking)} (a private API that changed)."
    return None


def _require():
    why = memtracker_missing()
    if why is not None:
        raise RuntimeError(why)
    from torch.distributed._tools.mem_tracker import MemTracker
    return MemTracker


def _by_category(snapshot: dict, dev: torch.device) -> dict[str, int]:
    """MemTracker's snapshot of one device as {category name: bytes} ("Total" included)."""
    for d, split in snapshot.items():
        if torch.device(d).type == dev.type:
            return {str(getattr(k, "value", k)): int(v) for k, v in split.items()}
    return {}  # nothing tracked on this device (MemTracker drops a device whose total falls to 0)


def unit_shapes(model) -> list[list[tuple]]:
    """Policy "block"'s units as per_param_memory takes them: the root first, then each block."""
    shapes = [[tuple(p.shape) for n, p in model.named_parameters() if not n.startswith("blocks.")]]
    return shapes + [[tuple(p.shape) for p in block.parameters()] for block in model.blocks]


def memtracker_step(config, batch_size: int, seed: int = 0, reshard_after_forward=True) -> dict:
    """Rank code: per-parameter ZeRO-3 of GPT(config, seed) with AdamW, ONE step of this rank's rows
    of a batch_size-sequence batch, measured by the course and by MemTracker in the same step
    (module docstring); reshard_after_forward as apply_zero's. Every rank of the world takes part."""
    MemTracker = _require()
    rank, n, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    plain = GPT(config, seed=seed)
    shapes = unit_shapes(plain)
    model, opt = apply_zero(plain.to(dev), 3, torch.optim.AdamW, sharding="per_param",
                            reshard_after_forward=reshard_after_forward, **default_optimizer_kwargs(TrainConfig()))
    x, y = get_batch(CharDataset("train", block_size=config.block_size), batch_size,
                     torch.Generator().manual_seed(seed))
    rows = share_rows(rank, n, batch_size)
    x, y = x[rows].to(dev).clone(), y[rows].to(dev).clone()  # own storages, as a loader's
    units = model.per_param.units
    local = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t):  # the course's count: every saved storage once, model state left out
        ptr = t.untyped_storage().data_ptr()
        gathered = {g.untyped_storage().data_ptr() for u in units for g in u.padded if g.untyped_storage().nbytes()}
        if ptr not in local and ptr not in gathered:
            saved.setdefault(ptr, t)  # held: its address cannot be reused while forward runs
        return t

    course, snaps, parts = {}, {}, {}

    def loss_fn(m, xb, yb):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, loss = m(xb, yb)
        del logits  # model_loss's convention: the step keeps the loss only
        snaps["forward"] = tracker.get_tracker_snapshot()
        course["activations"] = sum(t.untyped_storage().nbytes() for t in saved.values())
        parts["gathered after forward"] = held_gathered(model.per_param)
        parts["loss"] = loss.untyped_storage().nbytes()
        parts["loss total weight"] = sum(t.untyped_storage().nbytes() for t in saved.values() if t.dim() == 0)
        saved.clear()
        return loss

    def after_backward():
        course["grads"] = measure_state_bytes(model, opt)["grads"]

    tracker = MemTracker()
    tracker.track_external(model, opt.optimizer, x, y)  # made before the step: the batch files as "Other"
    gc.collect()
    gc.disable()  # frees by reference count only: the same moments on every run
    try:
        with tracker:
            train_step(model, opt, x, y, None, hooks=StepHooks(loss_fn=loss_fn, sync_gradients=after_backward))
            snaps["step"] = tracker.get_tracker_snapshot()
    finally:
        gc.enable()
    snaps["peak"] = tracker.get_tracker_snapshot("peak")
    state = measure_state_bytes(model, opt)
    course.update(params=state["params"], optimizer=state["optimizer"])
    parts["step counters"] = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                                 if torch.is_tensor(v) and v.dim() == 0)
    after_step, forward = _by_category(snaps["step"], dev), _by_category(snaps["forward"], dev)
    tracked = {k: after_step[CATEGORY[k]] for k in ("params", "grads", "optimizer")}
    tracked["activations"] = forward[CATEGORY["activations"]]
    est = per_param_memory(shapes, n, reshard_after_forward=reshard_after_forward)
    formula = {k: est[k] for k in ("params", "grads", "optimizer")}
    formula["activations"] = activation_bytes(config, rows.stop - rows.start, config.block_size)["total"]
    parts["gathered after forward (formula)"] = est["gathered_after_forward"]
    peak = _by_category(snaps["peak"], dev)
    return {"rank": rank, "formula": formula, "course": {k: course[k] for k in ROWS}, "memtracker": tracked,
            "parts": parts, "other": after_step.get("Other", 0), "peak": peak.get("Total", 0),
            "peak_split": {k: v for k, v in peak.items() if k != "Total" and v}}


def memory_three_ways(config, world_size: int, batch_size: int, seed: int = 0, reshard_after_forward=True,
                      **run_kwargs) -> list[dict]:
    """Parent: memtracker_step on world_size ranks in ONE run_on_ranks call (run_kwargs: backend,
    timeout_s, ...); per rank its dict, in rank order. RuntimeError when this torch lacks MemTracker."""
    _require()
    share_rows(0, world_size, batch_size)  # ValueErrors before any rank starts
    check_mesh_args(world_size, 1, reshard_after_forward)
    return run_on_ranks(memtracker_step, config, batch_size, seed, reshard_after_forward, world_size=world_size,
                        **run_kwargs)


def format_three_ways(row: dict) -> str:
    """One rank's three columns as text, bytes with IEC units beside them."""
    lines = [f"rank {row['rank']:<3} {'':<16}{'formula':>12}{'course':>12}{'MemTracker':>12}"]
    for k in ROWS:
        a, b, c = (row[col][k] for col in ("formula", "course", "memtracker"))
        lines.append(f"{LABELS[k]:<20} {a:>12,}{b:>12,}{c:>12,}   ({fmt_bytes(c)})")
    return "\n".join(lines)
