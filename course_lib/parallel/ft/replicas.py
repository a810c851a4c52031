"""Fault-tolerant replica groups (issue 43, after torchft's per-step quorum): R data-parallel
replicas of one rank each; a replica killed mid-run drops out and the others go on; a restarted
one joins and is healed from a healthy peer over the network.

Every step t, each live replica writes alive/t/<slot> = <its process rank> into the run's
TCPStore (hosted by the parent, so no replica's death takes it down) and waits, at most
quorum_timeout_s, for every replica of the last quorum whose process has not ended (the parent
writes ended/<rank> when it sees a child exit, as torchft's lighthouse notices missed
heartbeats). The first to finish waiting writes the
quorum of step t (every replica alive/t/ names: the late and the dead are out, an announced
joiner is in) with compare_set, so all replicas read the same quorum, whoever wrote it.

The gradient mean runs over the quorum only. gloo cannot shrink a process group in place, and a
new group (comm.process_groups.new_groups) is collective over the whole world, which a dead
process can never join; torchft builds a fresh communicator per quorum. Here the mean is done by
hand with point-to-point calls on the world group among live processes only (gloo connects every
pair at start; a dead peer breaks only the calls that name it): each member sends its flat
gradient to the leader (the quorum's lowest slot), which sums in slot order, divides by |Q| and
sends the mean back. O(|Q|) at the leader, fine for R = 2-3; each pair sees one send and one
receive of the same size, so NCCL's point-to-point rules hold (COURSE_NCCL_RULES=1).

Healing: at the step a replica joins, the quorum's lowest slot that was in the last quorum sends
it its parameters and AdamW state (replay.state_tensors: whole-tensor boxes, every replica holds
everything) in one send; the joiner receives and loads them, then steps with the others.

The quorum, the mean over it and healing are quorum.py's (local.py's DiLoCo replicas share
them); run_ft_hosted spreads the processes over torchrun's ranks (the diloco demo).

Simplification, plainly: a process cannot enter a running gloo world, so "restart" is a spare
process started with the others (world = R + 1), holding its own different random weights and no
optimizer state, idle until rejoin_step, when it takes the killed replica's slot (and rows). The
kill is real: kill_slot's process SIGKILLs itself (course_lib.platform.kill_self_hard) at the
start of kill_step, before announcing itself. A live replica that finds itself outside a quorum
(it was later than quorum_timeout_s) raises: this small version does not heal a fenced replica.
torchft (pytorch/torchft) has a lighthouse decide each quorum, builds a communicator per quorum
and votes (should_commit) before the optimizer step, so a replica dying inside a step costs that
step only; here the parent's store plays the lighthouse, and a death between the quorum and the
mean (not at a step's start) makes the leader's receive fail: no commit vote, no retry.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from course_lib.observe import nccl_rules
from course_lib.parallel.ft.local import diloco_replica
from course_lib.parallel.ft.quorum import ReplicaResult, heal, join_quorum, quorum_mean
from course_lib.parallel.ft.replay import (FtConfig, build, check_ft, flat_state, load_flat_state, local_gradient,
                                           set_gradient)
from course_lib.platform import kill_self_hard, start_method
from course_lib.runtime.pool import FORKSERVER_PRELOAD

def replica(cfg: FtConfig, store, rank: int) -> ReplicaResult:
    """Rank code: one replica (or the spare, rank R) for the whole run."""
    spare = rank == cfg.replicas
    slot = cfg.kill_slot if spare else rank
    model, optimizer = build(cfg, cfg.seed + 1 if spare else cfg.seed)  # the spare's state is not the run's
    res = ReplicaResult(slot, rank, {}, {}, torch.empty(0), {}, {}, {})
    first = cfg.rejoin_step if spare else 1
    if spare:
        store.set(f"alive/{first}/{slot}", str(rank))  # announce: ready to join at rejoin_step
    last = {s: s for s in range(cfg.replicas)}  # the quorum before step 1: everyone
    for t in range(first, cfg.steps + 1):
        if not spare and slot == cfg.kill_slot and t == cfg.kill_step:
            kill_self_hard()
        quorum = join_quorum(store, t, slot, rank, last, cfg.replicas, cfg.quorum_timeout_s, spare and t == first)
        heal(lambda: flat_state(model, optimizer), lambda flat: load_flat_state(model, optimizer, flat),
             quorum, last, slot, t, res, joining=spare and t == first)
        loss, grad = local_gradient(model, cfg, t, slot)
        set_gradient(model, quorum_mean(grad, quorum, slot))
        optimizer.step()
        res.quorums[t], res.losses[t], last = dict(quorum), loss, quorum
    res.final_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return res


def _process(cfg: FtConfig, port: int, rank: int) -> None:
    """A replica's process: join the store and the gloo world, run, leave the result in the store."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=cfg.world,
                                timeout=timedelta(seconds=600))
        nccl_rules.install_from_env()
        loop = diloco_replica if cfg.algorithm == "diloco" else replica
        store.set(f"result/{rank}", pickle.dumps(loop(cfg, store, rank)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        store.set(f"error/{rank}", traceback.format_exc())


@dataclass
class FtRun:
    results: list  # ReplicaResult per process rank, None for the killed process
    exitcodes: list  # per process rank: 0, or -SIGKILL for the killed one


def host_store():
    """The run's TCPStore, served by this process (the parent's, or a torchrun rank's): no
    replica's death takes it down."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def start_processes(cfg: FtConfig, port: int, ranks) -> dict:
    """Start the replica processes `ranks` of the run (children of this process)."""
    ctx = multiprocessing.get_context(start_method())  # forkserver, as run_on_ranks: torch imported once
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD) + [__name__])
    procs = {r: ctx.Process(target=_process, args=(cfg, port, r), daemon=True, name=f"ft-rank-{r}") for r in ranks}
    for p in procs.values():
        p.start()
    return procs


def wait_processes(procs: dict, store, world: int, timeout_s: float) -> list[int]:
    """Wait (at most timeout_s, 2 s more once any process reported an error: the others may wait
    on it) for procs to end; kill the stuck ones and return their ranks. Each process seen ended
    is written into the store (ended/<rank>): the quorum stops waiting for it (decide_quorum)."""
    deadline, ended = time.monotonic() + timeout_s, set()
    while any(p.is_alive() for p in procs.values()) and time.monotonic() < deadline:
        for r, p in procs.items():
            if r not in ended and not p.is_alive():
                store.set(f"ended/{r}", str(p.exitcode))
                ended.add(r)
        if any(store.check([f"error/{r}"]) for r in range(world)):
            deadline = min(deadline, time.monotonic() + 2.0)
        time.sleep(0.05)
    stuck = [r for r, p in procs.items() if p.is_alive()]
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    return stuck


def collect(store, world: int, exitcodes: list, stuck: list, timeout_s: float) -> FtRun:
    """The results from the store; RuntimeError with the tracebacks if a replica raised,
    TimeoutError if one hung."""
    errors = {r: store.get(f"error/{r}").decode() for r in range(world) if store.check([f"error/{r}"])}
    if errors:
        raise RuntimeError("replicas failed:\n" + "\n".join(f"[rank {r}] {e}" for r, e in errors.items()))
    if stuck:
        raise TimeoutError(f"ranks {sorted(stuck)} still ran after timeout_s={timeout_s}")
    results = [pickle.loads(store.get(f"result/{r}")) if store.check([f"result/{r}"]) else None
               for r in range(world)]
    return FtRun(results, exitcodes)


def run_ft(cfg: FtConfig, timeout_s: float = 120) -> FtRun:
    """Parent: check cfg, host the store, start cfg.world processes, wait (at most timeout_s) for
    all to end; RuntimeError with the tracebacks if a replica raised, TimeoutError if one hung."""
    check_ft(cfg)
    store = host_store()
    procs = start_processes(cfg, store.port, range(cfg.world))
    stuck = wait_processes(procs, store, cfg.world, timeout_s)
    return collect(store, cfg.world, [procs[r].exitcode for r in range(cfg.world)], stuck, timeout_s)


def run_ft_hosted(cfg: FtConfig, timeout_s: float = 120) -> FtRun | None:
    """Rank code (the default group, e.g. torchrun's workers): run_ft's run with its cfg.world
    processes spread over the ranks. Rank 0 hosts the store; rank i starts the processes r with
    r % W == i as its own children, so a SIGKILLed replica is a child of a rank, never a rank
    (torchrun's agent ends the whole job when one of its workers dies). One machine: the store
    and the replicas' gloo world are on 127.0.0.1. Rank 0 returns the FtRun, the others None;
    check cfg (check_ft) before any rank waits."""
    world, rank = dist.get_world_size(), dist.get_rank()
    store = host_store() if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)  # an object collective: exempt from the device rule
    if store is None:
        store = dist.TCPStore("127.0.0.1", port[0], is_master=False, timeout=timedelta(seconds=60))
    procs = start_processes(cfg, port[0], [r for r in range(cfg.world) if r % world == rank])
    stuck = wait_processes(procs, store, cfg.world, timeout_s)
    mine = ({r: p.exitcode for r, p in procs.items()}, stuck)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)  # every process has ended: rank 0 may read the store
    if rank:
        return None
    codes = {r: c for part, _ in everyone for r, c in part.items()}
    return collect(store, cfg.world, [codes[r] for r in range(cfg.world)], [r for _, s in everyone for r in s],
                   timeout_s)
