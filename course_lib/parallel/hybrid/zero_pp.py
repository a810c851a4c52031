"""ZeRO-2 and ZeRO-3 over dp on a pipeline (and tensor-parallel) stage: reduced once per step.
(Just over 300 lines: the two stages share one unit layout and one gradient counter; split, each
half would re-derive them.)

A replica's m micro-batches each run their own backward through the stage (the pipeline
schedule interleaves them with other micro-batches' forwards). The question at dp > 1 is
when to reduce over the replicas:

    per micro-batch   a reduce-scatter after every backward: m (N-1)/N Psi_r bytes a step
                      (Psi_r: the rank's parameters), the flat ZeRO-2/3 engines' choice
    once per step     each parameter's gradient accumulates, unsharded, across the m
                      backwards; one reduce-scatter of it when it is final: (N-1)/N Psi_r

The course reduces once per step, as torch's pipelining does with FSDP2 (torch 2.13's stage
runs every micro-batch's backward with gradient sync off, then one REDUCE_GRAD action) and
Megatron's distributed optimizer does: m times fewer bytes and calls, for holding the stage's
unsharded gradient (4 Psi_r bytes, fp32) until the last micro-batch's backward. With pp the
stage's gradient, Psi / (pp tp), is small beside the activations of the micro-batches in
flight, which is why the trade pays. (DeepSpeed's pipeline engine refuses ZeRO stages 2 and 3
outright: it asserts stage < 2.)

ZeRO-2 (StageBuckets). The engine's flat units (one per parameter group and bucket) as at
ZeRO-1; a post-accumulate-grad hook counts each parameter's gradient: after its m-th it is
final, and once every parameter of a bucket is final (and every bucket before it launched,
the same order on every replica) the bucket's reduce-scatter starts, during the last
micro-batch's backward, and its full gradient is freed. The tied matrix (its other part
arrives after the schedule) and gradients that never pass through a hook (the zero-bubble
schedule's deferred weight gradients) launch when the step reduces. Then, as at ZeRO-1: the
optimizer steps the rank's shard and the updated shards are all-gathered.

ZeRO-3 (StageUnits). The parameters stay where they are (names, shapes, placements) but
their storage is one flat buffer per unit (a chunk's matrices, a chunk's vectors; the chunks
of this rank's stage, or the whole model at pp = 1), allocated only while gathered; the
optimizer owns the fp32 shard of S_u = ceil(P_u / N) elements. A chunk's forward pre-hook
all-gathers its units; a hook on its output's gradient (the moment its backward begins)
gathers them again when they were freed. Two policies (reshard_after_forward):

    True   free after each micro-batch's forward and after its backward: all-gathers per
           step 2 m U (U: the rank's units), bytes sent 2 m sum_u S_u e; gathered at once at
           most one chunk's units, max_c sum_{u in c} N S_u e
    False  gathered at the first forward, kept until the step's reduction (Llama 3's "no
           reshard after forward", Dubey et al. 2024, 3.3.2): U all-gathers, bytes sent
           sum_u S_u e; gathered at once every unit, sum_u N S_u e

and either way one reduce-scatter per unit per step, bytes sent sum_u N S_u e (its input).
With one chunk per rank (v = 1) the two policies gather the same bytes at once: the stage is
whole during each of its actions; resharding saves memory between actions and, with v > 1,
holds one chunk instead of v. Between steps a rank holds, per unit, e S_u of parameters (the
fp32 master), e S_u of gradient and 2 e S_u of AdamW moments: notebook 01's ZeRO-3 formula
(ZeRO-2: e P_u of parameters). The parameters are gathered again (unshard) only to read them
whole, e.g. at the end of a run.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single, reduce_scatter_single
from course_lib.parallel.zero.flat import FlatUnit
from course_lib.parallel.zero.memory import measure_state_bytes
from course_lib.parallel.zero.sharded_optimizer import ShardedOptimizer

ZERO_PP_STAGES = (2, 3)


def unreduced_grad_bytes(shards) -> int:
    """Bytes of the whole (not yet reduce-scattered) gradients the shards' parameters hold now."""
    return sum(p.grad.numel() * p.grad.element_size() for s in shards for p in s.params if p.grad is not None)


