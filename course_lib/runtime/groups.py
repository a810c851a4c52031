"""Process groups that end with the work that made them.

Every gloo process group owns native threads (two workers and a transport loop, here) that
live until the group is destroyed and no Python object refers to it. The rank pool's processes
live across many runs; if each run's groups (a mesh, a TP or DP group) stayed, a pool would
gather hundreds of them, and their threads wake up and take CPU from the ranks' compute:
measured here, 8 ranks on 2 cores, forward + backward of a small GPT ran 1.3 to 3 times slower
after 20 to 60 idle two-rank groups per rank. So groups end with the work that made them:

* run_on_ranks destroys, at the start of each call, the groups the calls before it left. Not
  at the end of a call: a rank that finishes first would close the connections of a group
  whose other ranks are still inside a collective on it (a hang the debugging notebook
  shows on purpose would become a "connection closed" error). A call starts only after every
  rank finished the previous one (or the pool was replaced after a timeout).
* `scoped_groups()` ends them inside one call, e.g. one layout after another in the planner's
  benchmark: every rank of the world enters it, and on leaving waits at a barrier of the world
  (every rank is past its last collective on those groups), then destroys the groups created
  inside. After an exception it leaves them to the next call's start.

    with scoped_groups():        # groups created in the block are destroyed when it ends
        train(...)

The default (world) group is never touched. Destroying a group is local to the rank.
"""

from __future__ import annotations

import contextlib
import gc


def live_groups() -> list:
    """The process groups this rank holds now, the default group excluded."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return []
    world = c10d._get_default_group()
    return [pg for pg in list(c10d._world.pg_map) if pg is not world]


def destroy_groups(groups) -> int:
    """Destroy `groups` (never the default one); returns how many were destroyed. A group's
    threads stop once nothing refers to it: gc.collect() drops the cycles that still do (only
    when a group was destroyed: one collection takes about 80 ms in a rank that imported torch,
    and run_on_ranks calls this at the start of every call)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return 0
    world, n = c10d._get_default_group(), 0
    for pg in groups:
        if pg is not world and pg in c10d._world.pg_map:
            dist.destroy_process_group(pg)
            n += 1
    if n:
        forget_meshes_of_destroyed_groups()
        gc.collect()
    return n


def forget_meshes_of_destroyed_groups() -> None:
    """Clear DTensor's sharding-propagation caches (Python's and the C++ fast path's).

    They map an operator's input specs to its output specs, and a spec holds its DeviceMesh. A
    DeviceMesh compares equal to any other with the same ranks, shape and dimension names,
    whatever process groups it holds. So after a mesh's groups are destroyed, a new mesh of the
    same layout (the next round of a benchmark, the next run_on_ranks call) hits the cache and
    gets back output specs on the old mesh, and the next redistribution fails with "Could not
    resolve the process group registered under the name N". Only if DTensor was imported."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)  # torch >= 2.9: both caches
    if clear is not None:
        clear()
    else:  # torch 2.8: the Python cache only (no C++ fast path)
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


@contextlib.contextmanager
def scoped_groups():
    """Collective (every rank of the world enters it): when the block ends, a barrier of the
    world, then every process group created inside it is destroyed. After an exception nothing
    is destroyed (other ranks may still wait in a collective on those groups)."""
    import torch.distributed as dist

    before = {id(pg) for pg in live_groups()}
    yield
    if dist.is_initialized():
        dist.barrier()
    destroy_groups([pg for pg in live_groups() if id(pg) not in before])
