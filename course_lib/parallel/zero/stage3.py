"""ZeRO stage 3 / FSDP: the parameters are sharded too, and gathered one unit at a time.

The model is cut into units: every block of `model.blocks`, plus the root (everything else:
embeddings, final norm, head). Each unit's parameters form one flat unit (flat.py); a rank
keeps only its shard, an fp32 nn.Parameter of S_u = ceil(P_u / N) elements registered on the
unit's module, so `model.parameters()` are this rank's shards (as with FSDP2) and any
element-wise optimizer built on them trains the model. Around each block (hooks):

    forward pre-hook    wait for / start the all-gather of the block's full flat buffer
                        (cast to compute_dtype first), make the block's weights views of it,
                        start gathering the NEXT block (prefetch: it overlaps this block's compute)
    forward post-hook   free the buffer (storage resized to 0; the views autograd saved stay,
                        pointing at an empty storage)
    backward pre-hook   re-allocate and all-gather it again before the block's backward,
                        prefetch the block before it
    gather's backward   autograd sums the weights' gradients into one flat gradient g; rank r
                        keeps reduce_scatter(g / N)[r] as its shard's .grad and frees the buffer

The root is gathered before the model's forward and kept until its gradient is reduced at the
very end of backward (FSDP2 does not reshard its root after forward either). Per step a rank
sends 2 all-gathers and 1 reduce-scatter of every unit: 3 (N-1)/N * Psi elements on a ring,
1.5 times DDP's all-reduce (Rajbhandari et al. 2020, section 7). Persistent memory per rank:
the shards; transient: the root, at most two gathered blocks (current + prefetched) and one
flat gradient.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.parallel.zero.flat import FlatUnit
from course_lib.parallel.zero.fp8_gather import FP8Gather
from course_lib.parallel.zero.offload import to_device, to_host

SHARD_NAME = "flat_shard"  # the parameter every unit module gets


class _Gathered(torch.autograd.Function):
    """shard -> the unit's gathered flat buffer; backward: reduce-scatter the flat gradient."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        return unit.buffer  # filled by the all-gather; adopting it as output links it to the shard

    @staticmethod
    def backward(ctx, grad_flat):
        return ctx.unit.reduce_gradient(grad_flat), None