def _reduce_unit(unit: FlatUnit, world_size: int, group, async_op: bool = False):
    """(work, shard): the mean of the unit's accumulated gradients, rank's shard, reduce-scattered;
    the full gradients freed."""
    flat = unit.flatten([p.grad for p in unit.params]).div_(world_size)  # sum over ranks of g/N = mean
    for p in unit.params:
        p.grad = None
    out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
    return reduce_scatter_single(out, flat, group=group, async_op=async_op), out


class StageBuckets:
    """ZeRO-2 once per step (module docstring): launches each bucket's reduce-scatter when its
    parameters' m-th gradient has arrived; finish() (the optimizer's reduce_gradients) launches
    the rest and waits for all. `launched_in_backward`: the buckets launched from hooks, during
    the last micro-batch's backward, in the last step reduced."""

    def __init__(self, optimizer, microbatches: int, late=(), overlap: bool = True):
        self.opt, self.m = optimizer, microbatches
        late = {id(p) for p in late}
        self.counts: dict[int, int] = {}
        self.eager = [overlap and not any(id(p) in late for p in s.params) for s in optimizer.shards]
        self.next, self.pending, self.launched_in_backward, self._eager = 0, {}, 0, 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for s in optimizer.shards for p in s.params]
        for s in optimizer.shards:
            s.finish_pending = self.finish

    def _final(self, i: int) -> bool:
        return self.eager[i] and all(self.counts.get(id(p), 0) >= self.m for p in self.opt.shards[i].params)

    def _ready(self, param) -> None:
        self.counts[id(param)] = self.counts.get(id(param), 0) + 1
        while self.next < len(self.opt.shards) and self._final(self.next):
            self._launch()
            self._eager += 1

    def _launch(self) -> None:
        if self.next == 0:  # the step's first reduction: every gradient accumulated whole until now
            self.opt.peak_grad_bytes = max(self.opt.peak_grad_bytes, unreduced_grad_bytes(self.opt.shards))
        s = self.opt.shards[self.next]
        self.pending[self.next] = _reduce_unit(s.unit, self.opt.world_size, self.opt.group, async_op=True)
        self.next += 1

    def finish(self) -> None:
        while self.next < len(self.opt.shards):
            self._launch()
        for i, (work, out) in sorted(self.pending.items()):
            work.wait()
            self.opt.shards[i].grad_shard = out
        self.pending.clear()
        self.counts.clear()
        self.next, self.launched_in_backward, self._eager = 0, self._eager, 0


