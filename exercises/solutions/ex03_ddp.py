"""Reference solution for exercise 03 (kept apart from the learner's stubs)."""

import torch
import torch.distributed as dist
import torch.nn as nn


def build_buckets(sizes_bytes: list[int], bucket_cap_bytes: int) -> list[list[int]]:
    """Indices of the parameters in each bucket, walking from the last parameter to the first."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        size += sizes_bytes[i]
        if size >= bucket_cap_bytes:  # full: close it (it may overshoot by this parameter)
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class SimpleDDP(nn.Module):
    """Bucketed data parallelism whose all-reduces start during backward."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=src, group=group)
        params = [p for p in module.parameters() if p.requires_grad]
        layout = build_buckets([p.numel() * p.element_size() for p in params], bucket_cap_mb * 2**20)
        self.buckets = [[params[i] for i in idx] for idx in layout]
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.pending = {}  # bucket index -> (work, flat)
        self.next = 0  # buckets are launched in index order, the same order on every rank
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param):
        self.ready[self.bucket_of[param]] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):
            self._launch(self.next)

    def _launch(self, b):
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]]).div_(self.world_size)
        self.pending[b] = (dist.all_reduce(flat, group=self.group, async_op=True), flat)
        self.next = b + 1

    def finish_gradient_synchronization(self):
        while self.next < len(self.buckets):
            self._launch(self.next)
        for b, (work, flat) in sorted(self.pending.items()):
            work.wait()
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        self.next = 0
