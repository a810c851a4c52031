"""The groups per-parameter sharding talks over: shard, replicate (HSDP) and the reshard subgroup.

N data-parallel ranks as an R x S mesh (HSDP, hybrid sharded data parallel; Zhao et al. 2023,
section 3.2.2), the shard dim innermost so that a shard group is S neighbouring ranks (one node):

    rank = replica * S + shard            shard group of rank:     {replica * S + j, j < S}
                                          replicate group:          {i * S + shard, i < R}

Each unit's gradient is reduce-scattered within the shard group (S ranks), then the reduced
shard is all-reduced across the R replicas: per step and rank a ring moves
(S-1)/S * P_u (reduce-scatter) + 2 (R-1)/R * P_u / S (all-reduce of one shard) of each unit,
and the parameters are all-gathered within the shard group only. R = 1 is plain FSDP, S = 1 DDP.

reshard_after_forward = k (FSDP2's int): after forward keep 1/k of each gathered tensor; the
backward re-gather runs in a subgroup of k ranks {replica * S + a * k + b, b < k}. k must divide
S; k = S is the same as True, k = 1 as False (nothing freed).
"""

from __future__ import annotations

import torch.distributed as dist

from course_lib.estimate.memory import check_mesh_args  # the rule the estimator and the runtime share


def hsdp_payloads(unit_local_numels, replicas: int, shards: int, elem_bytes: int = 4) -> dict[str, int]:
    """Logical bytes one rank hands to the gradient collectives per step (what CommTracer records as
    bytes_sent), from S_u, the unit's local elements: the shard dim's reduce-scatter takes the whole
    padded gradient, S * S_u; the replicate dim's all-reduce one reduced shard, S_u (none when R = 1).
    On a ring a rank sends (S-1)/S of the first and 2 (R-1)/R of the second (module docstring)."""
    total = sum(unit_local_numels) * elem_bytes
    return {"shard": shards * total, "replicate": total if replicas > 1 else 0}


def mesh_lists(world_size: int, replicas: int, reshard: int | None = None) -> dict[str, list[list[int]]]:
    """{"shard": [...], "replicate": [...], "reshard": [...]}: the rank lists of every group (pure Python)."""
    s = world_size // replicas
    out = {"shard": [[i * s + j for j in range(s)] for i in range(replicas)],
           "replicate": [[i * s + j for i in range(replicas)] for j in range(s)]}
    if reshard:
        out["reshard"] = [[i * s + a * reshard + b for b in range(reshard)]
                          for i in range(replicas) for a in range(s // reshard)]
    return out


class ShardMesh:
    """This rank's groups. Collective (every rank of the world calls it: dist.new_group is)."""

    def __init__(self, replicas: int = 1, reshard_after_forward=True, group=None):
        self.world_group = group
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.shards = check_mesh_args(self.world, replicas, reshard_after_forward)
        self.replicas = replicas
        k = reshard_after_forward
        if not isinstance(k, bool):  # an int: k = S frees everything, k = 1 nothing
            k = True if k == self.shards else (False if k == 1 else k)
        self.reshard_after_forward = k
        self.reshard_size = None if isinstance(k, bool) else k
        if group is not None and (replicas > 1 or self.reshard_size):
            raise ValueError("hsdp > 1 or an int reshard_after_forward builds subgroups of the default group: "
                             "pass group=None (all ranks data parallel)")
        self.shard_rank = rank % self.shards
        self.shard_group, self.replicate_group, self.sub_group = group, None, None
        if replicas == 1 and not self.reshard_size:
            return
        lists = mesh_lists(self.world, replicas, self.reshard_size)
        for kind in ("shard", "replicate", "reshard"):
            for ranks in lists.get(kind, []):
                g = dist.new_group(ranks)  # every rank creates every group, in the same order
                if rank in ranks:
                    if kind == "shard":
                        self.shard_group = g
                    elif kind == "replicate":
                        self.replicate_group = g if replicas > 1 else None
                    else:
                        self.sub_group = g
