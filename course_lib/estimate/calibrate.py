"""Calibration: the step-time model's inputs measured on the machine at hand (notebook 10).

    matmul_flops(rows, inner, cols)    rank code: FLOP/s of one (rows x inner) @ (inner x cols)
    copy_bandwidth(nbytes)             rank code: bytes/s of reading + writing a tensor
    model_flops(config, ...)           rank code: the model's own forward+backward FLOP/s
    all_reduce_seconds(sizes)          rank code: sustained all-reduce times on the world
    calibrate(world_size, ...)         parent: every rank probes at once; returns a Cluster
                                       and the raw measurements
    cluster_to_dict / cluster_from_dict   to store a calibration as JSON

Every rank probes at the same time, because that is how a training step loads the machine:
emulated ranks share the CPU's cores, so one rank's FLOP/s alone is not what it gets when all
run. The link is course_lib.comm.costmodel's: ping_pong(all_pairs=True) then fit_alpha_beta.
The compute rate is the model's own forward+backward (FLOPs of flops_per_token over seconds):
a tiny model's matmuls run far below a large one's and its non-matmul ops weigh more, and the
step-time model must use what these layers reach; the bare matmul rate at the MLP's shape is
measured beside it, to show the gap.
On CPU ranks communication and compute share the same cores, so nothing hides behind
backward: the calibrated cluster has overlap=0 (a GPU's copy engines give overlap=1).
"""

from __future__ import annotations

import time
from dataclasses import asdict

from course_lib._validate import check_int
from course_lib.comm.costmodel import LinkModel, fit_alpha_beta, ping_pong
from course_lib.estimate.step_time import Cluster

PING_SIZES = (8, 1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20)
AR_SIZES = (4, 1 << 16, 1 << 20, 1 << 22, 1 << 24)


def matmul_flops(rows: int, inner: int, cols: int, seconds: float = 0.3) -> float:
    """Rank code (or a plain process): sustained FLOP/s of back-to-back (rows x inner) @
    (inner x cols) matmuls over `seconds` of wall time, 2 * rows * inner * cols FLOPs each.
    Sustained, not the fastest single call: with ranks sharing cores, a single call may run
    while the others wait, and a training step gets the shared rate."""
    import torch

    x, w = torch.randn(rows, inner), torch.randn(inner, cols)
    x @ w  # warm-up: first-call allocation and kernel selection
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        x @ w
        calls += 1
    return 2 * rows * inner * cols * calls / elapsed


def copy_bandwidth(nbytes: int = 1 << 22, seconds: float = 0.2) -> float:
    """Sustained bytes per second moved by dst.copy_(src) (read nbytes + write nbytes)."""
    import torch

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        dst.copy_(src)
        calls += 1
    return 2 * nbytes * calls / elapsed


def model_flops(config, micro_batch: int, seq: int, seconds: float = 0.5) -> float:
    """Rank code: sustained model FLOP/s of forward + backward of the whole `config` GPT on one
    micro-batch (flops_per_token counts them), over `seconds` of wall time. What the model's
    own layers reach, with every non-matmul op and per-op overhead included."""
    import torch

    from course_lib.estimate.compute import flops_per_token
    from course_lib.model import GPT

    model = GPT(config, seed=0)
    idx = torch.randint(0, config.vocab_size, (micro_batch, seq + 1))
    x, y = idx[:, :-1], idx[:, 1:]
    model(x, y)[1].backward()  # warm-up
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        model(x, y)[1].backward()
        calls += 1
    return flops_per_token(config, seq) * micro_batch * seq * calls / elapsed


