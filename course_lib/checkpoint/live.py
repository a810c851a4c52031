"""Live resharding: move a sharded state from one layout to another between running process
groups (trainer ranks -> generator ranks), by the checkpoint's global-offset boxes, with
point-to-point sends instead of files.

One world of A + B ranks: trainer ranks 0..A-1 hold the source layout, generator ranks
A..A+B-1 want the destination layout; either side is one of

    flat_holdings    ZeRO-3 flat shards (gpt_zero3_units: the units stage 3 cuts a GPT into)
    split_holdings   a Placement per tensor: tensor parallel as course_lib.parallel.tp places it
                     (gpt_tp_placements), or per-parameter dim-0 rows (dim0_placements)

A `Holdings` says, per rank, which box of which global tensor sits where in the rank's local
buffers (a `Held`). The plan is box intersection, as a checkpoint load is (reshard.py), with
nothing in between:

    for each destination rank d, each box D it wants, each source rank s, each box S it holds:
        common = S.intersect(D)  ->  a Move of common.volume elements from s to d

so pair (s, d) moves  bytes(s, d) = itemsize * sum over names and boxes of |S ∩ D|  elements,
and every destination element arrives exactly once (the plan checks it: volumes add up and no
element is written twice). A box held identically by several source ranks (a replicated
LayerNorm under tp) is sent by one of them, holders[d mod k], which spreads the load.

Execution: each pair's pieces are packed, in plan order, into ONE buffer; every rank issues all
its sends (trainers) or receives (generators) in ONE dist.batch_isend_irecv and waits. A pair
sees one send and one receive of the same count and dtype, issued together: NCCL's matching and
rendezvous rules hold (observe/nccl_rules.py), so the same code runs under COURSE_NCCL_RULES=1.
The plan is pure (no torch.distributed): `plan_transfer` refuses bad input in the parent.
(A few lines over 300: the plan and its execution read best side by side.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from course_lib.checkpoint.reshard import Box, whole
from course_lib.checkpoint.slots import flat_boxes, placed_boxes
from course_lib.comm.process_groups import new_groups
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.placement import Placement
from course_lib.parallel.tp.apply import qkv_rows
from course_lib.parallel.tp.layers import contiguous_table, padded_size
from course_lib.parallel.zero.per_param import AXIS, shard_rows
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device


@dataclass(frozen=True)
class Held:
    """Box `box` of global tensor `name` sits in the rank's local buffer `buffer`: at `local`
    (a box of that buffer) or, for a flat buffer, from flat position `pos` on, row-major."""

    name: str
    box: Box
    buffer: int
    local: Box | None = None
    pos: int = 0

    def view(self, buffers) -> torch.Tensor:
        t = buffers[self.buffer]
        if self.local is None:
            return t[self.pos:self.pos + self.box.volume].view(self.box.lengths)
        return t[self.local.slices()]


@dataclass(frozen=True)
class Holdings:
    """What each rank of one group holds: held[r] its boxes, buffers[r] its local buffers' shapes."""

    kind: str
    shapes: dict  # name -> global shape
    held: tuple  # tuple per rank of tuple[Held]
    buffers: tuple  # tuple per rank of buffer shapes

    @property
    def world(self) -> int:
        return len(self.held)


