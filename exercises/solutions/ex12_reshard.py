"""Exercise 12, reference solution: reshard flat ZeRO shards from N to M ranks by global offsets."""

import torch


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    size = -(-numel // world_size)
    return rank * size, (rank + 1) * size


def read_plan(numel: int, old_world: int, new_world: int, new_rank: int) -> list[tuple[int, int, int, int]]:
    start, stop = shard_range(numel, new_world, new_rank)
    stop = min(stop, numel)  # the padding is never read
    plan = []
    for old in range(old_world):
        a, b = shard_range(numel, old_world, old)
        lo, hi = max(start, a), min(stop, b)  # the overlap, in global offsets
        if lo < hi:
            plan.append((old, lo - a, hi - a, lo - start))
    return plan


def reshard_flat(old_shards: list[torch.Tensor], numel: int, new_world: int) -> list[torch.Tensor]:
    size = -(-numel // new_world)
    out = []
    for new_rank in range(new_world):
        shard = torch.zeros(size, dtype=old_shards[0].dtype)
        for old, src_start, src_stop, dst_start in read_plan(numel, len(old_shards), new_world, new_rank):
            shard[dst_start:dst_start + src_stop - src_start] = old_shards[old][src_start:src_stop]
        out.append(shard)
    return out
