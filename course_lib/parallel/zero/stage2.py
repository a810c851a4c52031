"""ZeRO stage 2: gradients are reduce-scattered in buckets *during* backward.

Stage 1 holds every parameter's full gradient until backward ends (Psi elements), then
reduce-scatters. Stage 2 cuts the parameters into buckets (each one flat unit, flat.py, in
backward order: the last parameters first) and, as soon as backward has produced every
gradient of a bucket, flattens it, drops the per-parameter gradients and starts an async
reduce-scatter; backward goes on with earlier layers while the bucket travels:

    backward:  [ grads of bucket 0 ][ grads of bucket 1 ][ grads of bucket 2 ]
    network:                        [ reduce-scatter 0  ][ reduce-scatter 1  ][ rs 2 ]
    rank r keeps:  g_r = shard r of mean(g) for every bucket   (S_b elements per bucket b)

So a rank holds at most one bucket's full gradient (plus buckets in flight) and, after
backward, only its shards: grads cost 4 * sum_b ceil(P_b / N) bytes instead of 4 * Psi.
Buckets launch in index order, the same on every rank (async collectives are matched by issue
order), each when it is full and all before it have launched; at the end of backward (a
callback queued from the first hook) the rest launch, a parameter without a gradient counting
as zeros, and every bucket is waited for. Gradient accumulation: a second backward before
step() adds its shards to the first's.
"""

from __future__ import annotations

import functools
import time

import torch

from course_lib.comm.compat import reduce_scatter_single


class GradientBuckets:
    """Installs the stage-2 hooks on a ShardedOptimizer built for stage 2 (apply_zero does it).

    peak_grad_bytes: the most gradient bytes this rank held at any hook since the last reset
    (per-parameter gradients alive + buckets in flight + shards), read from the tensors: each
    gradient's bytes when its hook fires, kept in a running sum until its bucket launches (a
    scan of every parameter at every hook cost P^2 reads per backward: 4 ms of a 100-tensor
    model's backward per rank here).
    max_in_flight: launching a bucket waits for the oldest ones beyond this many, so at most
    that many flat buckets (and their reduce-scatter outputs) are alive at once.
    """

    def __init__(self, optimizer, timeline=None, max_in_flight: int = 2):
        self.opt, self.timeline, self.max_in_flight = optimizer, timeline, max_in_flight
        self.shards = optimizer.shards
        self.world_size = optimizer.world_size
        self._ready = [0] * len(self.shards)
        self._next, self._active, self._pending = 0, False, {}
        self.peak_grad_bytes = 0
        self._grad_bytes, self._live_grad_bytes = {}, 0  # id(param) -> its gradient's bytes; their sum
        self._hooks = []
        for i, s in enumerate(self.shards):
            s.finish_pending = self.finish
            for p in s.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i)))

    def _grad_ready(self, index: int, param) -> None:
        if not self._active:  # first hook of this backward: finish once autograd is done
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._active = True
        nbytes = param.grad.numel() * param.grad.element_size()
        self._live_grad_bytes += nbytes - self._grad_bytes.get(id(param), 0)
        self._grad_bytes[id(param)] = nbytes
        self._ready[index] += 1
        self._note_memory()
        while self._next < len(self.shards) and self._ready[self._next] == len(self.shards[self._next].params):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        s = self.shards[index]
        flat = s.unit.flatten([p.grad for p in s.params]).div_(self.world_size)  # sum of g/N = mean
        for p in s.params:
            p.grad = None  # this bucket's full gradient is gone from here on
            self._live_grad_bytes -= self._grad_bytes.pop(id(p), 0)
        out = torch.empty(s.unit.shard_numel, dtype=flat.dtype, device=flat.device)
        work = reduce_scatter_single(out, flat, group=self.opt.group, async_op=True)
        self._pending[index] = (work, out, flat, time.perf_counter())
        self._next += 1
        self._note_memory()
        while len(self._pending) > self.max_in_flight:  # bound the flat buckets alive at once
            self._complete(min(self._pending))

    def _complete(self, index: int) -> None:
        work, out, _flat, started = self._pending.pop(index)
        work.wait()
        if self.timeline is not None:
            self.timeline.add(f"rs{index}", started, time.perf_counter(), "comm")
        s = self.shards[index]
        s.grad_shard = out if s.grad_shard is None else s.grad_shard.add_(out)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all, add each result to its grad_shard."""
        if not self._active:
            return
        while self._next < len(self.shards):
            self._launch(self._next)
        while self._pending:
            self._complete(min(self._pending))
        self._ready = [0] * len(self.shards)
        self._next, self._active = 0, False
        self._note_memory()

    def _note_memory(self) -> None:
        live = self._live_grad_bytes
        live += sum(f.numel() * f.element_size() + o.numel() * o.element_size() for _, o, f, _ in self._pending.values())
        live += sum(s.grad_shard.numel() * s.grad_shard.element_size() for s in self.shards if s.grad_shard is not None)
        self.peak_grad_bytes = max(self.peak_grad_bytes, live)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