def flat_holdings(shapes: dict, world: int, units=None) -> Holdings:
    """ZeRO flat shards (course_lib.parallel.zero.flat): each unit (a list of names, default one
    unit of all, in order) laid end to end, padded to world * S, S = ceil(P / world); rank r's
    buffer u is [r*S, (r+1)*S). A parameter's part of it: Placement.of_flat_unit's range, cut
    into boxes by flat_boxes, as the checkpoint's zero layout does."""
    units = [list(shapes)] if units is None else [list(u) for u in units]
    held = [[] for _ in range(world)]
    sizes = []
    for u, names in enumerate(units):
        numels = [math.prod(shapes[n]) for n in names]
        s = -(-sum(numels) // world)
        sizes.append((s,))
        off = 0
        for name, n in zip(names, numels):
            for r in range(world):
                for box, pos in flat_boxes(Placement.of_flat_unit("dp", off, n, s, r, world), shapes[name]):
                    held[r].append(Held(name, box, u, pos=off + pos - r * s))
            off += n
    return Holdings("flat", dict(shapes), tuple(tuple(h) for h in held), tuple(tuple(sizes) for _ in range(world)))


def split_holdings(shapes: dict, placements: dict, kind: str = "tp") -> Holdings:
    """Every tensor split or replicated over one axis as its Placement says (any rank's record:
    the tables are the axis's); rank r's buffer i is tensor i's local piece (split: len(table[r])
    along dim, padding rows included and left zero)."""
    world = {p.n for p in placements.values()}
    if len(world) != 1:
        raise ValueError(f"placements span axes of sizes {sorted(world)}: one axis size, please")
    n = world.pop()
    held, buffers = [[] for _ in range(n)], [[] for _ in range(n)]
    for i, name in enumerate(shapes):
        for r in range(n):
            p = replace(placements[name], rank=r)
            local = list(shapes[name])
            if p.kind == "split":
                local[p.dim] = len(p.rows)
            _, boxes = placed_boxes((p,), local)
            held[r] += [Held(name, g, i, local=lb) for g, lb in boxes]
            buffers[r].append(tuple(local))
    return Holdings(kind, dict(shapes), tuple(tuple(h) for h in held), tuple(tuple(b) for b in buffers))


def gpt_tp_placements(model, tp: int) -> dict:
    """{name: Placement over tp} of a plain course GPT, as apply_tensor_parallel places it (qkv:
    whole heads of Q, K, V; fc: rows; proj: input columns; vocabulary rows padded to tp), built
    in the parent from the tp package's own tables (tests hold it against tp_placements)."""
    cfg, out = model.config, {}
    for name, p in model.named_parameters():
        leaf, kind = name.rsplit(".", 1)
        part = leaf.rsplit(".", 1)[-1]
        if leaf.endswith("attn.qkv"):
            out[name] = Placement.split("tp", 0, qkv_rows(cfg.d_model, tp), 0, p.shape[0])
        elif leaf.endswith("mlp.fc") or leaf in ("tok_emb", "head"):
            rows = padded_size(p.shape[0], tp) if leaf in ("tok_emb", "head") else p.shape[0]
            out[name] = Placement.split("tp", 0, contiguous_table(rows, tp), 0, p.shape[0])
        elif part == "proj" and kind == "weight":
            out[name] = Placement.split("tp", 1, contiguous_table(p.shape[1], tp), 0, p.shape[1])
        else:
            out[name] = Placement.replicated("tp", 0, tp)
    return out


def dim0_placements(shapes: dict, world: int) -> dict:
    """Per-parameter stage 3 (course_lib.parallel.zero, sharding="per_param", policy "block"):
    every tensor cut on dim 0 into `world` blocks of c = shard_rows(d0, world) rows, the last
    padded with zero rows; the placement record per_param.py gives each parameter."""
    out = {}
    for name, shape in shapes.items():
        if not shape:
            raise ValueError(f"{name!r} is 0-dim: dim-0 sharding needs a dim 0 (replicate it)")
        c = shard_rows(shape[0], world)
        out[name] = Placement.split(AXIS, 0, [range(r * c, (r + 1) * c) for r in range(world)], 0, shape[0])
    return out


def gpt_zero3_units(model) -> list[list[str]]:
    """The flat units of ZeRO-3 (course_lib.parallel.zero.stage3) on a plain GPT: the root (what
    no block holds), then each block, parameters in model order (tests hold it against fsdp.units)."""
    blocks = [[f"blocks.{i}.{n}" for n, _ in b.named_parameters()] for i, b in enumerate(model.blocks)]
    claimed = {n for b in blocks for n in b}
    root = [n for n, _ in model.named_parameters() if n not in claimed]
    return ([root] if root else []) + blocks


@dataclass(frozen=True)
class Move:
    box: Box  # the common box (global offsets)
    src: Held
    dst: Held


@dataclass
class TransferPlan:
    src: Holdings
    dst: Holdings
    dtype: torch.dtype
    moves: dict = field(default_factory=dict)  # (src rank, dst rank) -> [Move] in packing order

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def ranks(self) -> int:
        return self.src.world + self.dst.world

    def pair_bytes(self) -> dict:
        """{(trainer rank, generator rank): bytes} of every pair that moves anything."""
        return {k: self.itemsize * sum(m.box.volume for m in v) for k, v in self.moves.items()}

    def wanted_bytes(self) -> int:
        """The formula, from the destination layout alone: itemsize x every element each generator
        rank holds (its boxes, padding excluded), summed over generator ranks; each arrives once."""
        return self.itemsize * sum(h.box.volume for held in self.dst.held for h in held)


def plan_transfer(src: Holdings, dst: Holdings, dtype=torch.float32) -> TransferPlan:
    """The moves from src (trainer ranks) to dst (generator ranks); ValueError, naming the value
    and the rule, when a shape disagrees or a destination element is not covered exactly once."""
    for name, shape in dst.shapes.items():
        if name not in src.shapes:
            raise ValueError(f"destination tensor {name!r} is not in the source layout: every wanted tensor needs a source")
        if tuple(src.shapes[name]) != tuple(shape):
            raise ValueError(f"{name!r}: source shape {tuple(src.shapes[name])} != destination shape {tuple(shape)}: "
                             "resharding keeps global shapes")
    for name, shape in dst.shapes.items():
        mask = torch.zeros(shape, dtype=torch.bool)
        for held in dst.held:
            for h in held:
                if h.name == name:
                    mask[h.box.slices()] = True
        if not bool(mask.all()):
            raise ValueError(f"destination layout covers {int(mask.sum())} of the {mask.numel()} elements of "
                             f"{name!r}: every parameter must be wanted whole by the generator ranks")
    holders = {}  # name -> {box: [(source rank, Held)] of the source ranks holding that very box}
    for s, held in enumerate(src.held):
        for h in held:
            holders.setdefault(h.name, {}).setdefault(h.box, []).append((s, h))
    plan = TransferPlan(src, dst, dtype)
    for d, held in enumerate(dst.held):
        for want in held:
            written = torch.zeros(want.box.lengths, dtype=torch.int32)
            for cands in holders.get(want.name, {}).values():
                s, have = cands[d % len(cands)]
                common = have.box.intersect(want.box)
                if common is not None:
                    written[common.slices(want.box.offsets)] += 1
                    plan.moves.setdefault((s, d), []).append(Move(common, have, want))
            if written.numel() and (written.min() != 1 or written.max() != 1):
                raise ValueError(f"{want.name!r} box {want.box} on generator rank {d}: elements covered "
                                 f"{int(written.min())}..{int(written.max())} times, must be exactly once")
    return plan


def check_world(plan: TransferPlan, world_size: int) -> None:
    """The parent's check: trainers 0..A-1 then generators A..A+B-1 must be the whole world."""
    if world_size != plan.ranks:
        raise ValueError(f"world_size={world_size}: a layout of A={plan.src.world} trainer ranks then "
                         f"B={plan.dst.world} generator ranks needs world_size = A + B = {plan.ranks}")


def new_buffers(layout: Holdings, rank: int, dtype=torch.float32, device=None) -> list[torch.Tensor]:
    return [torch.zeros(s, dtype=dtype, device=device) for s in layout.buffers[rank]]


@torch.no_grad()
def transfer(plan: TransferPlan, buffers=None) -> list[torch.Tensor] | None:
    """Rank code on the world of plan.ranks ranks. A trainer passes its source buffers and gets
    None; a generator gets its destination buffers (zeros where nothing is wanted: padding).
    (NCCL: a trainer whose shards are all padding sends nothing and skips the batch.)"""
    me, a, dtype = dist.get_rank(), plan.src.world, plan.dtype
    device = rank_device()
    ops, unpack = [], []
    if me < a:
        want = [tuple(t) for t in plan.src.buffers[me]]
        if buffers is None or [tuple(b.shape) for b in buffers] != want:
            got = None if buffers is None else [tuple(b.shape) for b in buffers]
            raise ValueError(f"trainer rank {me}: buffers of shapes {got} != the source layout's {want}")
        for (s, d), moves in plan.moves.items():
            if s == me:
                packed = torch.cat([m.src.view(buffers)[m.box.slices(m.src.box.offsets)].reshape(-1) for m in moves])
                ops.append(dist.P2POp(dist.isend, packed.to(device=device, dtype=dtype), a + d))
        out = None
    else:
        out = new_buffers(plan.dst, me - a, dtype, device)
        for (s, d), moves in plan.moves.items():
            if d == me - a:
                buf = torch.empty(sum(m.box.volume for m in moves), dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buf, s))
                unpack.append((buf, moves))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for buf, moves in unpack:
        at = 0
        for m in moves:
            m.dst.view(out)[m.box.slices(m.dst.box.offsets)] = buf[at:at + m.box.volume].view(m.box.lengths)
            at += m.box.volume
    return out


