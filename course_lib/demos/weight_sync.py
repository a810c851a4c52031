"""Trainer -> generator weight sync: after every optimizer step the trainer's sharded weights move
live to a generator laid out differently, as reinforcement-learning post-training needs.

    torchrun --nproc-per-node=4 -m course_lib.demos.weight_sync --trainer zero3:dp2 --generator tp:2 --check
    torchrun --nproc-per-node=5 -m course_lib.demos.weight_sync --trainer zero3:dp3 --generator tp:2 --check
    torchrun --nproc-per-node=5 -m course_lib.demos.weight_sync --trainer tp:2 --generator fsdp:dp3 --check

One world of N = A + B ranks, two groups of it: ranks 0..A-1 train the course GPT with AdamW,
ranks A..A+B-1 generate with it. A side is KIND:SIZE, KIND one of

    zero3   ZeRO-3 flat units over dp ranks (course_lib.parallel.zero, sharding="flat"): dp2 or 2
    fsdp    per-parameter dim-0 rows over dp ranks (FSDP2's design, sharding="per_param")
    tp      tensor parallel (course_lib.parallel.tp: whole heads, MLP columns/rows, vocabulary rows)

After every step the plan (course_lib.checkpoint.live.plan_transfer: the intersections of the
trainer's global-offset boxes with the generator's, made once in the parent) moves the weights
by point-to-point, one packed buffer per (trainer, generator) pair; the generator copies them
into its model and computes the logits of a fixed prompt (its "generation" step). Rank 0 prints,
per sync, the bytes the trainers sent (CommTracer) beside the plan's formula (every element a
generator rank holds arrives once: 4 bytes x the elements its boxes cover, summed over generator
ranks), and the time of the live transfer beside saving and loading the same boxes through the
filesystem (course_lib.checkpoint's format, in --scratch-dir; times are printed, never checked).

--check exits 1 when, at any sync: the generator's weights (gathered whole through its own
layout) differ AT ALL from the trainer's (gathered through its own); the logits differ from the
single-process GPT's with the trainer's weights by more than LOGITS_RTOL of their largest size;
the filesystem round trip delivers other values than the live transfer; or the traced bytes
differ from the formula. A layout that cannot run (N != A + B, tp not dividing the heads) is
refused before any rank waits. (A few lines over 300: the sides, the run and the verdict read best
in one file.)
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.checkpoint import CheckpointReader, Piece, save_sharded
from course_lib.checkpoint.live import (
    check_world,
    dim0_placements,
    flat_holdings,
    gpt_tp_placements,
    gpt_zero3_units,
    new_buffers,
    plan_transfer,
    split_holdings,
    transfer,
)
from course_lib.comm.process_groups import new_groups
from course_lib.data import CharDataset, get_batch
from course_lib.demos.verdict import run_demo
from course_lib.model import GPT, GPTConfig
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.tp.apply import (
    apply_tensor_parallel,
    check_tensor_parallel,
    full_logits,
    gather_full_state_dict,
)
from course_lib.parallel.zero.apply import apply_zero
from course_lib.parallel.zero.per_param_optim import full_state_dict
from course_lib.runtime.device import rank_device
from course_lib.units import fmt_bytes

KINDS = {"zero3": "ZeRO-3 flat units", "fsdp": "per-parameter dim-0 rows", "tp": "tensor parallel"}
AXIS = {"zero3": "dp", "fsdp": "dp", "tp": "tp"}
# |generator logits - single-process logits| / max |single-process logits|. Both are fp32 with the
# very same weights (checked bit for bit first); tensor parallelism adds each row-parallel output
# as a sum of tp partial dot products (an all-reduce) where one process adds all d terms in one
# dot: the same terms in another order, each rounding ~2^-24 relative, over n_layer blocks and a
# LayerNorm. Measured on the demo's GPT (tp 2 and 4, 3 syncs): below 1e-6 on CPU ranks. 1e-5 keeps
# room for other kernels (a GPU's split reductions). Measured with the right weights and a wrong
# forward: one block's attn.proj missing its all-reduce moves the logits by 0.11 of their size,
# two heads' query rows swapped by 2.9e-3 (at initialisation, where attention is near uniform).
LOGITS_RTOL = 1e-5


@dataclass(frozen=True)
class Side:
    kind: str
    size: int

    def __str__(self) -> str:
        return f"{self.kind}:{'dp' if AXIS[self.kind] == 'dp' else ''}{self.size}"


def parse_side(flag: str, text: str) -> Side:
    """'zero3:dp2', 'zero3:2', 'fsdp:dp3', 'tp:2', 'tp:tp2' -> Side; ValueError naming the value."""
    kind, _, size = str(text).partition(":")
    if kind not in KINDS:
        raise ValueError(f"{flag}={text!r}: the kind must be one of {tuple(KINDS)} (KIND:SIZE, e.g. zero3:dp2, tp:2)")
    m = re.fullmatch(rf"(?:{AXIS[kind]})?(\d+)", size)
    if m is None:
        raise ValueError(f"{flag}={text!r}: the size must be {AXIS[kind]}N or N, N a positive int (e.g. "
                         f"{kind}:{AXIS[kind]}2)")
    return Side(kind, check_int(f"{flag} size", int(m.group(1))))


def demo_config() -> GPTConfig:
    """The tiny course GPT (4 heads: tp may be 1, 2 or 4), vocabulary 97: padded rows at tp = 2, 4."""
    return GPTConfig.tiny(CharDataset("train").vocab_size, block_size=32, n_layer=2, n_head=4, d_model=64)


def holdings(side: Side, model: GPT):
    """What each rank of `side` holds, as boxes of the plain GPT's parameters (live.py's Holdings)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if side.kind == "zero3":
        return flat_holdings(shapes, side.size, gpt_zero3_units(model))
    if side.kind == "fsdp":
        return split_holdings(shapes, dim0_placements(shapes, side.size), "dp")
    check_tensor_parallel(model.config, side.size)  # tp=3 must divide n_head=4, named in the parent
    return split_holdings(shapes, gpt_tp_placements(model, side.size))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True, help="KIND:SIZE of ranks 0..A-1 (zero3:dp2, fsdp:dp2, tp:2)")
    p.add_argument("--generator", required=True, help="KIND:SIZE of ranks A..A+B-1 (tp:2, zero3:dp2, ...)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, each followed by one sync")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--scratch-dir", default=None, help="where the filesystem round trip writes (every rank must "
                   "see it: on several machines a shared filesystem; default: a temporary directory)")
    p.add_argument("--check", action="store_true", help="exit 1 when a sync is not exact (see the docstring)")
    return p.parse_args(argv)