class FullyShardedUnit:
    """One unit: its layout, its shard parameter, and the gather/free/reduce of its buffer."""

    def __init__(self, name, module, params, locations, manager):
        self.name, self.module, self.manager = name, module, manager
        self.group, self.offload = manager.group, manager.offload
        self.unit = FlatUnit(params, manager.world_size, manager.rank)
        self.locations = locations  # per parameter: [(module, attribute)] where it is used
        self.compute_dtype = manager.compute_dtype
        with torch.no_grad():
            flat = self.unit.flatten([p.detach() for p in params], dtype=torch.float32)
            own = self.unit.shard(flat)
            if manager.offload is None:
                self.shard_param = nn.Parameter(own.clone())
            else:  # the fp32 shard lives in host memory (offload.py). nn.Parameter is a new tensor
                # object: .cpu() (no copy: it is there) tells the device rule's tracking so too
                self.shard_param = nn.Parameter(to_host(own)).cpu()
        self.device = flat.device  # where compute runs
        self.buffer, self.work = None, None
        # the ShardedOptimizer surface (sharded_optimizer.py treats this object as a shard)
        self.master, self.params, self.grad_shard, self.group_index = self.shard_param, [], None, 0
        self.names = []

    def compute_device_tensor(self):
        return torch.empty(0, device=self.device)

    # -------------------------------------------------------------- gather and free
    def start_gather(self) -> None:
        """Allocate the full buffer (or re-allocate its storage) and start the async all-gather."""
        if self.work is not None or self.gathered():
            return
        n = self.unit.padded_numel
        if self.buffer is None:
            self.buffer = torch.empty(n, dtype=self.compute_dtype, device=self.device)
        else:
            self.buffer.untyped_storage().resize_(n * self.buffer.element_size())
        shard = self.shard_param.detach()
        fp8 = self.manager.gather_dtype == "fp8"  # quantized from the fp32 shard, dequantized on wait()
        if self.offload is not None:  # the shard crosses to the device (fp8: in fp32, quantized there)
            shard = to_device(shard, self.device, None if fp8 else self.compute_dtype, self.offload)
        if fp8:
            self.work = FP8Gather(self.buffer.data, shard.to(self.device), self.group)
            self.manager.note(f"gather {self.name}")
            return
        shard = shard.to(device=self.device, dtype=self.compute_dtype).contiguous()
        # .data: writing the gathered values must not bump the version counter autograd checks
        self.work = all_gather_single(self.buffer.data, shard, group=self.group, async_op=True)
        self.manager.note(f"gather {self.name}")

    def wait_gather(self) -> None:
        if self.work is None and not self.gathered():
            self.start_gather()
        if self.work is not None:
            started = time.perf_counter()
            self.work.wait()
            self.work = None
            self.manager.span(f"wait {self.name}", started)

    def gathered(self) -> bool:
        return self.buffer is not None and self.buffer.untyped_storage().nbytes() > 0

    def free(self) -> None:
        if self.gathered():
            self.buffer.untyped_storage().resize_(0)
            self.manager.note(f"free {self.name}")

    def forget(self) -> None:
        """Drop the buffer object after backward: the next forward allocates a fresh one."""
        self.free()
        self.buffer = None

    def use_views(self) -> None:
        """Point every location of every parameter at a (differentiable) view of the buffer."""
        flat = _Gathered.apply(self.shard_param, self)
        pieces = flat.split(self.unit.numels + ([self.unit.padded_numel - self.unit.numel]
                                               if self.unit.padded_numel > self.unit.numel else []))
        for piece, shape, places in zip(pieces, self.unit.shapes, self.locations):
            view = piece.view(shape)
            for module, attr in places:
                setattr(module, attr, view)

    # -------------------------------------------------------------- backward
    def reduce_gradient(self, grad_flat: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        grad = grad_flat.contiguous().div(self.manager.world_size)  # sum of g/N = mean
        out = torch.empty(self.unit.shard_numel, dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(out, grad, group=self.group)
        self.manager.span(f"reduce-scatter {self.name}", started)
        self.forget()
        if self.offload is not None:  # the gradient shard crosses to the host
            return to_host(out, self.shard_param.dtype, self.offload)
        return out.to(device=self.shard_param.device, dtype=self.shard_param.dtype)


class FullyShardedModel:
    """Installs stage 3 on `model` in place (apply_zero does it). Attributes: units (root first,
    then blocks in forward order), memory_trace [(time, event, gathered bytes)], timeline."""

    def __init__(self, model: nn.Module, group=None, compute_dtype=None, offload=None, prefetch: bool = True,
                 timeline=None, gather_dtype=None):
        self.group, self.offload, self.prefetch, self.timeline = group, offload, prefetch, timeline
        self.gather_dtype = gather_dtype  # "fp8": fp8_gather.py's 1-byte all-gather
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.compute_dtype = compute_dtype or next(model.parameters()).dtype
        self.memory_trace = []
        names = {id(p): n for n, p in model.named_parameters()}
        blocks = list(getattr(model, "blocks", []))
        claimed = {id(p) for b in blocks for p in b.parameters()}
        root_params = [p for p in model.parameters() if id(p) not in claimed]
        plan = ([("root", model, root_params)] if root_params else []) + \
               [(f"block{i}", b, list(b.parameters())) for i, b in enumerate(blocks)]
        where = {}
        for mod in model.modules():
            for attr, p in list(mod._parameters.items()):
                if p is not None:
                    where.setdefault(id(p), []).append((mod, attr))
        self.units = []
        for name, module, params in plan:
            unit = FullyShardedUnit(name, module, params, [where[id(p)] for p in params], self)
            unit.names = [names[id(p)] for p in params]
            self.units.append(unit)
        for unit in self.units:  # swap the parameters for plain attributes, register the shard
            for places in unit.locations:
                for mod, attr in places:
                    mod._parameters.pop(attr, None)
                    setattr(mod, attr, None)
            unit.module.register_parameter(SHARD_NAME, unit.shard_param)
        self.root = self.units[0] if root_params else None
        self.blocks = [u for u in self.units if u is not self.root]
        for i, unit in enumerate(self.blocks):
            unit.module.register_forward_pre_hook(self._pre_forward(i))
            unit.module.register_forward_hook(self._post_forward(i))
            unit.module.register_full_backward_pre_hook(self._pre_backward(i))
        if self.root is not None:
            model.register_forward_pre_hook(self._root_pre_forward)
            model.register_forward_hook(self._root_post_forward)

    # -------------------------------------------------------------- hooks
    def _root_pre_forward(self, module, args):
        self.root.wait_gather()
        self.root.use_views()
        if self.prefetch and self.blocks:
            self.blocks[0].start_gather()

    def _root_post_forward(self, module, args, output):
        if not torch.is_grad_enabled():  # no backward will come to free it
            self.root.forget()

    def _pre_forward(self, i):
        def hook(module, args):
            unit = self.blocks[i]
            unit.wait_gather()
            unit.use_views()
            if self.prefetch and i + 1 < len(self.blocks):
                self.blocks[i + 1].start_gather()
        return hook

    def _post_forward(self, i):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                self.blocks[i].free()  # backward will gather it again
            else:
                self.blocks[i].forget()
        return hook

    def _pre_backward(self, i):
        def hook(module, grad_output):
            self.blocks[i].wait_gather()
            if self.prefetch and i > 0:
                self.blocks[i - 1].start_gather()
        return hook

    # -------------------------------------------------------------- observation
    def gathered_bytes(self) -> int:
        return sum(u.buffer.untyped_storage().nbytes() for u in self.units if u.buffer is not None)

    def note(self, event: str) -> None:
        self.memory_trace.append((time.perf_counter(), event, self.gathered_bytes()))

    def span(self, name: str, started: float) -> None:
        if self.timeline is not None:
            self.timeline.add(name, started, time.perf_counter(), "comm")