class StageUnit:
    """ZeRO-3: one flat unit of a chunk, as the ShardedOptimizer's stage-3 shard (master,
    grad_shard, unit, params, group_index). The parameters' storage is `buffer`'s."""

    def __init__(self, name, params, group_index, group):
        self.name, self.group, self.group_index = name, group, group_index
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.unit = FlatUnit(params, self.world_size, self.rank)
        self.params, self.names = self.unit.params, []
        with torch.no_grad():
            self.buffer = self.unit.flatten([p.detach() for p in params], dtype=params[0].dtype)
            for p, v in zip(params, self.unit.views(self.buffer)):
                p.data = v  # the parameter's storage is the unit's buffer from here on
            self.master = torch.nn.Parameter(self.unit.shard(self.buffer).float().clone())
        self.grad_shard = None

    def compute_device_tensor(self):
        return self.buffer

    def gathered(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    def gathered_bytes(self) -> int:
        return self.buffer.untyped_storage().nbytes()

    def gather(self) -> None:
        if self.gathered():
            return
        self.buffer.untyped_storage().resize_(self.unit.padded_numel * self.buffer.element_size())
        shard = self.master.detach().to(self.buffer.dtype).contiguous()
        # .data: refilling the storage autograd's saved weights point at must not bump their version
        all_gather_single(self.buffer.data, shard, group=self.group)

    def free(self) -> None:
        if self.gathered():
            self.buffer.untyped_storage().resize_(0)

    def reduce(self) -> None:
        """One reduce-scatter of the gradient accumulated over the step's micro-batches."""
        _, self.grad_shard = _reduce_unit(self.unit, self.world_size, self.group)
        self.master.grad = self.grad_shard  # fp32: the clip scales it in place


class StageUnits:
    """ZeRO-3 on `chunks` (modules, each with its units): gather before forward and before
    backward; free after forward and backward (reshard_after_forward) or at the step's end."""

    def __init__(self, chunks, units_of_chunk, reshard_after_forward: bool):
        self.reshard = reshard_after_forward
        self.units = list({id(u): u for us in units_of_chunk for u in us}.values())
        self.peak_gathered_bytes = 0  # the most gathered parameter bytes alive at once, since the start
        for chunk, units in zip(chunks, units_of_chunk):
            chunk.register_forward_pre_hook(functools.partial(self._before_forward, units))
            chunk.register_forward_hook(functools.partial(self._after_forward, units))
        self.free_all()  # between steps a rank holds its shards only

    def _gather(self, units) -> None:
        for u in units:
            u.gather()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(u.gathered_bytes() for u in self.units))

    def _before_forward(self, units, _module, _args) -> None:
        self._gather(units)

    def _after_forward(self, units, _module, _args, output) -> None:
        if self.reshard or not torch.is_grad_enabled():
            for u in units:
                u.free()
        # the gradient of the chunk's output arrives just before the chunk's own backward
        for t in (output if isinstance(output, tuple) else (output,)):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(functools.partial(self._before_backward, units))

    def _before_backward(self, units, _grad) -> None:
        self._gather(units)
        if self.reshard:  # free again once this backward (one micro-batch through the chunk) ends
            torch.autograd.Variable._execution_engine.queue_callback(lambda: [u.free() for u in units])

    def free_all(self) -> None:
        for u in self.units:
            u.free()

    def unshard(self) -> None:
        """Gather every unit (collective over dp): the parameters whole, to be read."""
        for u in self.units:
            u.gather()


class StageShardedOptimizer(ShardedOptimizer):
    """The ZeRO engine at stage 2 or 3 for a composed run: stage 2's flat units (hooks:
    StageBuckets), stage 3's StageUnits; the gradients reduced once per step (module docstring).
    `peak_grad_bytes`: the most whole-gradient bytes held at once, since the start (just before
    each step's first reduce-scatter: e Psi_r once every parameter has had a micro-batch)."""

    peak_grad_bytes = 0

    def _make_shard(self, item):
        if isinstance(item, StageUnit):
            return item
        return super()._make_shard(item)

    def reduce_gradients(self) -> None:
        if self._reduced:
            return
        if self.stage == 3:
            self.peak_grad_bytes = max(self.peak_grad_bytes, unreduced_grad_bytes(self.shards))
            for s in self.shards:
                s.reduce()
            self.fsdp.free_all()  # the backward is over: the policy "keep" ends here
        else:
            self.buckets.finish()
        self._reduced = True

    def unshard(self) -> None:
        """Stage 3: every parameter whole again (collective over dp), to be read or written."""
        if self.stage == 3:
            self.fsdp.unshard()

    @torch.no_grad()
    def reshard_from_parameters(self) -> None:
        """Stage 3, after the parameters were written whole (a checkpoint loaded into them): each
        master := its range of the unit's buffer, then free the buffers. Elsewhere nothing to do:
        the fp32 masters are the parameters' own slices."""
        if self.stage == 3:
            for s in self.shards:
                s.master.copy_(s.unit.shard(s.buffer))
            self.fsdp.free_all()


