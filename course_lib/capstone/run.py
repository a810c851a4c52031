"""The capstone's run: a 3D (or MoE) layout, saved, lost, resumed at another world size, and
checked against the single process.

    steps     1 .. checkpoint_step          | checkpoint_step+1 .. steps
    layout    [layout] on its ranks         | [resume] on its own ranks
              saves the full training state | loads it, resharded by global offsets

train_segment is the rank code of one segment; run_capstone the parent. The ranks' return
values reach the parent only when they finish, so for a live curve rank 0 appends each step's
loss to a small file (one JSON line per step) that the parent reads while it waits.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.capstone.config import CapstoneConfig
from course_lib.checkpoint import checkpoint_path, load_training_state, save_training_state
from course_lib.data import CharDataset
from course_lib.observe.memory import SavedActivations
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.hybrid import (HybridResult, build_hybrid, clip_grad_norm_hybrid, make_forward_backward,
                                        make_hybrid_optimizer, merged_params, owned_params, traffic_by_dimension,
                                        train_single, trained_module)
from course_lib.parallel.hybrid.training import mean_over_replicas, replica_rows
from course_lib.parallel.hybrid.zero_pp import measure_stage_bytes
from course_lib.platform import peak_rss_bytes
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.runtime.pool import shutdown_pools
from course_lib.train import StepHooks, train_loop


def _rss_bytes() -> int | None:
    """Peak resident memory of this process so far, in bytes (course_lib.platform.peak_rss_bytes:
    ru_maxrss in its platform's unit; None on Windows). The rank processes are reused between
    calls, so it is the peak over every run of this pool: a raw figure."""
    return peak_rss_bytes()


def train_segment(dims, model_config, train_cfg, checkpoint_dir, first: int, last: int, trace: bool = False,
                  progress: bool = False, timeline_step: int | None = None, loss_log: str | None = None):
    """Rank code: steps first..last (1-based) of the composed model at layout dims (precision and
    recomputation included). first > 1 loads the checkpoint of step first-1 from checkpoint_dir
    (saved at any layout); the state after step `last` is saved there. Returns a HybridResult:
    the global loss of every step 1..last (those before `first` from the checkpoint), the
    seconds of each step run, the traffic of each mesh dimension (trace=True), the Timeline
    events of step `timeline_step`, the memory measured after the first step run, and the
    parameters this rank owns. loss_log: rank 0 appends {"step", "loss"} lines there."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims.check(world, model_config, train_cfg.batch_size)
    dev = rank_device()
    parts = build_hybrid(dims, model_config, seed=train_cfg.seed, device=dev)
    module, optimizer = trained_module(parts), make_hybrid_optimizer(parts, train_cfg)
    dataset = CharDataset("train", block_size=model_config.block_size)
    gen = torch.Generator().manual_seed(train_cfg.seed)  # the data position: saved and restored
    root = pathlib.Path(checkpoint_dir)
    result = HybridResult(coords=dict(parts.coords))
    result.set_step_work(model_config, train_cfg.batch_size, model_config.block_size)
    if first > 1:
        if hasattr(optimizer, "unshard"):  # ZeRO-3: the checkpoint fills whole parameters, then the masters
            optimizer.unshard()
        info = load_training_state(checkpoint_path(root, first - 1), parts, optimizer, "hybrid", gen)
        if hasattr(optimizer, "reshard_from_parameters"):
            optimizer.reshard_from_parameters()
        if info.step != first - 1:
            raise ValueError(f"checkpoint of step {info.step} found where step {first - 1} was expected")
        result.train_losses = list(info.extra["losses"])  # the curve so far, whatever layout ran it
        result.grad_norms = list(info.extra.get("grad_norms", []))  # and its gradient norms (the demo's check)
        result.resumed_from = info.resume_text(dims)
    log = open(loss_log, "a") if loss_log and rank == 0 else None
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=last - first + 1, desc=dims.describe(), leave=True)
    clip = lambda c: clip_grad_norm_hybrid(parts, c)  # noqa: E731
    timeline = Timeline() if timeline_step is not None and first <= timeline_step <= last else None
    timed = StepHooks(forward_backward=make_forward_backward(parts, dims, timeline), clip_grad_norm=clip,
                      timeline=timeline)  # the step whose timeline is recorded
    plain = StepHooks(forward_backward=make_forward_backward(parts, dims), clip_grad_norm=clip)
    saved = {}

    def measuring(step):  # the saved activations of the first step run (an unpipelined model)
        if step != first or parts.stage is not None:
            return contextlib.nullcontext()
        saved["first"] = SavedActivations(parts.model)
        return saved["first"]

    def after_step(step, loss):
        if step == first:  # state after a step (gradients and Adam's moments exist); activations of it
            # params and AdamW's moments after the step; the gradients at their peak, the end
            # of backward, before the ZeRO engine reduces them to its shard: one per parameter
            result.memory = dict(measure_stage_bytes(module, optimizer))  # ZeRO-3: its shards
            result.memory["grads"] = sum(p.numel() * p.element_size() for p in module.parameters())
            result.memory["total"] = result.memory["params"] + result.memory["grads"] + result.memory["optimizer"]
            result.memory["activations"] = (saved["first"].bytes if parts.stage is None
                                             else parts.stage.last_peak_activation_bytes)
        if log is not None:
            log.write(json.dumps({"step": step, "loss": loss}) + "\n")
            log.flush()
        if bar is not None:
            bar.update(1)

    tracer = CommTracer() if trace else None
    with log or contextlib.nullcontext():
        # every rank starts each step together (the barrier): the timelines line up, the seconds compare
        train_loop(module, optimizer, dataset, train_cfg, lambda step: timed if step == timeline_step else plain,
                   rows=replica_rows(parts, dims, train_cfg.batch_size), generator=gen, device=dev, first=first,
                   last=last, result=result, tracer=tracer, step_context=measuring,
                   before_step=lambda step: dist.barrier(), report_loss=mean_over_replicas(parts, dims),
                   on_step=after_step, record_grad_norms=True)
    if bar is not None:
        bar.close()
    if timeline is not None:
        result.timeline_events = list(timeline.events)
    result.memory["peak_rss"] = _rss_bytes()
    if trace:
        result.traffic = traffic_by_dimension(tracer.records, dims, world)
    save_training_state(checkpoint_path(root, last), last, parts, optimizer, "hybrid", gen,
                        extra={"losses": list(result.train_losses), "grad_norms": list(result.grad_norms)}, dims=dims)
    if hasattr(optimizer, "unshard"):  # ZeRO-3: the parameters whole again, to be read
        optimizer.unshard()
    result.named_params = owned_params(parts)
    return result