def all_reduce_seconds(sizes_bytes, iters: int = 5, rounds: int = 3) -> list[float]:
    """Rank code: seconds of one all-reduce of each size on the world: the mean of `iters`
    back-to-back calls (sustained: waits for a descheduled peer count, as in a step), the
    smallest such mean over `rounds` passes through the sizes (a burst of load elsewhere then
    slows one pass, not one size)."""
    import torch
    import torch.distributed as dist

    best = [float("inf")] * len(sizes_bytes)
    tensors = [torch.zeros(max(1, size // 4)) for size in sizes_bytes]
    for x in tensors:
        dist.all_reduce(x)  # warm-up
    for _ in range(rounds):
        for i, x in enumerate(tensors):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            best[i] = min(best[i], (time.perf_counter() - t0) / iters)
    return best


def probe(config, micro_batch: int, seq: int, sizes=None, sizes_ar=None) -> dict:
    """Rank code, on every rank at once: {"matmul", "model" (FLOP/s), "bandwidth" (bytes/s),
    "ping" (one-way seconds per PING_SIZES, rank 0), "all_reduce" (seconds per AR_SIZES)}."""
    import torch.distributed as dist

    sizes = PING_SIZES if sizes is None else sizes
    sizes_ar = AR_SIZES if sizes_ar is None else sizes_ar
    dist.barrier()
    matmul = matmul_flops(micro_batch * seq, config.d_model, config.ff_dim)
    dist.barrier()
    model = model_flops(config, micro_batch, seq)
    dist.barrier()
    bandwidth = copy_bandwidth()
    times = ping_pong(sizes, rounds=3, all_pairs=True)
    return {"matmul": matmul, "model": model, "bandwidth": bandwidth, "ping": times,
            "all_reduce": all_reduce_seconds(sizes_ar)}


def calibrate(world_size: int, config, micro_batch: int = 1, seq: int | None = None, timeout_s: float = 120,
              memory_bytes: float | None = None, link_from: str = "all_reduce") -> tuple[Cluster, dict]:
    """Measure on `world_size` ranks at once: the sustained matmul FLOP/s at `config`'s MLP shape,
    the model's own forward+backward FLOP/s (the cluster's achievable_flops and peak), the copy
    bandwidth, and alpha, beta two ways: ping-pong between pairs (`link_from="ping_pong"`,
    the link alone) or ring all-reduces of the whole world (`"all_reduce"`, the default: T =
    2(N-1) alpha + 2(N-1)/N S / beta fitted through the times, so alpha and beta include the
    waits for peers that share the cores). Returns the Cluster (overlap 0) and the raw numbers."""
    from course_lib.runtime import run_on_ranks

    world_size = check_int("world_size", world_size, minimum=2)
    micro_batch = check_int("micro_batch", micro_batch)
    seq = config.block_size if seq is None else check_int("seq", seq)
    if link_from not in ("all_reduce", "ping_pong"):
        raise ValueError(f"link_from={link_from!r} must be 'all_reduce' or 'ping_pong'")
    out = run_on_ranks(probe, config, micro_batch, seq, world_size=world_size, timeout_s=timeout_s)
    return cluster_from_probes(out, config, micro_batch, seq, memory_bytes, link_from)


def best_of_rounds(rounds: list[dict]) -> dict:
    """One rank's probes over several rounds, each quantity at its least disturbed: the highest
    rates, the lowest times (a shared machine only ever slows a measurement down)."""
    best = dict(rounds[0])
    for r in rounds[1:]:
        for key in ("matmul", "model", "bandwidth"):
            best[key] = max(best[key], r[key])
        for key in ("ping", "all_reduce"):
            if best[key] is not None:
                best[key] = [min(a, b) for a, b in zip(best[key], r[key])]
    return best


def cluster_from_probes(out: list[dict], config, micro_batch: int, seq: int, memory_bytes: float | None = None,
                        link_from: str = "all_reduce") -> tuple[Cluster, dict]:
    """The Cluster and raw numbers from every rank's probe() (see calibrate)."""
    from course_lib.comm.costmodel import cost_terms

    world_size = len(out)
    median = world_size // 2
    flops = sorted(r["model"] for r in out)[median]
    bandwidth = sorted(r["bandwidth"] for r in out)[median]
    ar = [max(r["all_reduce"][i] for r in out) for i in range(len(AR_SIZES))]
    if link_from == "ping_pong":
        link = fit_alpha_beta(PING_SIZES, out[0]["ping"], name=f"gloo ping-pong, {world_size} ranks")
    else:
        a, b = cost_terms("ring", world_size)  # T/a = alpha + (b/a) S / beta
        link = fit_alpha_beta([s * b / a for s in AR_SIZES], [t / a for t in ar],
                              name=f"gloo all-reduce, {world_size} ranks")
    if memory_bytes is None:
        import os
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size
    cluster = Cluster(f"{world_size} gloo CPU ranks (measured)", world_size, world_size, flops, flops,
                      memory_bytes, link, link, memory_bandwidth=bandwidth, overlap=0.0)
    raw = {"matmul_shape": [micro_batch * seq, config.d_model, config.ff_dim],
           "matmul_flops_per_rank": [r["matmul"] for r in out], "model_flops_per_rank": [r["model"] for r in out],
           "copy_bandwidth_per_rank": [r["bandwidth"] for r in out], "ping_sizes": list(PING_SIZES),
           "ping_seconds": out[0]["ping"], "all_reduce_sizes": list(AR_SIZES), "all_reduce_seconds": ar}
    return cluster, raw


def cluster_to_dict(cluster: Cluster) -> dict:
    return asdict(cluster)


def cluster_from_dict(d: dict) -> Cluster:
    d = dict(d)
    d["intra"], d["inter"] = LinkModel(**d["intra"]), LinkModel(**d["inter"])
    return Cluster(**d)
