"""Per-parameter stage 3 on a model: units chosen by a policy, and the hooks that gather them.

    policy="block"                 every module of model.blocks one unit, the rest one root unit
    policy="whole"                 the whole model one unit
    policy=(nn.Linear, nn.Embedding)   every module of those classes one unit (with every parameter
                                   below it not claimed by a unit further down); the parameters no
                                   unit claims (LayerNorms here) stay replicated, their gradients
                                   all-reduced (the mean), so bitwise equal on every rank

A parameter used by several modules (GPT's tied tok_emb / head weight) lives in one unit, and every
module using it gets that unit's hooks. Per step, around each sharded unit (FSDP2's schedule):

    forward pre-hook    wait for its all-gather (start it if nobody prefetched it), run the
                        gather's autograd node, point the modules at the full views;
                        prefetch=True: start the all-gather of the next unit in forward order
    forward post-hook   (after its last module) register the local shards again; reshard:
                        True free all, k keep 1/k (hsdp.py), False keep all; the root unit and
                        replicated units are never resharded after forward (FSDP2's root)
    output grad hook    before the unit's backward: gather it again if it was resharded;
                        prefetch=True: start the re-gather of the unit before it
    gather's backward   reduce the gradients (per_param.py), free the gathered tensors

Mixed precision as FSDP2 names it: param_dtype (the gathered, compute dtype), reduce_dtype (the
gradient reduction, fp32 by default); the local shards are the fp32 masters and their .grad is
fp32 after backward.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from course_lib.parallel.zero.per_param import Unit, count_optimizer_steps

POLICIES = ("block", "whole")


def check_policy(policy) -> None:
    """ValueError unless policy is "block", "whole" or a non-empty tuple of nn.Module classes."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {POLICIES} or a tuple of nn.Module classes "
                             f"(e.g. (nn.Linear, nn.Embedding))")
        return
    ok = isinstance(policy, (tuple, list)) and policy and all(isinstance(c, type) and issubclass(c, nn.Module)
                                                               for c in policy)
    if not ok:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES} or a non-empty tuple of nn.Module classes")


def plan_units(model: nn.Module, policy="block") -> list[dict]:
    """[{"name", "modules", "params": [(name, param)], "replicate", "root"}] in forward (module)
    order. Pure: touches no process group, so bad policies fail before any rank waits."""
    check_policy(policy)
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    order = {id(m): i for i, m in enumerate(model.modules())}
    if policy == "whole":
        return [{"name": "model", "modules": [model], "params": [(names[id(p)], p) for p in model.parameters()],
                 "replicate": False, "root": True}]
    if policy == "block":
        blocks = list(getattr(model, "blocks", []))
        if not blocks:
            raise ValueError("policy='block' needs the transformer blocks in model.blocks (an nn.ModuleList); "
                             "this model has none: pass policy='whole' or a tuple of module classes")
        claimed = {id(p) for b in blocks for p in b.parameters()}
        rest = [(names[id(p)], p) for p in model.parameters() if id(p) not in claimed]
        units = [{"name": "root", "modules": [model], "params": rest, "replicate": False, "root": True}] if rest else []
        return units + [{"name": f"block{i}", "modules": [b], "params": [(names[id(p)], p) for p in b.parameters()],
                         "replicate": False, "root": False} for i, b in enumerate(blocks)]
    classes = tuple(policy)
    chosen = [(n, m) for n, m in model.named_modules() if isinstance(m, classes)]
    if not chosen:
        kinds = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"policy={[c.__name__ for c in classes]} names no module of this model "
                         f"(its module classes: {kinds})")
    unit_of, units = {}, []
    for mname, m in reversed(chosen):  # children before parents: a unit takes what is left below it
        new = [p for p in m.parameters() if id(p) not in unit_of]
        for p in m.parameters(recurse=False):  # a tied parameter another unit owns: m uses it too
            if id(p) in unit_of and m not in unit_of[id(p)]["modules"]:
                unit_of[id(p)]["modules"].append(m)
        if new:
            u = {"name": mname or "model", "modules": [m], "params": [], "replicate": False, "root": m is model}
            for p in dict.fromkeys(new):
                u["params"].append((names[id(p)], p))
                unit_of[id(p)] = u
            units.append(u)
    if not units:
        raise ValueError(f"policy={[c.__name__ for c in classes]} matches modules with no parameters")
    owners = {}
    for m in model.modules():  # the rest, replicated: one unit per module owning them
        for attr, p in m._parameters.items():
            if p is not None and id(p) not in unit_of:
                u = owners.setdefault(id(m), {"name": names[id(p)].rsplit(".", 1)[0] or "model", "modules": [m],
                                              "params": [], "replicate": True, "root": m is model})
                u["params"].append((names[id(p)], p))
                unit_of[id(p)] = u
    units += list(owners.values())
    return sorted(units, key=lambda u: min(order[id(m)] for m in u["modules"]))