def live_rank(plan, source_fn, consume_fn):
    """Rank code of run_live_reshard (public so a caller may wrap it, e.g. observe.nccl_rules.under_rules)."""
    me, a = dist.get_rank(), plan.src.world
    trainers, generators = new_groups([range(a), range(a, plan.ranks)])
    mine = trainers if me < a else generators
    buffers = source_fn(me, mine) if me < a else None
    with CommTracer() as tracer:
        out = transfer(plan, buffers)
    result = {"traffic": tracer.total_bytes(), "calls": {k: v["calls"] for k, v in tracer.summary().items()}}
    if me >= a:
        result["buffers"] = [t.cpu() for t in out]
        if consume_fn is not None:
            result["check"] = consume_fn(me - a, generators, out)
    return result


def run_live_reshard(plan: TransferPlan, source_fn, world_size: int, consume_fn=None, timeout_s: float = 120,
                     **kw) -> list[dict]:
    """Parent: check the world, then on world_size ranks: trainers build their source buffers with
    source_fn(rank, trainer group), everyone runs `transfer` under a CommTracer; generators return
    their buffers (and consume_fn(generator rank, generator group, buffers) if given)."""
    check_world(plan, world_size)
    return run_on_ranks(live_rank, plan, source_fn, consume_fn, world_size=world_size,
                        timeout_s=timeout_s, **kw)
