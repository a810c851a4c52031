"""One ZeRO-3 step's memory per rank, side by side: notebook 01's formula, the course's own
measurement, PyTorch's MemTracker on the course's model, and FSDPMemTracker on torch's own FSDP2
(torch.distributed._tools.mem_tracker and .fsdp2_mem_tracker, private modules; notebook 08).

    memtracker_missing()                          None, or one sentence: why this torch cannot run it
    memtracker_step(config, batch_size, seed, reshard_after_forward)   rank code: the course's step
    fsdp2_step(config, batch_size, seed, reshard_after_forward)        rank code: FSDP2's step
    memory_three_ways(config, world_size, batch_size, seed, reshard_after_forward, **run_kwargs)
                                                  parent: both, one run_on_ranks call, every rank
    format_three_ways(row)                        one rank's table as text
    unit_shapes(model)                            policy "block"'s units, as per_param_memory takes them

The step: GPT(config, seed) under per-parameter stage 3 (the course's apply_zero(..., 3,
sharding="per_param"), policy "block"; FSDP2: fully_shard on every block, then the root), AdamW in
fp32, one step of batch_size / world_size rows per rank, no clipping. Per rank, each column is
{"params", "grads", "optimizer", "activations"} in bytes:

    formula      estimate.per_param_memory (shards of ceil(d0/S) rows, padding included) and
                 estimate.activation_bytes (what autograd saves for backward)
    course       parallel.zero.measure_state_bytes: the shards and their gradients after backward,
                 AdamW's m and v after the step; activations: the storages the saved-tensor hooks
                 see during forward (as observe.memory.SavedActivations), model state left out
                 (the local shards and the gathered weights a Linear saves for its backward)
    memtracker   MemTracker's categories: "Parameter", "Gradient", "Optstate" after the step,
                 "Activation" right after forward. It files a storage by WHEN it was made (forward
                 "Activation", backward "Temp", an optimizer step "Optstate"), parameters and
                 gradients by registration; track_external(model, optimizer, batch) registers
                 what exists before it starts (the batch as "Other")
    fsdp2        FSDPMemTracker's: "Sharded Param", "Sharded Grad", "OptState", "Activation", and
                 the gathered weights as their own "Unsharded Param"; "local": the bytes of
                 p.to_local() (FSDP2's unpadded rows)

What differs, and why (each part measured in the same run, row["parts"]):

    optimizer    both trackers count AdamW's "step" counters (a 0-dim fp32 tensor per parameter);
                 the course and the formula count per-element state only (m and v). FSDP2's m and
                 v follow its unpadded parameters: 2 x local bytes
    activations  course - formula: the 0-dim fp32 total weight the cross-entropy (NLL) saves to
                 divide by ("loss total weight"). memtracker - course: what forward made and still
                 holds that is no saved activation: the gathered weights kept after forward (the
                 root unit's until the end of backward, with reshard_after_forward=False every
                 block's too: per_param_memory's gathered_after_forward) and the loss. fsdp2 -
                 course: the loss only (its gathered weights are "Unsharded Param")
    params       FSDPMemTracker counts storages, and FSDP2's parameter is a view of c padded rows
                 (torch's FSDPParam allocates ceil(d0/S) rows and narrows them), so it reports the
                 formula's padded bytes on every rank, also where p.to_local() is shorter

Bytes are numel * element size on the CPU (deterministic: no allocator, no timing; Python's cycle
collector is paused during the step, so every free happens where the last reference goes). On a
GPU both trackers round every storage up to 512 bytes (the caching allocator's block). The
trackers are private torch APIs: memtracker_missing() says in one sentence when this torch lacks
them, and the functions raise RuntimeError with that sentence.
"""

from __future__ import annotations

import gc
import importlib
import warnings

import torch
import torch.distributed as dist

from course_lib.data import CharDataset, get_batch
from course_lib.estimate import activation_bytes, per_param_memory
from course_lib.estimate.memory import check_mesh_args
from course_lib.model import GPT
from course_lib.parallel.zero import apply_zero, measure_state_bytes
from course_lib.parallel.zero.memory import held_gathered
from course_lib.parallel.zero.native import fsdp2_model
from course_lib.parallel.zero.training import default_optimizer_kwargs
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.train import StepHooks, TrainConfig, share_rows, train_step

ROWS = ("params", "grads", "optimizer", "activations")  # the table's rows, every column
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
          "activations": "activations"}
CATEGORY = {"params": "Parameter", "grads": "Gradient", "optimizer": "Optstate", "activations": "Activation"}
FSDP2_ROWS = {"params": "Sharded Param", "grads": "Sharded Grad", "optimizer": "OptState",
              "activations": "Activation", "gathered after forward": "Unsharded Param", "inputs": "Inputs"}
APIS = (("mem_tracker", "MemTracker", ("track_external", "get_tracker_snapshot")),
        ("fsdp2_mem_tracker", "FSDPMemTracker", ("track_inputs", "get_tracker_snapshot")))


def memtracker_missing() -> str | None:
    """None when this torch has MemTracker and FSDPMemTracker with the calls used here; else one
    sentence saying why not."""
    for module, name, calls in APIS:
        where = f"torch.distributed._tools.{module}.{name}"
        try:
            cls = getattr(importlib.import_module(f"torch.distributed._tools.{module}"), name)
        except (ImportError, AttributeError) as err:
            return f"torch {torch.__version__} has no {where} (a private API; {type(err).__name__}: {err})."
        lacking = [m for m in calls if not hasattr(cls, m)]
        if lacking:
            return f"torch {torch.__version__}'s {where} lacks {', '.join(lacking)} (a private API that changed)."
    return None