def build(args, world: int):
    """(args, config, plan), everything checked in the parent: ValueError otherwise."""
    check_int("--steps", args.steps)
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr} must be > 0")
    trainer, generator = parse_side("--trainer", args.trainer), parse_side("--generator", args.generator)
    config = demo_config()
    model = GPT(config)
    plan = plan_transfer(holdings(trainer, model), holdings(generator, model))
    check_world(plan, world)  # world_size=3: ... needs world_size = A + B = 4
    return args, trainer, generator, config, plan


class Party:
    """One rank's side: its sharded model and optimizer, its buffers in the plan's order, its full
    weights gathered through its own layout (collective over its group), its logits."""

    def __init__(self, side: Side, config: GPTConfig, group, lr: float, seed: int):
        self.side, self.group = side, group
        self.names = [n for n, _ in GPT(config).named_parameters()]
        model = GPT(config, seed=seed).to(rank_device())
        if side.kind == "tp":
            self.model = apply_tensor_parallel(model, group)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        else:
            extra = {"sharding": "per_param"} if side.kind == "fsdp" else {}
            self.model, self.opt = apply_zero(model, 3, torch.optim.AdamW, group, lr=lr, **extra)

    def buffers(self) -> list[torch.Tensor]:
        if self.side.kind == "zero3":  # the flat master shards, unit by unit (gpt_zero3_units' order)
            return [s.master.detach() for s in self.opt.shards]
        params = dict(self.model.named_parameters())  # tp pieces or dim-0 rows, by the plain names
        return [params[n].detach() for n in self.names]

    @torch.no_grad()
    def load(self, received: list[torch.Tensor]) -> None:
        for mine, new in zip(self.buffers(), received, strict=True):
            mine.copy_(new)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.side.kind != "tp":  # data parallel: this rank's rows of the batch
            n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
            rows = x.shape[0] // n
            x, y = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
        loss = self.model(x, y)[1]
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def full(self) -> dict[str, torch.Tensor]:
        if self.side.kind == "tp":
            full = gather_full_state_dict(self.model)
        else:
            full = full_state_dict(self.model, self.opt)
        return {n: full[n].detach().cpu() for n in self.names}

    @torch.no_grad()
    def logits(self, prompt: torch.Tensor) -> torch.Tensor:
        out = self.model(prompt)[0]
        if self.side.kind == "tp":  # each rank holds its vocabulary slice: gather it
            out = full_logits(self.model, out)
        return out.cpu()


def pieces(layout, rank: int, bufs) -> list[Piece]:
    return [Piece(f"model.{h.name}", layout.shapes[h.name], h.box, h.view(bufs)) for h in layout.held[rank]]


