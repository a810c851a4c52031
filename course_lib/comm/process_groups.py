"""Creating process groups: the one place course_lib calls torch.distributed's group constructor.

    new_groups(rank_lists)          one group per list of ranks, in order; every group
    own_group(rank_lists, rank)     the same, and the group `rank` belongs to

Creating a group is collective over the whole world, not only its members: every rank calls
these with the same lists in the same order (groups are matched by the order they are made),
and a rank keeps a placeholder for each group it is not in, never to be used. The mesh
(course_lib.parallel.mesh) makes its derived groups here, and so do the few places that build
groups outside a mesh on purpose: the measured collective table's sub-groups, the broken run's
results channel and the debugging catalogue's deliberately wrong tensor- and data-parallel
groups. (parallel/zero/hsdp.py builds its shard and replica groups itself.)
torch.distributed is imported at call time: the estimator imports comm.measured, which imports
this module, where torch need not be installed.
"""

from __future__ import annotations


def new_groups(rank_lists) -> list:
    """One process group per list of ranks in `rank_lists`, created in order on every rank."""
    import torch.distributed as dist

    return [dist.new_group(list(ranks)) for ranks in rank_lists]


def own_group(rank_lists, rank: int):
    """new_groups(rank_lists), and of them the one whose ranks hold `rank` (None if none does)."""
    rank_lists = [list(ranks) for ranks in rank_lists]
    mine = [g for g, ranks in zip(new_groups(rank_lists), rank_lists) if rank in ranks]
    return mine[0] if mine else None