def _require():
    why = memtracker_missing()
    if why is not None:
        raise RuntimeError(why)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    return MemTracker, FSDPMemTracker


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


def _rank_batch(config, batch_size, seed, rank, n, dev):
    x, y = get_batch(CharDataset("train", block_size=config.block_size), batch_size,
                     torch.Generator().manual_seed(seed))
    rows = share_rows(rank, n, batch_size)
    return x[rows].to(dev).clone(), y[rows].to(dev).clone(), rows  # own storages, as a loader's


def _tracked_step(tracker, model, opt, x, y, hooks) -> dict:
    """One train_step inside `tracker`, Python's cycle collector paused: frees by reference count only,
    the same moments on every run. Returns the snapshot after the step."""
    gc.collect()
    gc.disable()
    try:
        with tracker:
            train_step(model, opt, x, y, None, hooks=hooks)
            return tracker.get_tracker_snapshot()
    finally:
        gc.enable()


def memtracker_step(config, batch_size: int, seed: int = 0, reshard_after_forward=True) -> dict:
    """Rank code: per-parameter ZeRO-3 of GPT(config, seed) with AdamW, ONE step of this rank's rows
    of a batch_size-sequence batch, measured by the course and by MemTracker in the same step
    (module docstring); reshard_after_forward as apply_zero's. Every rank of the world takes part."""
    MemTracker, _ = _require()
    rank, n, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    plain = GPT(config, seed=seed)
    shapes = unit_shapes(plain)
    model, opt = apply_zero(plain.to(dev), 3, torch.optim.AdamW, sharding="per_param",
                            reshard_after_forward=reshard_after_forward, **default_optimizer_kwargs(TrainConfig()))
    x, y, rows = _rank_batch(config, batch_size, seed, rank, n, dev)
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
    snaps["step"] = _tracked_step(tracker, model, opt, x, y, StepHooks(loss_fn=loss_fn, sync_gradients=after_backward))
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


def fsdp2_step(config, batch_size: int, seed: int = 0, reshard_after_forward=True) -> dict:
    """Rank code: the same step with torch's own FSDP2 (parallel.zero.native.fsdp2_model: fully_shard on
    every block, then the root) under FSDPMemTracker. Returns its bytes by category (FSDP2_ROWS: the
    sharded parameters and gradients, AdamW's state after the step; "Activation", "Unsharded Param"
    and "Inputs" right after forward) and "local": the bytes of the parameters' local tensors
    (p.to_local(), unpadded rows)."""
    _, FSDPMemTracker = _require()
    rank, n, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    model = fsdp2_model(GPT(config, seed=seed).to(dev), reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), **default_optimizer_kwargs(TrainConfig()))
    x, y, _ = _rank_batch(config, batch_size, seed, rank, n, dev)
    snaps = {}

    def loss_fn(m, xb, yb):
        loss = m(xb, yb)[1]  # the logits are dropped, as model_loss does
        snaps["forward"] = tracker.get_tracker_snapshot()
        return loss

    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((x, y))
    with warnings.catch_warnings():  # the two FSDP2 warnings train_native silences, for the same reasons
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        snaps["step"] = _tracked_step(tracker, model, opt, x, y, StepHooks(loss_fn=loss_fn))
    forward, after_step = _by_category(snaps["forward"], dev), _by_category(snaps["step"], dev)
    out = {k: after_step.get(c, 0) for k, c in FSDP2_ROWS.items() if k in ("params", "grads", "optimizer")}
    out.update({k: forward.get(c, 0) for k, c in FSDP2_ROWS.items() if k not in out})
    out["local"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return out


def _both(config, batch_size, seed, reshard_after_forward):
    row = memtracker_step(config, batch_size, seed, reshard_after_forward)
    row["fsdp2"] = fsdp2_step(config, batch_size, seed, reshard_after_forward)
    return row


def memory_three_ways(config, world_size: int, batch_size: int, seed: int = 0, reshard_after_forward=True,
                      **run_kwargs) -> list[dict]:
    """Parent: memtracker_step, then fsdp2_step (its dict under "fsdp2"), on world_size ranks in ONE
    run_on_ranks call (run_kwargs: backend, timeout_s, ...); per rank, in rank order. RuntimeError
    when this torch lacks MemTracker or FSDPMemTracker."""
    _require()
    share_rows(0, world_size, batch_size)  # ValueErrors before any rank starts
    check_mesh_args(world_size, 1, reshard_after_forward)
    return run_on_ranks(_both, config, batch_size, seed, reshard_after_forward, world_size=world_size, **run_kwargs)


def format_three_ways(row: dict) -> str:
    """One rank's table as text: the three columns, then FSDPMemTracker's on torch's FSDP2, in bytes;
    a last row for the gathered weights held after forward (MemTracker files them as Activation)."""
    lines = [f"rank {row['rank']:<3}{'':<20}{'formula':>11}{'course':>11}{'MemTracker':>14}"
             f"{'FSDPMemTracker (FSDP2)':>24}"]
    for k in ROWS:
        a, b, c = (row[col][k] for col in ("formula", "course", "memtracker"))
        lines.append(f"{LABELS[k]:<24}{a:>11,}{b:>11,}{c:>14,}{row['fsdp2'][k]:>24,}")
    parts = row["parts"]
    lines.append(f"{'gathered after forward':<24}{parts['gathered after forward (formula)']:>11,}"
                 f"{parts['gathered after forward']:>11,}{'(Activation)':>14}"
                 f"{row['fsdp2']['gathered after forward']:>24,}")
    return "\n".join(lines)
