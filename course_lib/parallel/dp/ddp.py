"""Data parallelism from scratch: every rank holds a whole replica of the model, computes
the gradient of its own 1/N of the batch, and the ranks average those gradients:

    rank r:   g_r = grad of L(theta; shard_r)        shard_r = B/N examples of the global batch
    all:      g   = (1/N) * sum_r g_r                  one all-reduce (SUM of g_r / N)
              theta <- AdamW(theta, clip(g))           same g everywhere -> replicas stay equal

The loss is a mean over examples, so with equal shards g is exactly the gradient of the
global batch: N-rank data parallel IS single-process training on the concatenated batch,
up to float rounding. Gradient clipping after the average sees the global norm ||g||, so it
clips exactly as the reference does.

Two ways to average, same numbers, different cost:
  naive_all_reduce_gradients(model)  after backward, one blocking all-reduce per parameter:
                                     P calls (each pays a latency alpha) and the network is
                                     idle during backward, the CPU/GPU idle during comm.
  DDP(model, bucket_cap_mb)          torch DistributedDataParallel's design:
    * buckets: parameters in reverse registration order (roughly the order backward
      produces their gradients) packed into flat buffers, each closed once it holds
      bucket_cap_mb (torch's rule); one call per bucket, so with the alpha-beta model
      (T = alpha + S / beta per call) time ~ n_buckets * alpha + S / beta instead of
      P * alpha + S / beta;
    * a small first bucket (first_bucket_cap_mb, 1 MiB as in torch DDP): the gradients
      backward produces first leave at once. Without it, a model whose gradients fit in
      one 25 MB bucket could not start communicating before backward ends (no overlap);
    * overlap: a hook per parameter fires when its gradient is accumulated; when a bucket
      is full its all-reduce starts asynchronously while backward continues on earlier
      layers. Buckets always start in index order (the same order on every rank: async
      collectives are matched by issue order);
    * finish: at the end of backward (queued automatically from the first hook) any bucket
      not yet started is started -- a parameter with no gradient on this rank counts as
      zeros -- then every bucket is waited for and copied back into p.grad. So every
      bucketed parameter gets a gradient; one unused on EVERY rank gets zeros (torch DDP
      leaves it None, so AdamW skips it; with zeros AdamW still applies weight decay and
      momentum to it). `finish_gradient_synchronization()` is idempotent; call it yourself
      only if some rank's loss may not depend on any parameter (no hook fires there).
    * no_sync(): backward inside it only accumulates local gradients (micro-batches).

Bytes: each rank's gradient is S = 4 * P bytes (fp32). CommTracer counts S per rank for
either version (logical payload); a ring all-reduce puts 2 (N-1)/N * S bytes per rank on
the wire. Frozen parameters (requires_grad=False) are not communicated; a tied weight is
one Parameter, so it is reduced once.
(Over 300 lines: the naive and the bucketed, overlapped versions side by side, as notebook 03
reads them.)
"""

from __future__ import annotations

import contextlib
import time
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.clock import now
from course_lib.comm.compat import all_gather_single

MB = 2**20
# torch DDP caps its first bucket at 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
FIRST_BUCKET_MB = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", MB) / MB


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number")


# ---------------------------------------------------------------------------- replicas
def check_replicas(model: nn.Module, group=None, check_values: bool = True) -> None:
    """Raise ValueError unless every rank of `group` holds parameters with the same names and
    shapes (and, with check_values, bit-identical values). Collective: all ranks must call it.

    Cost: one all-gather of 2 numbers (+ one of 2 per parameter for values): a CRC of the
    "name:shape" list, and per parameter sum(p) and sum(p * (1..n)) in float64.
    """
    named = list(model.named_parameters())
    dev = named[0][1].device if named else torch.device("cpu")
    layout = [f"{name}:{tuple(p.shape)}" for name, p in named]
    n = dist.get_world_size(group)

    def gather(vec: torch.Tensor) -> torch.Tensor:
        out = torch.empty(n * vec.numel(), dtype=vec.dtype, device=dev)
        all_gather_single(out, vec.to(dev), group=group)
        return out.view(n, -1).cpu()

    rows = gather(torch.tensor([len(named), zlib.crc32(";".join(layout).encode())], dtype=torch.int64))
    if not (rows == rows[0]).all():
        layouts = [None] * n
        dist.all_gather_object(layouts, layout, group=group)  # error path only: name the culprit
        for r in range(1, n):
            diff = [(a, b) for a, b in zip(layouts[0], layouts[r]) if a != b]
            if diff or len(layouts[r]) != len(layouts[0]):
                what = (f"rank 0 has {diff[0][0]}, rank {r} has {diff[0][1]}" if diff else
                        f"rank 0 has {len(layouts[0])} parameters, rank {r} has {len(layouts[r])}")
                raise ValueError(f"model replicas differ in parameter shapes: {what}; every rank must "
                                 f"build the same model before data-parallel training")
    if check_values and named:
        sums = [torch.stack([p.detach().double().sum(),
                             (p.detach().double().flatten() * torch.arange(1, p.numel() + 1, device=p.device)).sum()])
                for _, p in named]
        rows = gather(torch.cat(sums))
        bad = (rows != rows[0]).view(n, len(named), 2).any(dim=2).any(dim=0)
        if bad.any():
            name = named[int(bad.nonzero()[0])][0]
            raise ValueError(f"model replicas differ in parameter values (first: {name!r}); build every "
                             f"replica from the same seed, or broadcast rank 0's parameters (DDP does)")


