"""apply_per_param: per-parameter stage 3 (FSDP2's design) with its optimizer, and full state dicts.

    model, opt = apply_zero(model, 3, torch.optim.AdamW, sharding="per_param", lr=1e-3,
                            policy="block", reshard_after_forward=True, hsdp=1,
                            param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            prefetch=False, decay_groups=True, offload="nvme", offload_dir="/tmp/x")

The optimizer is optimizer_class on the local shards (the fp32 masters), by name. Any optimizer
may step them instead, e.g. `torch.optim.SGD(model.parameters(), lr=0.1)` built by the user on
the shards model.parameters() yields outside forward: whatever stays gathered across its step is
gathered again (per_param.py's rule: a changed version counter or any torch optimizer's step),
and gather_full_parameters(model.per_param) returns the full parameters for it. With
decay_groups=True two groups as course_lib.train.make_optimizer: weight decay on tensors of >= 2
dims, none on biases and norm gains (a flat shard cannot do that: one flat unit mixes both). The
padding rows have zero value and zero gradient, so they stay zero under AdamW. Clipping uses the
global norm (course_lib.parallel.clip) with weight 1/R for a shard (R HSDP replicas hold it) and
1/N for a replicated tensor. full_state_dict(model, optimizer) gathers {name: fp32 tensor} for
the per-parameter and the flat designs alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.clip import clip_grad_norm_
from course_lib.parallel.dp.ddp import broadcast_parameters
from course_lib.parallel.placement import gather_full
from course_lib.parallel.zero.hsdp import ShardMesh, check_mesh_args
from course_lib.parallel.zero.nvme import NVMeStore, check_nvme_dir
from course_lib.parallel.zero.per_param_model import PerParamModel, check_policy, plan_units
from course_lib.parallel.zero.per_param import shard_rows

PER_PARAM_KEYS = ("policy", "reshard_after_forward", "hsdp", "param_dtype", "reduce_dtype", "prefetch",
                  "timeline", "decay_groups", "offload_dir", "compute_dtype")
DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def check_per_param_args(world_size, policy="block", reshard_after_forward=True, hsdp=1, param_dtype=None,
                         reduce_dtype=torch.float32, offload=False, offload_dir=None, prefetch=False) -> int:
    """ValueError naming the value and the rule (pure Python; the parent calls it before ranks start).
    Returns the shard group size S."""
    check_policy(policy)
    shards = check_mesh_args(world_size, hsdp, reshard_after_forward)
    for name, d in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if d not in DTYPES:
            raise ValueError(f"{name}={d!r} must be one of {DTYPES}")
    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch={prefetch!r} must be True or False")
    if offload not in (False, "nvme"):
        raise ValueError(f"offload={offload!r}: sharding='per_param' offers False or 'nvme' (optimizer state in "
                         f"memory-mapped files under offload_dir); host offload is the flat design's")
    if offload == "nvme" and not offload_dir:
        raise ValueError("offload='nvme' needs offload_dir=DIR, a writable directory for the optimizer state")
    if offload != "nvme" and offload_dir:
        raise ValueError(f"offload_dir={offload_dir!r} is only used with offload='nvme'")
    return shards


def local_elements(model, policy, shards: int) -> int:
    """Elements of this rank's local tensors: sum over sharded W of ceil(d0/S) * row, plus replicated."""
    total = 0
    for u in plan_units(model, policy):
        for _, p in u["params"]:
            total += p.numel() if u["replicate"] else shard_rows(p.shape[0], shards) * (p.numel() // p.shape[0])
    return total


class PerParamOptimizer:
    """optimizer_class over the local shards; the surface train_step and train_zero use."""

    def __init__(self, sharded: PerParamModel, optimizer_class, decay_groups=False, store=None, **kwargs):
        self.sharded, self.store, self.offload, self.fsdp = sharded, store, None, None
        self.world_group, self.replicas = sharded.world_group, sharded.mesh.replicas
        entries = [e for _, e in sharded.entries()]
        params = [e.local for e in entries if e.local.requires_grad]
        if decay_groups:
            wd = kwargs.pop("weight_decay", 0.0)
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
        else:
            groups = [{"params": params}]
        self.optimizer = optimizer_class(groups, **kwargs)
        if store is not None:
            store.attach(self.optimizer, sharded.units)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        self.sharded.generation += 1  # whatever stays gathered now holds the old values
        if self.store is not None:
            return self.store.step(self.optimizer, self.sharded.units)
        return self.optimizer.step()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global norm of the mean gradient: a shard counts 1/R (R replicas hold it), a replicated
        tensor 1/N (every rank holds it)."""
        pairs = [(e.local.grad, 1 / (self.sharded.world if u.replicate else self.replicas))
                 for u, e in self.sharded.entries()]
        return clip_grad_norm_(pairs, max_norm, group=self.world_group)

    def full_state_dict(self) -> dict:
        """{"names", "params"}: every parameter by its original name, the single-process shape, fp32
        (collective over the shard group; HSDP replicas gather their own identical copies)."""
        full = gather_full_parameters(self.sharded)
        return {"names": list(full), "params": [full[n] for n in full]}

    def full_gradients(self) -> list[torch.Tensor]:
        """The mean gradient of every parameter, in full_state_dict's order."""
        full = gather_full_parameters(self.sharded, grads=True)
        return list(full.values())


def gather_full_parameters(sharded: PerParamModel, grads: bool = False) -> dict[str, torch.Tensor]:
    """{original name: full tensor} of the local shards (grads=True: of their .grad, zeros where
    None), unit order; collective over the shard group. Works whatever optimizer steps the shards."""
    tensors = [(e.local.grad if e.local.grad is not None else torch.zeros_like(e.local)) if grads
               else e.local.detach() for _, e in sharded.entries()]
    pieces = [(e.name, t, [e.placement]) for (_, e), t in zip(sharded.entries(), tensors)]
    return gather_full(pieces, group=sharded.shard_group)


def full_state_dict(model, optimizer) -> dict[str, torch.Tensor]:
    """{original name: full fp32 tensor} for either design (collective: every rank calls it); per-parameter
    in model.named_parameters() order, flat in its units' order."""
    full = optimizer.full_state_dict()
    names = full.get("names") or [n for n, _ in model.named_parameters()]
    out = dict(zip(names, full["params"]))
    if isinstance(optimizer, PerParamOptimizer):  # the names are the model's: its order
        return {n: out[n] for n, _ in model.named_parameters()}
    return out  # the flat design: unit order (root, then blocks)


def apply_per_param(model, optimizer_class, group=None, offload=False, **kwargs):
    """Returns (model, PerParamOptimizer); see the module docstring. Collective."""
    opts = {k: kwargs.pop(k) for k in PER_PARAM_KEYS if k in kwargs}
    policy = opts.get("policy", "block")
    reshard = opts.get("reshard_after_forward", True)
    replicas = opts.get("hsdp", 1)
    param_dtype = opts.get("param_dtype", opts.get("compute_dtype"))
    reduce_dtype = opts.get("reduce_dtype", torch.float32)
    offload_dir = opts.get("offload_dir")
    prefetch = opts.get("prefetch", False)
    n = dist.get_world_size(group)
    shards = check_per_param_args(n, policy, reshard, replicas, param_dtype, reduce_dtype, offload, offload_dir,
                                  prefetch)
    plan_units(model, policy)  # a policy naming no module fails here, before any collective
    store = None
    if offload == "nvme":  # every rank checks the same directory for the whole world's files first
        need = NVMeStore.bytes_needed(local_elements(model, policy, shards)) * n
        check_nvme_dir(offload_dir, need)
        store = NVMeStore(offload_dir, dist.get_rank(group))
    broadcast_parameters(model, group)
    mesh = ShardMesh(replicas, reshard, group)
    sharded = PerParamModel(model, mesh, policy, param_dtype, reduce_dtype, prefetch, opts.get("timeline"))
    optimizer = PerParamOptimizer(sharded, optimizer_class, opts.get("decay_groups", False), store, **kwargs)
    model.per_param = sharded
    return model, optimizer
