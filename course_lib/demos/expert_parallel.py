"""Expert parallelism on real ranks: losses against the single-process MoE, and the expert load.

    torchrun --nproc-per-node=4 -m course_lib.demos.expert_parallel --n-experts 8 --top-k 2 --steps 10

Every rank keeps n_experts / ep experts of each layer and its own share of each batch; the
tokens travel to their experts and back by two all-to-alls per layer (course_lib.parallel.ep).
Rank 0 also trains the single-process MoE on the same shares and prints both loss curves (the
mean of the ranks' losses against the reference's), then the tokens each expert received on one
more batch, summed over the ranks, and the tokens dropped by the capacity limit.

The frontier options (course_lib.model.moe_config.MoEGPTConfig), each checked against the
single process the same way:

    --n-shared-experts S        S experts every token passes through (replicated on every rank)
    --router sigmoid            sigmoid scores, the chosen k renormalised (DeepSeek-V3)
    --balance bias|aux|none     auxiliary-loss-free bias balancing, the Switch loss, or neither
    --max-ranks-per-token M     device-limited routing: each token's experts on at most M ranks
    --check                     print each step's verdict; the demo always exits 1 on a mismatch

    torchrun --nproc-per-node=2 -m course_lib.demos.expert_parallel --n-experts 8 --top-k 4 \
        --n-shared-experts 1 --router sigmoid --balance bias --max-ranks-per-token 1 --check

In a notebook: `course_lib.parallel.ep.run_expert_parallel(ParallelDims(ep=world_size), config, train_cfg)`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from course_lib.data import CharDataset, get_batch
from course_lib.model import GPT, GPTConfig
from course_lib.model.moe import BALANCES, ROUTERS, routing_stats
from course_lib.model.moe_config import MoEGPTConfig
from course_lib.parallel.ep import apply_expert_parallel, check_expert_parallel, train_expert_parallel, train_moe_reference
from course_lib.runtime.device import rank_device
from course_lib.runtime.launch import init_from_env, leave_process_group
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig

LR = 1e-2
# What rounding can move a loss by after AdamW steps at LR (2.1e-4, course_lib.tolerances);
# GPUs (TF32 matmuls) round more coarsely and may need a larger --tolerance.
TOLERANCE = adamw_loss_atol(LR)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--n-experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="0 means no capacity limit")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences), split over ranks")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest accepted |loss difference|")
    parser.add_argument("--n-shared-experts", type=int, default=0, help="experts every token passes through")
    parser.add_argument("--router", choices=ROUTERS, default="softmax")
    parser.add_argument("--balance", choices=BALANCES, default="aux",
                        help="aux: Switch loss; bias: auxiliary-loss-free bias (Wang et al. 2024); none")
    parser.add_argument("--max-ranks-per-token", type=int, default=None, metavar="M",
                        help="device-limited routing: each token's experts on at most M ranks")
    parser.add_argument("--check", action="store_true", help="print every step's verdict against the single process")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if not args.tolerance >= 0:
        parser.error(f"--tolerance={args.tolerance} must be >= 0")
    if args.batch_size % world:
        parser.error(f"--batch-size={args.batch_size} must be divisible by the {world} ranks")
    try:  # the model's own checks (top_k, capacity factor, M, ...) and ep dividing n_experts
        config = GPTConfig.tiny(CharDataset("train", 32).vocab_size, block_size=32, n_layer=args.n_layer,
                                d_model=args.d_model, n_experts=args.n_experts, top_k=args.top_k,
                                capacity_factor=args.capacity_factor or None)
        frontier = dict(n_shared_experts=args.n_shared_experts, router=args.router, balance=args.balance,
                        max_groups_per_token=args.max_ranks_per_token)
        if frontier != dict(n_shared_experts=0, router="softmax", balance="aux", max_groups_per_token=None):
            if args.max_ranks_per_token is not None:  # the groups are the ranks
                frontier["expert_groups"] = world
            config = MoEGPTConfig.from_config(config, **frontier)
        check_expert_parallel(config, world)
    except ValueError as e:
        parser.error(str(e))
    return args, config


def expert_load(config, seed: int = 0):
    """One forward of the EP model on one more batch per rank: (routed, kept) per layer, summed over ranks."""
    model = apply_expert_parallel(GPT(config, seed=seed).to(rank_device()))
    dataset = CharDataset("train", config.block_size)
    x, _ = get_batch(dataset, 4, torch.Generator().manual_seed(1000 + dist.get_rank()))
    with torch.no_grad():
        model(x.to(rank_device()))
    counts = torch.stack([torch.stack([s.routed, s.kept]) for s in routing_stats(model)]).to(rank_device())
    dist.all_reduce(counts)
    return counts.cpu()


def main(argv=None):
    args, config = parse(argv)
    backend = init_from_env(timeout_s=120)  # a stuck rank becomes an error, not a hang
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=LR, progress=False)
        mine = train_expert_parallel(config, train_cfg)
        losses = torch.tensor(mine.train_losses, dtype=torch.float64, device=rank_device())
        dist.all_reduce(losses)
        losses = (losses / world).cpu()
        load = expert_load(config)
        if rank == 0:
            ref = train_moe_reference(config, train_cfg, shares=world)
            print(f"expert parallel on {world} ranks ({backend}): {config.n_experts} experts, "
                  f"{config.n_experts // world} per rank, top_k={config.top_k}, "
                  f"capacity_factor={config.capacity_factor}")
            if isinstance(config, MoEGPTConfig):
                print(f"shared experts {config.n_shared_experts}, router {config.router}, balance "
                      f"{config.balance}, at most {config.max_groups_per_token or world} ranks per token")
            print(f"{'step':>5} {'EP loss (mean of ranks)':>24} {'single process':>15}")
            for step, (a, b) in enumerate(zip(losses.tolist(), ref.train_losses), start=1):
                verdict = ("  ok" if abs(a - b) < args.tolerance else "  DIFFERS") if args.check else ""
                print(f"{step:>5} {a:>24.6f} {b:>15.6f}{verdict}")
            diff = max(abs(a - b) for a, b in zip(losses.tolist(), ref.train_losses))
            print(f"max |loss difference| = {diff:.2e}: {'MATCH' if diff < args.tolerance else 'MISMATCH'}")
            for layer, (routed, kept) in enumerate(load.tolist()):
                dropped = sum(routed) - sum(kept)
                print(f"layer {layer}: tokens per expert {routed}, dropped {dropped} of {sum(routed)}")
        ok = torch.tensor([rank != 0 or diff < args.tolerance], dtype=torch.int32, device=rank_device())
        dist.broadcast(ok, src=0)  # every rank waits for rank 0's reference, then all leave together
        if not ok.item():
            raise SystemExit(1)
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
