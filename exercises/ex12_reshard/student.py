"""Exercise 12: reshard a flat ZeRO shard set from N ranks to M ranks by global offsets. Fill
in the three functions, then run the check cells of ex12_reshard.ipynb. Each check prints PASS
when your code is right.

The layout (notebook 08 and notebook 12, section 4): a flat unit of P elements is padded with
zeros to N * S elements, S = ceil(P / N), and rank r of N owns the global range
[r * S, (r + 1) * S). The last ranks' ranges may run into the padding (or lie wholly in it).
A saved shard is that range's S elements, padding included.

Work with global offsets only: never concatenate all old shards into one vector (at scale no
process can hold it). A new rank reads, from each old shard that overlaps its range, just the
overlapping slice.
"""

import torch


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s shard of a flat unit of `numel` elements on `world_size` ranks:
    start = rank * S, stop = (rank + 1) * S with S = ceil(numel / world_size). stop may exceed
    numel (padding). Raise ValueError unless 0 <= rank < world_size."""
    raise NotImplementedError("exercise 12: write shard_range")


def read_plan(numel: int, old_world: int, new_world: int, new_rank: int) -> list[tuple[int, int, int, int]]:
    """What new rank `new_rank` of `new_world` reads from the shards saved by `old_world` ranks:
    a list of (old_rank, src_start, src_stop, dst_start), one per old rank it reads from, in
    increasing old_rank, where old shard [src_start, src_stop) (offsets LOCAL to that old shard)
    goes to position dst_start of the new shard (LOCAL to the new shard). Only real elements (global offset < numel):
    padding is never read, and old ranks that do not overlap do not appear.

    Example: numel=10, 4 old ranks (S=3: [0,3) [3,6) [6,9) [9,12)), 3 new ranks (S'=4):
    new rank 1 owns [4, 8) -> [(1, 1, 3, 0), (2, 0, 2, 2)].
    """
    raise NotImplementedError("exercise 12: write read_plan")


def reshard_flat(old_shards: list[torch.Tensor], numel: int, new_world: int) -> list[torch.Tensor]:
    """The new_world padded shards (S' = ceil(numel / new_world) elements each, same dtype as the
    old ones, zeros in the padding) built from the len(old_shards) saved shards with read_plan.
    Do not modify the old shards."""
    raise NotImplementedError("exercise 12: write reshard_flat")