class PerParamModel:
    """Installs per-parameter stage 3 on `model` in place (apply_zero(..., sharding="per_param")
    does it). Attributes: units (forward order), mesh (hsdp.ShardMesh), gather_calls,
    gather_bytes (logical ring bytes received), timeline."""

    def __init__(self, model: nn.Module, mesh, policy="block", param_dtype=None, reduce_dtype=torch.float32,
                 prefetch: bool = False, timeline=None):
        self.mesh, self.prefetch, self.timeline = mesh, prefetch, timeline
        self.world, self.world_group = mesh.world, mesh.world_group
        self.shards, self.shard_rank, self.shard_group = mesh.shards, mesh.shard_rank, mesh.shard_group
        self.replicate_group, self.sub_group, self.reshard_size = mesh.replicate_group, mesh.sub_group, mesh.reshard_size
        self.reshard = mesh.reshard_after_forward
        self.param_dtype = param_dtype or torch.float32
        self.reduce_dtype = reduce_dtype or torch.float32
        self.gather_calls = self.gather_bytes = 0
        self.generation = 0  # the course optimizer's steps (Unit.stale also sees any torch optimizer's)
        count_optimizer_steps()
        self.events = []  # (what, unit name) in issue order: "gather", "forward", "done", "backward", "reduce"
        where = {}
        for mod in model.modules():
            for attr, p in mod._parameters.items():
                if p is not None:
                    where.setdefault(id(p), []).append((mod, attr))
        plan = plan_units(model, policy)
        self.units = [Unit(u["name"], u["modules"], [(n, p, where[id(p)]) for n, p in u["params"]], self,
                           replicate=u["replicate"], root=u["root"]) for u in plan]
        for unit in self.units:
            unit.restore()  # the local shards replace the parameters, under the same names
            for m in unit.modules:
                m.register_forward_pre_hook(self._pre_forward(unit))
                m.register_forward_hook(self._post_forward(unit, m))
        self.chain = [u for u in self.units if not u.replicate and not u.root]  # what prefetch walks

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, unit):
        def hook(module, args):
            if unit.installed:
                return
            if unit.stale():  # kept from before an optimizer step (no backward freed it): old values
                unit.drop_stale()
            unit.wait_gather()
            unit.install()
            self.log("forward", unit)
            nxt = self._neighbour(unit, +1)
            if self.prefetch and nxt is not None and not nxt.pending and nxt.work is None and not nxt.gathered():
                nxt.start_gather()
        return hook

    def _post_forward(self, unit, module):
        def hook(mod, args, output):
            unit.seen.add(id(module))
            self.log("done", unit)
            if torch.is_grad_enabled() and unit.pending:
                for t in (output if isinstance(output, (tuple, list)) else (output,)):
                    if torch.is_tensor(t) and t.requires_grad:
                        t.register_hook(self._pre_backward(unit))
            if len(unit.seen) < len(unit.modules):
                return
            unit.seen.clear()
            unit.restore()
            if not unit.pending:  # no backward will come (no_grad / eval): free now
                unit.forget()
            elif not (unit.root or unit.replicate or self.reshard is False):
                if self.reshard_size:
                    unit.keep_partial()
                unit.free()
        return hook

    def _pre_backward(self, unit):
        def hook(grad):
            if not unit.pending:
                return None
            unit.wait_gather(from_partial=self.reshard_size is not None)
            self.log("backward", unit)
            prev = self._neighbour(unit, -1)
            if self.prefetch and prev is not None and prev.pending and prev.freed and prev.work is None:
                prev.start_gather(from_partial=self.reshard_size is not None)
            return None
        return hook

    def _neighbour(self, unit, step):
        if unit.root and step > 0 and self.chain:  # the root's forward starts the first unit's gather
            return self.chain[0]
        if unit not in self.chain:
            return None
        i = self.chain.index(unit) + step
        return self.chain[i] if 0 <= i < len(self.chain) else None

    # ---------------------------------------------------------------- observation
    def log(self, what: str, unit) -> None:
        self.events.append((what, unit.name))

    def span(self, name: str, started: float) -> None:
        if self.timeline is not None:
            self.timeline.add(name, started, time.perf_counter(), "comm")

    def entries(self):
        """(unit, entry) for every parameter, in unit order."""
        return [(u, e) for u in self.units for e in u.entries]

    def gathered_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for u in self.units for t in u.padded)
