"""ZeRO stage S against the single-process run, and what each rank holds.

    torchrun --nproc-per-node=4 -m course_lib.demos.zero --stage 3
    torchrun --nproc-per-node=8 -m course_lib.demos.zero --stage 2 --bf16 --offload --steps 20
    torchrun --nproc-per-node=4 -m course_lib.demos.zero --stage 3 --sharding per_param --hsdp 2 \
             --offload nvme --offload-dir /tmp/zero_nvme --check
    torchrun --nproc-per-node=4 -m course_lib.demos.zero --stage 1 --optimizer muon --muon-method owner --check

Every rank trains the course GPT with `apply_zero(model, S, torch.optim.AdamW)` on its share
of each batch (course_lib.parallel.zero.train_zero). Rank 0 also trains the same model alone
on the whole batch (train_zero_reference) and prints the two loss curves side by side, then the bytes
of parameters, gradients and optimizer state each rank holds (measured from its tensors)
beside notebook 01's formula (course_lib.estimate.model_state_bytes per flat unit; per-parameter
sharding: 4, 4 and 8 bytes per local element, sum over W of ceil(d0/S) * row). --check exits
non-zero when a step's mean loss differs from the single process's by more than
course_lib.tolerances.adamw_loss_atol(lr) (fp32) or BF16_LOSS_ATOL (bf16, the loss computed from
fp32 logits in both runs), or when the first step's gradient norm differs by more than
FIRST_GRAD_NORM_RTOL of it: the reasons are there. In bf16 the loss alone cannot catch a wrong
reduction; the first gradient norm, taken before AdamW amplifies any rounding, does.

--optimizer muon (with --muon-method gather|owner|balanced) trains with Muon on the hidden matrices and
AdamW on the rest (techniques.muon.MuonAdamW): the matrices' momentum row-sharded
(parallel.zero.muon.ShardedMuon), the rest ZeRO-1 (ShardedOptimizer); it prints the losses beside
the single process's and each rank's Muon bytes per step, traced, beside estimate.muon's formula.
--check there: MUON_LOSS_ATOL (below, the reason) and bytes equal to the formula. (A little over 300
lines: the Muon run, its table and its check sit beside the AdamW ones so one command offers both.)

In a notebook: `run_on_ranks(zero_demo, stage=3, world_size=4)`, `run_on_ranks(muon_demo, "owner", world_size=4)`.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.model import GPT
from course_lib.model import GPTConfig
from course_lib.parallel.zero import expected_state_bytes, measure_zero_step, train_zero_reference, train_zero
from course_lib.parallel.zero.apply import apply_zero
from course_lib.parallel.zero.nvme import NVMeStore, check_nvme_dir
from course_lib.parallel.zero.per_param_optim import check_per_param_args, local_elements
from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.tolerances import BF16_LOSS_ATOL, adamw_loss_atol, first_grad_norm_check
from course_lib.train import StepHooks, TrainConfig, share_rows, train_loop
from course_lib.units import fmt_bytes
from course_lib.runtime.device import rank_device
from course_lib.estimate.muon import METHODS, muon_traffic
from course_lib.observe import CommTracer
from course_lib.parallel.zero.muon import ShardedMuon
from course_lib.parallel.zero.sharded_optimizer import ShardedOptimizer
from course_lib.techniques.muon import MuonAdamW, muon_split

MUON_LR = 0.02  # Jordan et al. 2024's Muon learning rate for the hidden matrices; AdamW keeps TrainConfig's lr
# |loss difference| of a correct sharded Muon run and the single process: the ranks' mean gradient
# is a sum in another order (fp32 rounding), and Newton-Schulz rounds its input to bf16, where a
# last-bit difference flips an element's rounding (2^-8 relative) and the 5 iterations spread it over
# the matrix; Muon's update has singular values < 1.5 whatever its input, so a flip moves the
# parameters by ~lr * 2^-8 at most; the AdamW parameters add adamw_loss_atol's share (7e-5 at its lr).
# Measured on the demo's GPT (5 steps, 2 and 4 ranks, each method): at most 3.4e-5. Each rank
# orthogonalising only its own rows of each matrix (the flat design's mistake) moved it by 9.5e-3.
MUON_LOSS_ATOL = 1e-3


def _per_param_bytes(config, cfg, bf16, hsdp, offload, offload_dir) -> tuple[dict, dict]:
    """Measured after one step (local shards, their fp32 grads, Adam's m and v in memory, NVMe
    files) and the formula from the local element count L: 4L, 4L, 8L (NVMe: 8L in files)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kw = {"sharding": "per_param", "hsdp": hsdp, "compute_dtype": torch.bfloat16 if bf16 else None}
    if offload == "nvme":
        kw["offload_dir"] = offload_dir
    model, opt = apply_zero(GPT(config, seed=cfg.seed), 3, torch.optim.AdamW, None,
                            "nvme" if offload == "nvme" else False, lr=cfg.lr, foreach=False, **kw)
    measured = {}
    hooks = StepHooks(clip_grad_norm=opt.clip_grad_norm_, sync_gradients=lambda: measured.update(
        grads=sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())))
    one = TrainConfig(steps=1, batch_size=cfg.batch_size, grad_clip=1.0, progress=False)
    train_loop(model, opt, CharDataset("train", block_size=config.block_size), one, hooks,
               rows=share_rows(rank, n, cfg.batch_size))
    measured["params"] = sum(p.numel() * p.element_size() for p in model.parameters())
    measured["optimizer"] = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                                if torch.is_tensor(v) and v.dim() > 0)
    measured["host"] = opt.store.summary()["nvme_files"] if opt.store is not None else 0
    local = local_elements(GPT(config), "block", n // hsdp)
    formula = {"params": 4 * local, "grads": 4 * local, "optimizer": 0 if opt.store else 8 * local,
               "host": 8 * local if opt.store else 0}
    return measured, formula


def zero_demo(stage: int, steps: int = 5, bf16: bool = False, offload=False, batch_size: int = 8,
              sharding: str = "flat", hsdp: int = 1, offload_dir: str | None = None) -> dict:
    """Rank code. offload: False, True / "host" or "nvme" (per_param, under offload_dir). Returns
    {"losses": mean over ranks per step, "reference": single-process losses (rank 0; None
    elsewhere), "grad_norms" / "reference_norms": each step's global gradient norm before
    clipping (the reference's on rank 0), "measured": this rank's bytes after backward (grads)
    and after the step (params, optimizer, host), "formula": the same from the formula}. bf16:
    both runs compute the loss from fp32 logits (train_zero's loss_dtype)."""
    n = dist.get_world_size()
    if batch_size % n:
        raise ValueError(f"batch_size={batch_size} must be divisible by the {n} ranks")
    config = GPTConfig.tiny(CharDataset("train").vocab_size)
    cfg = TrainConfig(steps=steps, batch_size=batch_size, grad_clip=1.0, progress=False)
    dtype = torch.bfloat16 if bf16 else None
    same = {"compute_dtype": dtype, "loss_dtype": torch.float32 if bf16 else None, "record_grad_norms": True}
    if sharding == "per_param":
        res = train_zero(config, cfg, 3, offload="nvme" if offload == "nvme" else False, sharding="per_param",
                         hsdp=hsdp, offload_dir=offload_dir if offload == "nvme" else None, **same)
    else:
        res = train_zero(config, cfg, stage, offload=bool(offload), **same)
    losses = torch.tensor(res.train_losses, dtype=torch.float64, device=rank_device())
    dist.all_reduce(losses)
    ref = train_zero_reference(config, cfg, **same) if dist.get_rank() == 0 else None
    run = {"losses": (losses / n).tolist(), "reference": ref.train_losses if ref else None,
           "grad_norms": res.grad_norms, "reference_norms": ref.grad_norms if ref else None}
    if sharding == "per_param":
        measured, formula = _per_param_bytes(config, cfg, bf16, hsdp, offload, offload_dir)
        return run | {"measured": measured, "formula": formula, "tier": "nvme" if offload == "nvme" else "host"}
    offload = bool(offload)
    mem = measure_zero_step(config, cfg, stage, offload=offload, compute_dtype=dtype)
    measured = {"params": mem["after_step"]["params"], "grads": mem["after_backward"]["grads"],
                "optimizer": mem["after_step"]["optimizer"], "host": mem["after_step"]["host"]}
    formula = expected_state_bytes(mem["unit_sizes"], "bf16_mixed" if bf16 else "fp32", stage, n)
    if offload:
        formula["host"], formula["optimizer"] = formula["optimizer"], 0
    return run | {"measured": measured, "formula": formula, "tier": "host"}


def _muon_run(config, cfg, method, rows, tracer):
    """The GPT trained with MuonAdamW: sharded (method set) or the single process (method None)."""
    model = GPT(config, seed=cfg.seed)
    if method is None:
        opt = MuonAdamW(model, lr=MUON_LR, adamw_lr=cfg.lr)
    else:
        opt = MuonAdamW(model, lr=MUON_LR, adamw_lr=cfg.lr, muon_class=partial(ShardedMuon, method=method),
                        adamw_class=partial(ShardedOptimizer, optimizer_class=torch.optim.AdamW))
        muon_step = opt.muon.step

        def traced_step():
            with tracer:
                muon_step()
        opt.muon.step = traced_step
    res = train_loop(model, opt, CharDataset("train", block_size=config.block_size), cfg, StepHooks(), rows=rows)
    return model, opt, res


def muon_demo(method: str, steps: int = 5, batch_size: int = 8) -> dict:
    """Rank code: {"losses" (mean over ranks), "reference" (rank 0), "bytes": this rank's Muon
    bytes per step, traced, "formula": estimate.muon's, "ns_flops": its Newton-Schulz FLOPs per
    step (counted by ShardedMuon), "shapes"}."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if batch_size % n:
        raise ValueError(f"batch_size={batch_size} must be divisible by the {n} ranks")
    config = GPTConfig.tiny(CharDataset("train").vocab_size)
    cfg = TrainConfig(steps=steps, batch_size=batch_size, grad_clip=0.0, progress=False)
    tracer = CommTracer()
    model, opt, res = _muon_run(config, cfg, method, share_rows(rank, n, batch_size), tracer)
    losses = torch.tensor(res.train_losses, dtype=torch.float64, device=rank_device())
    dist.all_reduce(losses)
    ref = _muon_run(config, cfg, None, None, None)[2].train_losses if rank == 0 else None
    shapes = [tuple(p.shape) for p in muon_split(model)[0]]
    per_step = {op: {k: v // steps for k, v in rec.items()} for op, rec in tracer.summary().items()}
    return {"losses": (losses / n).tolist(), "reference": ref, "bytes": per_step,
            "formula": muon_traffic(shapes, n, method)[rank], "ns_flops": opt.muon.ns_flops // steps, "shapes": shapes}


def _loss_table(first: dict, title: str, ours: str) -> list[str]:
    """The title, then each step's loss (mean over the ranks) beside the single process's."""
    w = len(ours) + 1
    lines = [title, f"{'step':>4} {ours:>{w}} {'single process':>15}"]
    for i, (a, b) in enumerate(zip(first["losses"], first["reference"]), start=1):
        lines.append(f"{i:>4} {a:>{w}.5f} {b:>15.5f}")
    return lines


def format_muon(per_rank: list[dict], method: str) -> str:
    first = per_rank[0]
    lines = _loss_table(first, f"Muon ({method}) + AdamW on {len(per_rank)} ranks vs one process (same data)",
                        "sharded (mean of ranks)")
    lines.append(f"Muon bytes per step ({len(first['shapes'])} matrices), traced / formula (estimate.muon):")
    for r, out in enumerate(per_rank):
        sent = sum(v["bytes_sent"] for v in out["bytes"].values())
        recv = sum(v["bytes_recv"] for v in out["bytes"].values())
        f_sent = sum(v["bytes_sent"] for v in out["formula"].values())
        f_recv = sum(v["bytes_recv"] for v in out["formula"].values())
        lines.append(f"rank {r}: sent {fmt_bytes(sent)} / {fmt_bytes(f_sent)}, received {fmt_bytes(recv)} / "
                     f"{fmt_bytes(f_recv)}")
    return "\n".join(lines)


def check_muon(per_rank: list[dict]) -> tuple[bool, str]:
    """(passed, verdict): every step's loss within MUON_LOSS_ATOL, every rank's bytes = the formula."""
    first = per_rank[0]
    diffs = [abs(a - b) for a, b in zip(first["losses"], first["reference"])]
    diff = max(diffs) if all(d == d for d in diffs) else float("nan")
    loss_ok = diff <= MUON_LOSS_ATOL
    bytes_ok = all(out["bytes"] == out["formula"] for out in per_rank)
    ok = loss_ok and bytes_ok
    return ok, (f"check {'passed' if ok else 'FAILED'}: largest loss difference {diff:.2e} "
                f"{'<=' if loss_ok else '>'} tolerance {MUON_LOSS_ATOL:.0e}; Muon bytes "
                f"{'equal' if bytes_ok else 'DIFFER from'} the formula on every rank")


def format_demo(per_rank: list[dict], stage: int) -> str:
    first = per_rank[0]
    lines = _loss_table(first, f"ZeRO stage {stage} on {len(per_rank)} ranks vs one process (same data, same AdamW)",
                        "ZeRO (mean of ranks)")
    lines.append("bytes each rank holds, measured / formula (notebook 01):")
    heads = ("params", "grads", "optimizer", first.get("tier", "host"))
    lines.append(f"{'rank':>4} " + " ".join(f"{k:>23}" for k in heads))
    for r, out in enumerate(per_rank):
        cells = [f"{fmt_bytes(out['measured'][k]):>10} / {fmt_bytes(out['formula'].get(k, 0)):>10}"
                 for k in ("params", "grads", "optimizer", "host")]
        lines.append(f"{r:>4} " + " ".join(cells))
    return "\n".join(lines)


def check_run(first: dict, bf16: bool, lr: float) -> tuple[bool, str]:
    """(passed, the verdict line) for rank 0's zero_demo result: every step's mean loss within
    adamw_loss_atol(lr) (fp32) or BF16_LOSS_ATOL (bf16) of the single process's, and the first
    step's gradient norm within FIRST_GRAD_NORM_RTOL (course_lib.tolerances, the reasons)."""
    diffs = [abs(a - b) for a, b in zip(first["losses"], first["reference"])]
    diff = max(diffs) if all(d == d for d in diffs) else float("nan")  # a NaN loss is the largest difference
    tol = BF16_LOSS_ATOL if bf16 else adamw_loss_atol(lr)
    loss_ok = diff <= tol  # False for a NaN
    norm_ok, rel, rtol = first_grad_norm_check(first["grad_norms"][0], first["reference_norms"][0],
                                               "bf16" if bf16 else "fp32")
    ok = loss_ok and norm_ok
    norm, ref = first["grad_norms"][0], first["reference_norms"][0]
    return ok, (f"check {'passed' if ok else 'FAILED'}: largest loss difference {diff:.2e} "
                f"{'<=' if loss_ok else '>'} tolerance {tol:.2e}; first gradient norm {norm:.6g} vs {ref:.6g}, "
                f"relative difference {rel:.2e} {'<=' if norm_ok else '>'} {rtol:.2e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True, help="0 (DDP), 1, 2 or 3 (FSDP)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 masters")
    parser.add_argument("--offload", nargs="?", const="host", default=False, choices=("host", "nvme"),
                        help="optimizer state and step on the host (--offload), or on disk (--offload nvme)")
    parser.add_argument("--offload-dir", default=None, help="--offload nvme: the directory for the state files")
    parser.add_argument("--sharding", default="flat", choices=("flat", "per_param"),
                        help="stage 3: one flat buffer per unit, or each parameter on dim 0 (FSDP2)")
    parser.add_argument("--hsdp", type=int, default=1, help="per_param: R replicas of an N/R-rank shard group")
    parser.add_argument("--check", action="store_true", help="exit non-zero beyond the loss tolerance")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                        help="muon: Muon on the hidden matrices (momentum row-sharded), AdamW (ZeRO-1) on the rest")
    parser.add_argument("--muon-method", default="gather", choices=METHODS,
                        help="--optimizer muon: who runs Newton-Schulz on each matrix")
    args = parser.parse_args(argv)
    if args.optimizer == "muon":
        if args.stage != 1 or args.bf16 or args.offload or args.sharding != "flat":
            parser.error("--optimizer muon runs ZeRO-1 in fp32: --stage 1, without --bf16, --offload, --sharding")
        if args.steps < 1:
            parser.error(f"--steps={args.steps} must be >= 1")
        return _main_muon(args)
    if args.stage not in (0, 1, 2, 3):
        parser.error(f"--stage={args.stage} must be 0, 1, 2 or 3")
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if args.offload and args.stage == 0:
        parser.error("--offload needs --stage 1, 2 or 3")
    if args.sharding == "per_param" and args.stage != 3:
        parser.error(f"--sharding per_param needs --stage 3 (got --stage {args.stage})")
    if args.sharding == "flat" and (args.hsdp != 1 or args.offload == "nvme"):
        parser.error("--hsdp and --offload nvme need --sharding per_param")
    if args.sharding == "per_param":
        if args.offload == "host":
            parser.error("--sharding per_param offloads to --offload nvme (with --offload-dir DIR)")
        try:  # before any rank waits: the same check every rank would make
            world = int(os.environ.get("WORLD_SIZE", "1"))
            check_per_param_args(world, hsdp=args.hsdp, offload=args.offload or False, offload_dir=args.offload_dir)
            if args.offload == "nvme":  # writable, with room for every rank's files
                model = GPT(GPTConfig.tiny(CharDataset("train").vocab_size))
                check_nvme_dir(args.offload_dir, NVMeStore.bytes_needed(local_elements(model, "block",
                                                                                      world // args.hsdp)) * world)
        except ValueError as e:
            parser.error(str(e))
    init_from_env()
    failed = False
    try:
        n = dist.get_world_size()
        out = zero_demo(args.stage, args.steps, args.bf16, args.offload, batch_size=8 * n, sharding=args.sharding,
                        hsdp=args.hsdp, offload_dir=args.offload_dir)
        gathered = [None] * n
        dist.all_gather_object(gathered, out)
        if dist.get_rank() == 0:
            print(format_demo(gathered, args.stage), flush=True)
            if args.check:
                ok, verdict = check_run(gathered[0], args.bf16, TrainConfig().lr)
                print(verdict, flush=True)
                failed = not ok
    finally:
        leave_process_group()
    if failed:
        raise SystemExit(1)


def _main_muon(args):
    init_from_env()
    failed = False
    try:
        n = dist.get_world_size()
        out = muon_demo(args.muon_method, args.steps, batch_size=8 * n)
        gathered = [None] * n
        dist.all_gather_object(gathered, out)
        if dist.get_rank() == 0:
            print(format_muon(gathered, args.muon_method), flush=True)
            if args.check:
                ok, verdict = check_muon(gathered)
                print(verdict, flush=True)
                failed = not ok
    finally:
        leave_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