def build_stage_optimizer(chunks, groups, optimizer_class, group, optimizer_kwargs, stage: int, microbatches: int,
                          reshard_after_forward: bool = True, late=(), overlap: bool = True) -> StageShardedOptimizer:
    """The engine for `stage` (2 or 3) over `chunks` (the modules run one forward each per
    micro-batch) whose parameters are split into `groups` (param-group dicts, e.g. decay /
    no decay). Stage 2: one flat unit per group (the parameters in `late`, e.g. the tied
    matrix, in a unit of their own that launches when the step reduces; overlap=False: every
    unit then, for schedules whose W actions add weight gradients after the hooks fired);
    stage 3: one unit per chunk and group, gathered for every chunk that uses its parameters."""
    if stage not in ZERO_PP_STAGES:
        raise ValueError(f"stage={stage!r} must be one of {ZERO_PP_STAGES}")
    index = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    if stage == 2:
        late_ids = {id(p) for p in late}
        units = []  # launched in this order on every replica: the late units last, not blocking the others
        for late_unit in (False, True):
            units += [(gi, ps) for gi, g in enumerate(groups)
                      for ps in [[p for p in g["params"] if (id(p) in late_ids) == late_unit]] if ps]
        opt = StageShardedOptimizer.for_stage(units, optimizer_class, group, optimizer_kwargs, 2, groups=groups)
        opt.buckets = StageBuckets(opt, microbatches, late, overlap)
        return opt
    seen, units = set(), []
    for c, chunk in enumerate(chunks):
        for gi in range(len(groups)):
            ps = [p for p in chunk.parameters() if index.get(id(p)) == gi and id(p) not in seen]
            seen.update(id(p) for p in ps)
            if ps:
                units.append(StageUnit(f"chunk{c}.group{gi}", ps, gi, group))
    # a parameter two chunks of this rank share (a tied matrix) lives in the first one's unit
    units_of_chunk = [[u for u in units if any(id(p) in {id(q) for q in chunk.parameters()} for p in u.params)]
                      for chunk in chunks]
    opt = StageShardedOptimizer.for_stage(units, optimizer_class, group, optimizer_kwargs, 3, groups=groups)
    opt.fsdp = StageUnits(chunks, units_of_chunk, reshard_after_forward)
    return opt


def measure_stage_bytes(module, optimizer) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"} this rank holds now, read from the tensors (as
    course_lib.parallel.zero.measure_state_bytes). Stage 3: params = the fp32 shards (the
    masters) + the gathered buffers alive; grads = the gradient shards + any unreduced .grad."""
    if optimizer.stage != 3:
        return measure_state_bytes(module, optimizer)

    def nbytes(t):
        return 0 if t is None else t.numel() * t.element_size()
    out = {"params": sum(nbytes(s.master) + s.gathered_bytes() for s in optimizer.shards),
           "grads": sum(nbytes(s.grad_shard) + sum(nbytes(p.grad) for p in s.params) for s in optimizer.shards),
           "optimizer": sum(nbytes(v) for st in optimizer.state.values() for v in st.values()
                            if torch.is_tensor(v) and v.dim() > 0)}
    return out | {"host": 0, "total": sum(out.values())}


def zero_pp_traffic(unit_sizes: list[int], microbatches: int, world_size: int, stage: int,
                    reshard_after_forward: bool = True, elem_bytes: int = 4) -> dict[str, dict[str, int]]:
    """{op: {"calls", "bytes_sent"}} of one rank's ZeRO collectives in one step over a dp group
    of N = world_size ranks, from its units' sizes P_u (S_u = ceil(P_u / N), module docstring):
    stage 2 one reduce-scatter (N S_u e sent) and one all-gather (S_u e) per unit; stage 3 one
    reduce-scatter per unit and 2m (reshard after forward) or 1 (keep) all-gathers per unit."""
    shards = [-(-p // world_size) for p in unit_sizes]
    gathers = 1 if stage == 2 else (2 * microbatches if reshard_after_forward else 1)
    return {"all_gather": {"calls": gathers * len(shards), "bytes_sent": gathers * sum(shards) * elem_bytes},
            "reduce_scatter": {"calls": len(shards), "bytes_sent": world_size * sum(shards) * elem_bytes}}
