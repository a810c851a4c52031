"""ZeRO's optimizer: each rank keeps the optimizer state of its shard of a flat buffer only.

With N data-parallel ranks, Psi parameters and Adam (Rajbhandari et al. 2020):

    stage 0 (DDP)  every rank: params Psi, grads Psi, fp32 master + m + v for all Psi
    stage 1        optimizer state (and fp32 master weights) of S = ceil(Psi / N) elements only
    stage 2        ... and the averaged gradient of those S elements only      (stage2.py)
    stage 3        ... and the parameters themselves                          (stage3.py)

One step of stage 1, per flat unit (flat.py), seen from rank r:

    g      = flatten(p.grad for p in unit) / N          the local gradient, padded to N*S
    g_r    = reduce_scatter(g)[r]                       sum over ranks of shard r: the mean gradient
    w_r   <- optimizer_class step on (master_r, g_r)    state only for [r*S, (r+1)*S)
    flat   = all_gather(w_r)                            every rank gets every updated shard

An all-reduce is a reduce-scatter followed by an all-gather; ZeRO keeps the first half for the
gradients and replaces the second with an all-gather of the *parameters*. So per rank a ring
moves (N-1)/N * Psi for each half: 2 (N-1)/N * Psi in all, exactly DDP's all-reduce.

Mixed precision: when the parameters are bf16/fp16 the optimizer steps an fp32 master copy of
the shard (counted as optimizer state, 12 bytes per element with Adam's m and v) and the
all-gather moves the updated shard cast back to the parameters' dtype. In fp32 the master
shard IS the slice of the flat parameter buffer (the parameters are views of that buffer), so
nothing is stored twice. With offload=True (ZeRO-Offload, Ren et al. 2021) master and state
live on the host: see offload.py.

Supported optimizers are element-wise (the state and update of element i depend only on
element i): SGD and the Adam family. Shampoo, Adafactor or Muon precondition whole rows or
matrices, and a flat shard cuts matrices anywhere, so they are rejected.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.parallel.clip import THIS_RANK, clip_grad_norm_
from course_lib.parallel.zero.flat import FlatUnit
from course_lib.parallel.zero.offload import OffloadCounter, to_device, to_host

ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop")


def check_optimizer_class(optimizer_class) -> None:
    """ValueError unless optimizer_class is one of torch.optim's element-wise optimizers."""
    ok = isinstance(optimizer_class, type) and optimizer_class.__module__.startswith("torch.optim") \
        and optimizer_class.__name__ in ELEMENTWISE_OPTIMIZERS
    if not ok:
        name = getattr(optimizer_class, "__name__", repr(optimizer_class))
        raise ValueError(
            f"optimizer_class={name} is not supported: ZeRO steps a flat shard that cuts tensors anywhere, "
            f"which is only exact for element-wise optimizers, torch.optim.{{{', '.join(ELEMENTWISE_OPTIMIZERS)}}} "
            f"(SGD and the Adam family). Optimizers whose state couples elements of a matrix (Shampoo, "
            f"Adafactor, Muon) would see different matrices")


def _param_groups(params) -> list[dict]:
    params = list(params)
    if not params:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out, seen = [], set()
    for g in groups:
        ps = [p for p in g["params"] if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in ps)
        if ps:
            out.append({**g, "params": ps})
    return out


