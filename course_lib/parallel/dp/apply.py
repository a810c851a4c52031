"""apply_data_parallel(model, group, strategy): data parallelism plugged in like every other axis.

    dp = apply_data_parallel(model, group, "ddp")        # or "naive", "torch", or wrap(model, group)
    train_step(dp.module, optimizer, x, y, clip, hooks=dp.hooks(accum_steps=k))

Whatever the strategy, the result says the same three things: the module to call, the context
that skips the gradient exchange for all but the last micro-batch (None: the strategy exchanges
only when asked), and what to call after the last backward (None: nothing left to do). After it
every rank holds the mean gradient over the group, g = (1/N) sum_r g_r, so the step equals the
single process's on the whole batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from course_lib.loop import StepHooks
from course_lib.parallel.dp.ddp import DDP, naive_all_reduce_gradients
from course_lib.runtime.device import rank_device


@dataclass
class DataParallel:
    module: nn.Module  # what the training step calls: the wrapper, or the model itself
    no_sync: Callable | None  # context manager for the micro-batches before the last, or None
    sync_gradients: Callable | None  # after the last backward, or None

    def hooks(self, **more) -> StepHooks:
        """The step's hooks: no_sync and sync_gradients, plus `more` (accum_steps, a clip, a timeline)."""
        return StepHooks(no_sync=self.no_sync, sync_gradients=self.sync_gradients, **more)


def _course_ddp(model, group, timeline, **ddp_kwargs) -> DataParallel:
    """Bucketed all-reduces launched during backward (ddp.DDP); the last bucket is waited for
    in finish_gradient_synchronization."""
    ddp = DDP(model, group=group, timeline=timeline, **ddp_kwargs)
    return DataParallel(ddp, ddp.no_sync, ddp.finish_gradient_synchronization)


def _naive(model, group, timeline, **ddp_kwargs) -> DataParallel:
    """One all-reduce per parameter, after backward: nothing overlaps."""
    if ddp_kwargs:
        raise ValueError(f"strategy='naive' takes no bucket options, got {sorted(ddp_kwargs)}")
    def sync():
        with timeline.span("all-reduce", "comm") if timeline is not None else contextlib.nullcontext():
            naive_all_reduce_gradients(model, group)
    return DataParallel(model, None, sync)


def _torch_ddp(model, group, timeline, **ddp_kwargs) -> DataParallel:
    """torch.nn.parallel.DistributedDataParallel: reduces during backward, no call after."""
    dev = rank_device()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                              process_group=group, **ddp_kwargs)
    return DataParallel(ddp, ddp.no_sync, None)


STRATEGIES = {"ddp": _course_ddp, "naive": _naive, "torch": _torch_ddp}


def check_strategy(strategy) -> None:
    if not callable(strategy) and strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {tuple(STRATEGIES)} or a callable wrap(model, group)")


def apply_data_parallel(model: nn.Module, group=None, strategy="ddp", timeline=None, **ddp_kwargs) -> DataParallel:
    """Rank code: `model` made data parallel over `group` by `strategy`: "ddp" (the course's
    bucketed DDP), "naive" (one all-reduce per parameter after backward), "torch" (torch's
    DistributedDataParallel), or a callable wrap(model, group) returning a module with
    finish_gradient_synchronization() (exercise 03's contract: it exchanges every micro-batch)."""
    check_strategy(strategy)
    if callable(strategy):
        wrapped = strategy(model, group)
        return DataParallel(wrapped, None, wrapped.finish_gradient_synchronization)
    return STRATEGIES[strategy](model, group, timeline, **ddp_kwargs)
