"""ZeRO stage S against the single-process run, and what each rank holds.

    torchrun --nproc-per-node=4 -m course_lib.demos.zero --stage 3
    torchrun --nproc-per-node=8 -m course_lib.demos.zero --stage 2 --bf16 --offload --steps 20

Every rank trains the course GPT with `apply_zero(model, S, torch.optim.AdamW)` on its share
of each batch (course_lib.parallel.zero.train_zero). Rank 0 also trains the same model alone
on the whole batch (train_zero_reference) and prints the two loss curves side by side, then the bytes
of parameters, gradients and optimizer state each rank holds (measured from its tensors)
beside notebook 01's formula (course_lib.estimate.model_state_bytes per flat unit).

In a notebook: `run_on_ranks(zero_demo, stage=3, world_size=4)`.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib.model import GPTConfig
from course_lib.parallel.zero import expected_state_bytes, measure_zero_step, train_zero_reference, train_zero
from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.train import TrainConfig
from course_lib.units import fmt_bytes


def zero_demo(stage: int, steps: int = 5, bf16: bool = False, offload: bool = False, batch_size: int = 8) -> dict:
    """Rank code. Returns {"losses": mean over ranks per step, "reference": single-process losses
    (rank 0; None elsewhere), "measured": this rank's bytes after backward (grads) and after the
    step (params, optimizer, host), "formula": the same from the formula}."""
    n = dist.get_world_size()
    if batch_size % n:
        raise ValueError(f"batch_size={batch_size} must be divisible by the {n} ranks")
    config = GPTConfig.tiny(CharDataset("train").vocab_size)
    cfg = TrainConfig(steps=steps, batch_size=batch_size, grad_clip=1.0, progress=False)
    dtype = torch.bfloat16 if bf16 else None
    res = train_zero(config, cfg, stage, offload=offload, compute_dtype=dtype)
    losses = torch.tensor(res.train_losses, dtype=torch.float64)
    dist.all_reduce(losses)
    mem = measure_zero_step(config, cfg, stage, offload=offload, compute_dtype=dtype)
    measured = {"params": mem["after_step"]["params"], "grads": mem["after_backward"]["grads"],
                "optimizer": mem["after_step"]["optimizer"], "host": mem["after_step"]["host"]}
    formula = expected_state_bytes(mem["unit_sizes"], "bf16_mixed" if bf16 else "fp32", stage, n)
    if offload:
        formula["host"], formula["optimizer"] = formula["optimizer"], 0
    reference = train_zero_reference(config, cfg, compute_dtype=dtype).train_losses if dist.get_rank() == 0 else None
    return {"losses": (losses / n).tolist(), "reference": reference, "measured": measured, "formula": formula}


def format_demo(per_rank: list[dict], stage: int) -> str:
    first = per_rank[0]
    lines = [f"ZeRO stage {stage} on {len(per_rank)} ranks vs one process (same data, same AdamW)",
             f"{'step':>4} {'ZeRO (mean of ranks)':>21} {'single process':>15}"]
    for i, (a, b) in enumerate(zip(first["losses"], first["reference"]), start=1):
        lines.append(f"{i:>4} {a:>21.5f} {b:>15.5f}")
    lines.append("bytes each rank holds, measured / formula (notebook 01):")
    lines.append(f"{'rank':>4} " + " ".join(f"{k:>23}" for k in ("params", "grads", "optimizer", "host")))
    for r, out in enumerate(per_rank):
        cells = [f"{fmt_bytes(out['measured'][k]):>10} / {fmt_bytes(out['formula'].get(k, 0)):>10}"
                 for k in ("params", "grads", "optimizer", "host")]
        lines.append(f"{r:>4} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True, help="0 (DDP), 1, 2 or 3 (FSDP)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 masters")
    parser.add_argument("--offload", action="store_true", help="optimizer state and step on the host")
    args = parser.parse_args(argv)
    if args.stage not in (0, 1, 2, 3):
        parser.error(f"--stage={args.stage} must be 0, 1, 2 or 3")
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if args.offload and args.stage == 0:
        parser.error("--offload needs --stage 1, 2 or 3")
    init_from_env()
    try:
        n = dist.get_world_size()
        out = zero_demo(args.stage, args.steps, args.bf16, args.offload, batch_size=8 * n)
        gathered = [None] * n
        dist.all_gather_object(gathered, out)
        if dist.get_rank() == 0:
            print(format_demo(gathered, args.stage), flush=True)
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