class ShardedOptimizer:
    """ZeRO stage 1 over any parameter iterable (or list of param-group dicts), like torch's
    ZeroRedundancyOptimizer, but it also averages the gradients itself (one reduce-scatter per
    unit in step(), see the module docstring): use it on a plain model, not under DDP.

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    Each param group becomes one flat unit; the parameters are re-pointed into its flat buffer.
    The parameters must already be equal on every rank (same seed, or broadcast them first, as
    apply_zero does): each rank only ever updates its own shard and gathers the others'.
    Gradient clipping must see the global norm of the MEAN gradient, which only exists as shards:
    use `clip_grad_norm_` (train_step(..., clip_grad_norm=optimizer.clip_grad_norm_)), not
    torch.nn.utils.clip_grad_norm_ on the model, whose .grad are this rank's local gradients.
    `apply_zero` builds the same engine for stages 0 (no sharding), 2 (stage2.py) and 3 (stage3.py).
    """

    def __init__(self, params, optimizer_class, group=None, **optimizer_kwargs):
        groups = _param_groups(params)
        self._setup(optimizer_class, group, optimizer_kwargs, stage=1, offload=False,
                    units=[(gi, g["params"]) for gi, g in enumerate(groups)], groups=groups)

    @classmethod
    def for_stage(cls, units, optimizer_class, group, optimizer_kwargs, stage: int, offload=False,
                  compute_dtype=None, groups=None):
        """The engine for `stage` over prepared units: [(group index, params)] for stages 0-2, or
        stage 3's FullyShardedUnit objects (which bring their own shard parameters). offload:
        False, True or the OffloadCounter to share; compute_dtype: the parameters' dtype from
        here on (the masters start from their fp32 values)."""
        self = cls.__new__(cls)
        self._setup(optimizer_class, group, dict(optimizer_kwargs), stage, offload, units,
                    groups or [{"params": []}], compute_dtype)
        return self

    # ------------------------------------------------------------------ set-up
    def _setup(self, optimizer_class, group, optimizer_kwargs, stage, offload, units, groups, compute_dtype=None):
        check_optimizer_class(optimizer_class)
        self.group, self.stage, self.compute_dtype = group, stage, compute_dtype
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_world = 1 if stage == 0 else self.world_size  # stage 0: every rank owns everything
        self.offload = offload if isinstance(offload, OffloadCounter) else (OffloadCounter() if offload else None)
        self.shards = []
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        for item in units:
            shard = self._make_shard(item)
            self.shards.append(shard)
            inner_groups[shard.group_index]["params"].append(shard.master)
        self.optimizer = optimizer_class([g for g in inner_groups if g["params"]], **optimizer_kwargs)
        self._reduced = False

    def _make_shard(self, item):
        if self.stage == 3:  # stage 3: the unit's shard parameter is the master itself
            item.group_index = 0
            return item
        group_index, params = item
        s = _Shard(FlatUnit(params, self.shard_world, self.rank if self.shard_world > 1 else 0), group_index)
        u = s.unit
        dtype = self.compute_dtype or params[0].dtype
        with torch.no_grad():
            fp32 = u.flatten([p.detach() for p in params], dtype=torch.float32)
            s.flat_param = fp32 if dtype == torch.float32 else fp32.to(dtype)
            for p, v in zip(params, u.views(s.flat_param)):
                p.data = v  # the parameters now live in the flat buffer (in the compute dtype)
        own = u.shard(s.flat_param)
        if own.dtype == torch.float32 and self.offload is None:
            s.master = own  # fp32: the optimizer updates the parameters' own slice in place
        elif self.offload is not None:  # offload: an fp32 copy in host memory (offload.py)
            s.master = to_host(u.shard(fp32))
        else:  # mixed precision: an fp32 copy on the device
            s.master = u.shard(fp32).to(device=own.device, copy=True)
        return s

    # ------------------------------------------------------------------ the torch.optim surface
    @property
    def param_groups(self):
        return self.optimizer.param_groups  # an LR scheduler may change lr here

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            for p in s.params:
                p.grad = None
            s.grad_shard = None
            s.master.grad = None
        self._reduced = False

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> None:
        """Leave the mean gradient of this rank's shard in each unit's grad_shard (idempotent).
        Stage 0/1: one (reduce-scatter / all-reduce) of the flattened local gradients here.
        Stage 2 did it during backward; stage 3's autograd did it."""
        if self._reduced:
            return
        for s in self.shards:
            if self.stage in (0, 1):
                flat = s.unit.flatten([p.grad for p in s.params]).div_(self.world_size)  # sum of g/N = mean
                if self.stage == 0:
                    dist.all_reduce(flat, group=self.group)
                    s.grad_shard = flat
                    for p, g in zip(s.params, s.unit.views(flat)):
                        p.grad = g  # the mean gradient, in place of the local one
                else:
                    s.grad_shard = torch.empty(s.unit.shard_numel, dtype=flat.dtype, device=flat.device)
                    reduce_scatter_single(s.grad_shard, flat, group=self.group)
                    for p in s.params:
                        p.grad = None  # consumed: from here on the rank holds only its shard's mean
            elif self.stage == 2:
                s.finish_pending()
        self._reduced = True

    def _master_grad(self, s) -> torch.Tensor | None:
        """The fp32 gradient of the master shard (stage 3: autograd already left it there)."""
        if self.stage == 3:
            return s.master.grad
        if s.grad_shard is None:
            return None
        if self.offload is not None:  # ZeRO-Offload: the gradient shard crosses to the host
            return to_host(s.grad_shard, torch.float32, self.offload)
        return s.grad_shard.to(device=s.master.device, dtype=torch.float32)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every shard's gradient by min(1, max_norm / (||g|| + 1e-6)) and return ||g||: the
        one weighted clip (course_lib.parallel.clip), each rank's shard weighted 1 (the padding is
        zero, so it adds nothing); stage 0's full mean gradient, the same on every rank, needs no
        all-reduce (THIS_RANK)."""
        self.reduce_gradients()
        for s in self.shards:
            if s.master.grad is None:
                s.master.grad = self._master_grad(s)
        pairs = [(s.master.grad, 1) for s in self.shards]
        if self.shard_world == 1:
            return clip_grad_norm_(pairs, max_norm, THIS_RANK)
        return clip_grad_norm_(pairs, max_norm, self.group, device=self._comm_device())

    def _comm_device(self):
        s = self.shards[0]
        return (s.flat_param if self.stage != 3 else s.compute_device_tensor()).device

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported: ZeRO's step communicates, run forward/backward first")
        self.reduce_gradients()
        for s in self.shards:
            if s.master.grad is None:  # clip_grad_norm_ may have filled it already
                s.master.grad = self._master_grad(s)
        self.optimizer.step()
        if self.stage != 3:  # stage 3 gathers its parameters in the next forward instead
            for s in self.shards:
                s.master.grad = None  # the fp32 copy of the gradient (grad_shard stays until zero_grad)
                own = s.unit.shard(s.flat_param)
                if s.master.data_ptr() != own.data_ptr():  # mixed precision or offload: copy back
                    if self.offload is not None:  # the updated shard crosses back to the device
                        own.copy_(to_device(s.master, own.device, own.dtype, self.offload))
                    else:
                        own.copy_(s.master)
                if self.shard_world > 1:  # every rank receives every updated shard
                    all_gather_single(s.flat_param, own.clone(), group=self.group)
        self._reduced = False

    # ------------------------------------------------------------------ back to one process
    def _gather(self, s, shard: torch.Tensor) -> torch.Tensor:
        if self.shard_world == 1:
            return shard.detach().clone()
        dev = self._comm_device()
        out = torch.empty(s.unit.padded_numel, dtype=shard.dtype, device=dev)
        all_gather_single(out, shard.detach().to(dev).contiguous(), group=self.group)
        return out

    def full_state_dict(self) -> dict:
        """What a single-process `optimizer_class` over the same parameters would hold, gathered
        from every shard (collective: every rank calls it; every rank gets the whole dict):
        {"state": {i: {...}}, "param_groups": [...], "params": [fp32 master of parameter i]},
        parameters indexed in param-group order as torch.optim numbers them."""
        index, state, params = 0, {}, []
        groups = []
        for gi, g in enumerate(self.optimizer.param_groups):
            ids = []
            for s in (s for s in self.shards if s.group_index == gi):
                st = self.optimizer.state.get(s.master, {})
                full = {k: (s.unit.views(self._gather(s, v)) if torch.is_tensor(v) and v.dim() > 0 else v)
                        for k, v in st.items()}
                for j, master in enumerate(s.unit.views(self._gather(s, s.master))):
                    params.append(master.clone())
                    state[index] = {k: (v[j].clone() if isinstance(v, list) else
                                        (v.clone() if torch.is_tensor(v) else v)) for k, v in full.items()}
                    ids.append(index)
                    index += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups, "params": params, "names": self.param_names()}

    def full_gradients(self) -> list[torch.Tensor]:
        """The mean gradient of every parameter, gathered from the shards (param-group order)."""
        out = []
        for s in self.shards:
            g = s.grad_shard if self.stage != 3 else s.shard_param.grad
            if g is None:
                g = torch.zeros(s.unit.shard_numel, device=self._comm_device())
            out += s.unit.unflatten_into(self._gather(s, g))
        return out

    def param_names(self) -> list[str] | None:
        """Names of the parameters in full_state_dict / full_gradients order, when apply_zero set them."""
        names = [n for s in self.shards for n in getattr(s, "names", [])]
        return names or None


class _Shard:
    """One flat unit as the optimizer sees it (stages 0-2)."""

    def __init__(self, unit: FlatUnit, group_index: int):
        self.unit, self.group_index, self.params = unit, group_index, unit.params
        self.flat_param = self.master = self.grad_shard = None
        self.finish_pending = lambda: None  # stage 2 replaces it (stage2.py)