def run(args, trainer: Side, generator: Side, config: GPTConfig, plan):
    """Rank code: train, sync live, sync through files, generate; each rank's records, on every rank."""
    me, a = dist.get_rank(), plan.src.world
    groups, is_trainer = new_groups([range(a), range(a, plan.ranks)]), me < a
    party = Party(trainer if is_trainer else generator, config, groups[0 if is_trainer else 1], args.lr,
                  seed=0 if is_trainer else 1)  # the generator starts from other weights: the sync must move all
    (layout, r), dev = (plan.src, me) if is_trainer else (plan.dst, me - a), rank_device()
    data, gen = CharDataset("train", block_size=config.block_size), torch.Generator().manual_seed(0)
    prompt = get_batch(CharDataset("val", block_size=config.block_size), 2, torch.Generator().manual_seed(1))[0]
    root = [tempfile.mkdtemp(prefix="weight_sync_", dir=args.scratch_dir) if me == 0 else None]
    dist.broadcast_object_list(root, src=0)  # one scratch directory for the filesystem round trip
    records = []
    for step in range(1, args.steps + 1):
        x, y = get_batch(data, 4 * trainer.size, gen)  # the same batch on every trainer rank
        rec = {"step": step, "loss": party.train_step(x.to(dev), y.to(dev)) if is_trainer else None}
        dist.barrier()
        start = time.perf_counter()
        with CommTracer() as tracer:
            received = transfer(plan, party.buffers() if is_trainer else None)
        dist.barrier()
        rec["live_s"], rec["traffic"] = time.perf_counter() - start, tracer.total_bytes()
        path = f"{root[0]}/sync{step}"
        start = time.perf_counter()
        if is_trainer:
            save_sharded(path, pieces(layout, r, party.buffers()), group=party.group)
        dist.barrier()
        if not is_trainer:
            from_file = new_buffers(layout, r, device=dev)
            CheckpointReader(path, verify_hashes=False).fill(pieces(layout, r, from_file))
        dist.barrier()
        rec["file_s"] = time.perf_counter() - start
        if not is_trainer:
            rec["file_equal"] = all(torch.equal(f, g) for f, g in zip(from_file, received, strict=True))
            party.load(received)
            rec["logits"] = party.logits(prompt.to(dev))
        full = party.full()  # collective within the group
        if r == 0:  # one copy per side is enough: the gather gave every rank of the group the same
            rec["full"] = full
        records.append(rec)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    dist.barrier()
    if me == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    return everyone, prompt


def report(world, backend, built, result) -> int:
    """Rank 0: per sync, the bytes beside the formula and the two times; with --check the verdict."""
    args, trainer, generator, config, plan = built
    everyone, prompt = result
    a = plan.src.world
    formula, ref = plan.wanted_bytes(), GPT(config)
    print(f"weight sync on {world} ranks ({backend}): trainer {trainer} ({KINDS[trainer.kind]}, ranks 0..{a - 1}) "
          f"-> generator {generator} ({KINDS[generator.kind]}, ranks {a}..{world - 1}); {config}")
    print(f"plan: {sum(len(m) for m in plan.moves.values())} boxes in {len(plan.moves)} (trainer, generator) "
          f"pairs; formula 4 B x the elements the generator ranks hold = {fmt_bytes(formula)} per sync "
          f"(the parameters: {fmt_bytes(4 * ref.num_params())}; a tensor the generator replicates arrives "
          f"once per generator rank)")
    print(f"{'sync':>4} {'loss':>9} {'sent (traced)':>14} {'received':>10} {'formula':>10} {'live':>9} "
          f"{'file save+load':>15}")
    failed = False
    for k in range(args.steps):
        recs = [everyone[i][k] for i in range(world)]
        sent = sum(x["traffic"]["bytes_sent"] for x in recs[:a])
        got = sum(x["traffic"]["bytes_recv"] for x in recs[a:])
        loss = sum(x["loss"] for x in recs[:a]) / a
        live, file = max(x["live_s"] for x in recs), max(x["file_s"] for x in recs)
        print(f"{k + 1:>4} {loss:>9.5f} {fmt_bytes(sent):>14} {fmt_bytes(got):>10} {fmt_bytes(formula):>10} "
              f"{1e3 * live:>7.1f}ms {1e3 * file:>13.1f}ms", flush=True)
        if not args.check:
            continue
        want, have = recs[0]["full"], recs[a]["full"]
        differ = [n for n in want if not torch.equal(want[n], have[n])]
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(want[n])
            expected = ref(prompt)[0]
        scale = float(expected.abs().max())
        worst = max(float((x["logits"] - expected).abs().max()) for x in recs[a:])
        logits_ok = worst <= LOGITS_RTOL * scale  # False for a NaN
        files_ok = all(x["file_equal"] for x in recs[a:])
        bytes_ok = sent == got == formula == sum(plan.pair_bytes().values())
        print(f"     weights bit for bit: {'OK' if not differ else 'MISMATCH in ' + ', '.join(differ)}; "
              f"logits largest difference {worst:.2e} (tolerance {LOGITS_RTOL:.0e} x {scale:.3f}): "
              f"{'OK' if logits_ok else 'MISMATCH'}; file round trip equal: {'OK' if files_ok else 'MISMATCH'}; "
              f"bytes = formula: {'OK' if bytes_ok else 'MISMATCH'}", flush=True)
        failed |= bool(differ) or not logits_ok or not files_ok or not bytes_ok
    if args.check:
        print(f"verdict: {'MISMATCH' if failed else 'OK'}", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse(argv)
    return run_demo("weight_sync", args, build, run, report)


if __name__ == "__main__":
    sys.exit(main())
