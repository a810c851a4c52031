"""Reference solution for exercise 03 (kept apart from the learner's stubs)."""

import torch
import torch.distributed as dist
import torch.nn as nn


def build_buckets(order: list[int], sizes_bytes: list[int], bucket_cap_bytes: float) -> list[list[int]]:
    """Parameter indices in buckets, walking `order` (the order the gradients are expected)."""
    if sorted(order) != list(range(len(sizes_bytes))):
        raise ValueError(f"order {order} must name each of the {len(sizes_bytes)} parameters exactly once")
    buckets, current, size = [], [], 0
    for i in order:
        current.append(i)
        size += sizes_bytes[i]
        if size >= bucket_cap_bytes:  # full: close it (it may overshoot by this parameter)
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class SimpleDDP(nn.Module):
    """Bucketed data parallelism whose all-reduces start during backward; after the first step
    the buckets follow the order the gradients really arrived in (rank 0's, on every rank)."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=self.src, group=group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.index = {p: i for i, p in enumerate(self.params)}
        self.sizes = [p.numel() * p.element_size() for p in self.params]
        self.cap = bucket_cap_mb * 2**20
        self._set_buckets(list(reversed(range(len(self.params)))))  # a guess: backward runs roughly in reverse
        self.arrived = []  # indices in the order this rank's first backward produced them; None once rebuilt
        self.pending = []  # (bucket index, work, flat) in flight
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _set_buckets(self, order):
        layout = build_buckets(order, self.sizes, self.cap)
        self.buckets = [[self.params[i] for i in idx] for idx in layout]
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.next = 0  # buckets are launched in index order, the same order on every rank

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param):
        if self.arrived is not None:
            self.arrived.append(self.index[param])
        self.ready[self.bucket_of[param]] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):
            self._launch(self.next)

    def _launch(self, b):
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]]).div_(self.world_size)
        self.pending.append((b, dist.all_reduce(flat, group=self.group, async_op=True), flat))
        self.next = b + 1

    def finish_gradient_synchronization(self):
        while self.next < len(self.buckets):
            self._launch(self.next)
        for b, work, flat in self.pending:
            work.wait()
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        self.next = 0
        if self.arrived is not None:  # after the first step: rank 0's observed order, on every rank
            order = torch.tensor(self.arrived, dtype=torch.int64)
            dist.broadcast(order, src=self.src, group=self.group)
            self.arrived = None
            self._set_buckets(order.tolist())