@dataclass
class CapstoneRun:
    """What run_capstone measured: every rank's result of each segment (rank 0's first), the
    single process's losses, and the largest |difference| between the two curves."""

    config: CapstoneConfig
    first_ranks: list  # HybridResult per rank, steps 1..checkpoint_step
    resumed_ranks: list  # HybridResult per rank: losses of steps 1..steps, seconds of the steps after the save
    single_losses: list
    max_difference: float
    params: dict  # {single-process name: full tensor} after the last step, from every rank

    @property
    def first(self):
        return self.first_ranks[0]

    @property
    def resumed(self):
        return self.resumed_ranks[0]

    @property
    def traffic(self) -> list:
        """Per rank of the first segment: {dim: {calls, bytes_sent, bytes_recv}}."""
        return [r.traffic for r in self.first_ranks]

    @property
    def timelines(self) -> list:
        """Per rank of the first segment: the Timeline events of its last step."""
        return [r.timeline_events or [] for r in self.first_ranks]

    @property
    def losses(self) -> list[float]:
        """The whole curve, steps 1..steps (the resumed run carries the first segment's losses)."""
        return self.resumed.train_losses

    @property
    def equal(self) -> bool:
        return self.max_difference <= self.config.tolerance


# the capstone's ranks check every collective (course_lib.observe.checks) before it runs: a
# learner's edited config fails with a named mismatch, not wrong numbers; the report's step-time
# prediction prices the checks (step_time's checked_collectives)
CHECKED_COLLECTIVES = True


def _ranks_streaming(on_loss, segment: str, log: pathlib.Path, fn, *args, world_size: int, timeout_s: float, **kw):
    """run_on_ranks(fn, ..., loss_log=log) in a thread; meanwhile on_loss(segment, step, loss)
    for each line rank 0 appends to `log`. Returns the ranks' results."""
    from concurrent.futures import ThreadPoolExecutor

    log.unlink(missing_ok=True)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_on_ranks, fn, *args, world_size=world_size, timeout_s=timeout_s, loss_log=str(log),
                             check_collectives=CHECKED_COLLECTIVES, **kw)
        seen = 0
        try:
            while True:
                done = future.done()  # read once more after the ranks finished: no line is missed
                lines = log.read_text().splitlines() if log.exists() else []
                for line in lines[seen:]:
                    if line.endswith("}"):  # a complete line (rank 0 may be writing the next one)
                        entry = json.loads(line)
                        on_loss(segment, entry["step"], entry["loss"])
                        seen += 1
                if done:
                    return future.result()
                time.sleep(0.1)
        except KeyboardInterrupt:  # the kernel's stop button: stop the ranks too, not only this loop
            shutdown_pools()
            raise


def run_capstone(config: CapstoneConfig, checkpoint_dir, timeout_s: float = 300, progress: bool = False,
                 on_loss=None) -> CapstoneRun:
    """Parent side: both segments on their own ranks, then the single process on the same
    batches, with the same precision and recomputation. progress: a bar over the 2 * steps
    steps. on_loss(segment, step, loss), segment "first" | "resumed" | "single": called as
    each step's loss arrives (e.g. a LiveLossPlot's update)."""
    from tqdm.auto import tqdm

    import tempfile

    c, root = config, pathlib.Path(checkpoint_dir)
    logs = pathlib.Path(tempfile.mkdtemp(prefix="capstone-losses-"))  # not in checkpoint_dir: only checkpoints there
    bar = tqdm(total=2 * c.train.steps, desc="capstone", unit="step", disable=not progress)

    def report(segment, step, loss):
        bar.update(1)
        bar.set_postfix_str(f"{segment} step {step} loss {loss:.4f}")
        if on_loss is not None:
            on_loss(segment, step, loss)

    first = _ranks_streaming(report, "first", logs / "first.jsonl", train_segment, c.layout, c.model, c.train,
                             str(root), 1, c.checkpoint_step, trace=True, timeline_step=c.checkpoint_step,
                             world_size=c.layout.world_size, timeout_s=timeout_s)
    resumed = _ranks_streaming(report, "resumed", logs / "resumed.jsonl", train_segment, c.resume, c.model,
                               c.train, str(root), c.checkpoint_step + 1, c.train.steps,
                               world_size=c.resume.world_size, timeout_s=timeout_s)
    single = train_single(c.model, c.train, c.precision, c.recompute,
                          on_step=lambda step, loss: report("single", step, loss)).train_losses
    bar.close()
    losses = resumed[0].train_losses
    diff = max(abs(a - b) for a, b in zip(losses, single))
    return CapstoneRun(c, first, resumed, single, diff, merged_params(resumed))