def broadcast_parameters(module: nn.Module, group=None) -> None:
    """Copy the first rank's parameters and buffers to every rank (one flat broadcast)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    tensors = list(module.parameters()) + list(module.buffers())
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):  # one message per dtype
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


# ---------------------------------------------------------------------------- naive
_verified = weakref.WeakSet()


def naive_all_reduce_gradients(model: nn.Module, group=None) -> None:
    """After backward: p.grad <- mean over ranks of p.grad, one all-reduce per parameter.

    The first call for a model checks that all replicas are equal (check_replicas), since
    averaging gradients only keeps replicas equal if they start equal. A parameter without
    a gradient on this rank joins with zeros (every rank must make the same calls).
    """
    if model not in _verified:
        check_replicas(model, group)
        _verified.add(model)
    n = dist.get_world_size(group)
    for p in model.parameters():  # parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(n)  # sum of g_r / N = mean (exact when N is a power of two)
        dist.all_reduce(p.grad, group=group)


# ---------------------------------------------------------------------------- DDP
def assign_buckets(sizes_bytes: list[int], bucket_cap_bytes: float,
                   first_bucket_cap_bytes: float | None = None) -> list[list[int]]:
    """Group parameter indices into buckets, walking from the LAST parameter to the first
    (backward produces gradients roughly in that order). A bucket is closed as soon as it
    holds at least its cap (so it overshoots by at most its last parameter), the rule torch
    DDP's reducer uses. The first bucket's cap may be smaller (first_bucket_cap_bytes): the
    first gradients of backward then leave early instead of waiting for a big bucket to fill.

        sizes [4, 4, 4, 4], cap 8            ->  [[3, 2], [1, 0]]
        sizes [4, 100, 4, 4], cap 10         ->  [[3, 2, 1], [0]]
        sizes [4, 4, 4, 4], cap 8, first 4   ->  [[3], [2, 1], [0]]
    """
    _check_positive("bucket_cap_bytes", bucket_cap_bytes)
    if first_bucket_cap_bytes is not None:
        _check_positive("first_bucket_cap_bytes", first_bucket_cap_bytes)
    buckets, current, size = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        size += sizes_bytes[i]
        cap = first_bucket_cap_bytes if not buckets and first_bucket_cap_bytes is not None else bucket_cap_bytes
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


class AllReduceHandle:
    """An async all-reduce in flight. wait() returns the reduced tensor; done_at is when this
    rank first saw it finished (poll() during backward, or wait()). Polled, not a callback on the
    work's future: gloo runs such callbacks on its thread under the GIL, and at interpreter exit
    Python 3.11 ends that thread inside C++ (SIGABRT or a hang; CONTRIBUTING.md).
    On a GPU, NCCL's work.wait() returns once the compute stream is told to wait, not when the
    transfer is done, so wait() stamps done_at on the device-aware clock (course_lib.clock) of
    `device` (default: the tensor's); is_completed() already asks the device, so poll() does not
    wait (a wait there would stall backward until every bucket in flight had arrived)."""

    def __init__(self, work, tensor, device=None):
        self.work, self.tensor, self.done_at = work, tensor, None
        self.device = tensor.device if device is None else device

    def poll(self) -> None:
        """Stamp done_at if the backend has finished (cheap: a flag read under a lock)."""
        if self.done_at is None and self.work.is_completed():
            self.done_at = time.perf_counter()

    def wait(self) -> torch.Tensor:
        self.poll()
        self.work.wait()
        if self.done_at is None:
            self.done_at = now(self.device)
        return self.tensor


def all_reduce_hook(bucket_index: int, flat: torch.Tensor, group=None) -> AllReduceHandle:
    """The default communication hook: sum `flat` (already divided by N) over the ranks."""
    return AllReduceHandle(dist.all_reduce(flat, group=group, async_op=True), flat)


class Bucket:
    """Parameters whose gradients travel together in one flat tensor."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index, self.params = index, params
        self.ready = 0  # gradients accumulated so far in this step
        self.handle = None  # the communication in flight
        self.started = 0.0  # when it was launched (for the timeline)


class DDP(nn.Module):
    """Bucketed, overlapped data parallelism (see the module docstring for the design).

    comm_hook(bucket_index, flat, group) -> handle with .wait() -> averaged flat tensor;
    `flat` arrives already divided by N. course_lib.parallel.dp.compression has hooks that
    send fewer bytes. timeline: a course_lib.observe.timeline.Timeline; each bucket becomes a
    "comm" event from launch to completion and each finish a "finish" event (launching the
    buckets not yet launched, then waiting). On a GPU the completions and the finish's end are
    read on the device-aware clock of the parameters' device (course_lib.clock); the launches
    and the finish's start are the host's moments, with no wait, since a wait there would hold
    backward until the buckets in flight arrive: the overlap the timeline is drawn to show.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, overlap: bool = True, group=None,
                 comm_hook=None, timeline=None, first_bucket_cap_mb: float | None = FIRST_BUCKET_MB):
        super().__init__()
        _check_positive("bucket_cap_mb", bucket_cap_mb)
        if first_bucket_cap_mb is not None:
            _check_positive("first_bucket_cap_mb", first_bucket_cap_mb)
        if not dist.is_initialized():
            raise RuntimeError("DDP needs an initialised process group: run inside run_on_ranks or torchrun")
        self.module, self.group, self.overlap = module, group, overlap
        self.comm_hook, self.timeline = comm_hook or all_reduce_hook, timeline
        self.world_size = dist.get_world_size(group)
        check_replicas(module, group, check_values=False)  # shapes must match...
        broadcast_parameters(module, group)  # ...values: rank 0's copy wins
        params = [p for p in module.parameters() if p.requires_grad]  # frozen: skipped; tied: once
        first_cap = None if first_bucket_cap_mb is None else min(first_bucket_cap_mb, bucket_cap_mb) * MB
        layout = assign_buckets([p.numel() * p.element_size() for p in params], bucket_cap_mb * MB, first_cap)
        self.buckets = [Bucket(b, [params[i] for i in idx]) for b, idx in enumerate(layout)]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._sync = True  # False inside no_sync()
        self._expect = False  # a forward with grad enabled outside no_sync: a sync is due
        self._next = 0  # index of the next bucket to launch
        self._queued = False  # finish already queued to run at the end of this backward
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    @property
    def clock_device(self) -> torch.device:
        """Where the gradients live: the device the timeline's clock waits for."""
        return self.buckets[0].params[0].device if self.buckets else torch.device("cpu")

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._expect = self._sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients; the first backward after
        it synchronises the accumulated sum (gradient accumulation over micro-batches)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._expect:
            return
        if not self._queued:  # run finish once autograd has finished this whole backward
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
            self._queued = True
        self._bucket_of[p].ready += 1
        if self.overlap:  # launch every full bucket whose predecessors have all been launched
            while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
                self._launch(self.buckets[self._next])
        if self.timeline is not None:  # note which launched buckets have finished, for the timeline
            self._poll_launched()

    def _poll_launched(self) -> None:
        for b in self.buckets[:self._next]:
            poll = getattr(b.handle, "poll", None)  # a custom comm_hook's handle may have none
            if poll is not None:
                poll()

    def _launch(self, bucket: Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)  # sum of g_r/N = mean
        bucket.started = time.perf_counter()
        bucket.handle = self.comm_hook(bucket.index, flat, self.group)
        self._next += 1

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets not launched yet, wait for all of them, write p.grad = mean."""
        if not self._expect:
            return  # nothing due: inside no_sync, or already finished
        t0 = time.perf_counter()
        if self.timeline is not None:
            self._poll_launched()
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for b in self.buckets:
            flat = b.handle.wait()
            done = getattr(b.handle, "done_at", None) or now(self.clock_device)
            if self.timeline is not None:
                self.timeline.add(f"b{b.index}", b.started, max(done, b.started), "comm")
            offset = 0
            for p in b.params:
                g = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            b.handle, b.ready = None, 0
        if self.timeline is not None:
            self.timeline.add("finish", t0, now(self.clock_device), "idle")
        self._next, self._queued, self._expect = 0, False, False
