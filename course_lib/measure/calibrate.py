"""Calibration: the step-time model's inputs measured on the machine at hand (notebook 11).

    matmul_flops(rows, inner, cols)    rank code: FLOP/s of one (rows x inner) @ (inner x cols)
    copy_bandwidth(nbytes)             rank code: bytes/s of reading + writing a tensor
    model_seconds(config, ...)         rank code: forward+backward seconds of the model at a few
                                       micro-batch sizes, in fp32 or under bf16 autocast
    optimizer_seconds(config)          rank code: AdamW + clipping, per tensor and on one flat tensor
    calibrate(world_size, ...)         parent: every rank probes at once; returns a Cluster
                                       and the raw measurements
    spacing(config, ...)               rank code: the compute run before each timed collective
    cluster_to_dict / cluster_from_dict   to store a calibration as JSON

One module, over 300 lines, on purpose: probe() writes one dict per rank and round, and
median_of_rounds and cluster_from_probes read the same keys; split, each key would be spelled
in several files.

Every rank probes at the same time, because that is how a training step loads the machine:
emulated ranks share the CPU's cores, so one rank's speed alone is not what it gets when all
run. And each call of the model and optimizer probes ends in a barrier, because a step runs at
the pace of its slowest rank (paced_seconds): measured here, 50 ms of work per rank followed
by an all-reduce of the 8 ranks took 12 ms longer than the work and the all-reduce apart.
Each cost is fitted as a fixed part plus a rate, the alpha-beta form of notebook 02:

    forward+backward  t(mb) = (n_layer + 1) c + F(mb) / R     -> layer_overhead c, achievable R
                      and again under bf16 autocast (PROBED_RECIPES) -> Cluster.recipe_rates: its casts
                      and, on a CPU without bf16 matmul units, its slower matmuls
    optimizer         t = n_tensors o + bytes / bandwidth     -> tensor_overhead o, memory_bandwidth
    collectives       a table of seconds per (op, group size, bytes) (course_lib.comm.measured),
                      with one alpha-beta line through the world's all-reduces beside it; each
                      call timed after a stretch of compute (spacing), as in a step, and a
                      second table of the same calls back to back, for comparison

A tiny model's layers run far below a large matmul's rate, and their fixed costs weigh more
than their FLOPs; the bare matmul rate at the MLP's shape is measured beside them, to show the
gap. On CPU ranks communication and compute share the same cores, so nothing hides behind
backward: the calibrated cluster has overlap=0 and shared_cores = the cores the ranks run on
(a GPU's copy engines give overlap=1, and each rank its own device).

Why collectives after compute: the calls of a step come between stretches of compute, and on
ranks sharing cores a call that follows compute costs more than one that follows another call.
Back to back, the ranks of a group run in step, each call's partner already waiting; after
compute, each rank enters the call when it has finished its own work and been scheduled, and
waits for the others to do so. Measured here in one run of benchmarks/bench_planner.py (8 ranks
on 2 cores, both tables in the same rounds): a 2-rank all-reduce of 64 KiB took 1.3 ms a call
back to back and 2.5 ms after compute (about 1 ms of it); read with the back-to-back table the
step-time model predicted all 19 layouts low (median error 19%, the tensor-parallel hybrids by
29-35%), with the table after compute 10 high and 9 low (median 4%). The stored run
(course_lib/assets/planner_validation.json, after measure_table took the slowest rank's
stretch off, not each rank's own, and sequence parallelism summed its replicated gradients in
one call): back to back 15 low and 4 high (median 11%, the hybrids 16-27% low), after compute
9 low and 10 high (median 5%).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from course_lib._validate import check_int
from course_lib.comm.costmodel import cost_terms, fit_alpha_beta
from course_lib.comm.measured import CollectiveTable, link_from_dict, measure_table, table_to_dict
from course_lib.estimate.compute import flops_per_token
from course_lib.estimate.step_time import Cluster
from course_lib.model import GPT
from course_lib.platform import usable_cores
from course_lib.runtime import rank_device, run_on_ranks

TABLE_SIZES = (4, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
TABLE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
MICRO_BATCHES = (1, 2, 4, 16)
# precision recipes probed beside fp32 (course_lib.estimate.memory.RECIPES names), at fewer
# micro-batch sizes: a bf16 matmul can run tens of times slower than fp32 on a CPU without bf16
# units (AVX2), and three sizes fit a line
PROBED_RECIPES = ("bf16_autocast",)
RECIPE_MICRO_BATCHES = (1, 2, 4)


def sustained_seconds(fn, seconds: float) -> float:
    """Seconds per call of fn() called back to back for `seconds` of wall time, after one
    warm-up call (first-call allocation and kernel selection). Sustained, not the fastest
    single call: with ranks sharing cores, a single call may run while the others wait, and a
    training step gets the shared rate."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn()
        calls += 1
    return elapsed / calls


def paced_seconds(fn, seconds: float) -> float:
    """Rank code, on every rank of the world at once: seconds per call of fn() when each call
    ends in a barrier of the world (an all-reduce of one number), less that barrier's own time
    measured alone. A training step runs at the pace of its slowest rank: ranks sharing cores
    finish a stretch of work at different times, and a collective waits for the last, so a
    rank's unsynchronized average (sustained_seconds) is faster than a step gets. Every rank
    makes the same number of calls (the fewest that any rank fits in `seconds`), as a
    collective needs. Outside a process group of several ranks: sustained_seconds."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sustained_seconds(fn, seconds)
    one = torch.zeros(1, device=rank_device())  # on the rank's device: NCCL communicates nothing else
    fn()  # warm-up: first-call allocation and kernel selection
    dist.all_reduce(one)
    t0 = time.perf_counter()
    fn()
    calls = torch.tensor([max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))], device=one.device)
    dist.all_reduce(calls, op=dist.ReduceOp.MIN)
    calls = int(calls)

    def timed(step, n):
        dist.all_reduce(one)
        start = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - start) / n

    paced = timed(lambda: (fn(), dist.all_reduce(one)), calls)
    barrier = timed(lambda: dist.all_reduce(one), max(calls, 20))
    return max(paced - barrier, 0.0)


def matmul_flops(rows: int, inner: int, cols: int, seconds: float = 0.3) -> float:
    """Rank code (or a plain process): sustained FLOP/s of back-to-back (rows x inner) @
    (inner x cols) matmuls, 2 * rows * inner * cols FLOPs each."""
    x, w = torch.randn(rows, inner), torch.randn(inner, cols)
    return 2 * rows * inner * cols / sustained_seconds(lambda: x @ w, seconds)


def copy_bandwidth(nbytes: int = 1 << 22, seconds: float = 0.2) -> float:
    """Sustained bytes per second moved by dst.copy_(src) (read nbytes + write nbytes)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / sustained_seconds(lambda: dst.copy_(src), seconds)


def model_seconds(config, micro_batches, seq: int, seconds: float = 0.3, recipe: str = "fp32") -> list[float]:
    """Rank code, on every rank at once: seconds of forward + backward of the whole `config` GPT
    on one micro-batch of each size at the slowest rank's pace (paced_seconds), over about
    `seconds` of wall time each: every non-matmul op and per-op overhead included. recipe
    "bf16_autocast": both under torch.autocast(bfloat16), as the course's trainers run bf16
    (course_lib.parallel.hybrid.training.precision_context)."""
    if recipe not in ("fp32",) + PROBED_RECIPES:
        raise ValueError(f"recipe={recipe!r} must be one of {('fp32',) + PROBED_RECIPES}")
    model = GPT(config, seed=0)
    out = []

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "bf16_autocast"):
            model(x, y)[1].backward()

    for mb in micro_batches:
        idx = torch.randint(0, config.vocab_size, (mb, seq + 1))
        x, y = idx[:, :-1], idx[:, 1:]
        out.append(paced_seconds(lambda: step(x, y), seconds))
    return out


def optimizer_seconds(config, seconds: float = 0.3) -> dict:
    """Rank code, on every rank at once: seconds of one AdamW step (foreach=False, as the course's
    trainers) plus gradient clipping at the slowest rank's pace (paced_seconds), over the
    model's own parameter tensors and over one flat tensor holding as many elements:
    {"tensors", "flat", "n_tensors", "numel"}."""
    params = [p for p in GPT(config, seed=0).parameters()]
    flat = torch.nn.Parameter(torch.zeros(sum(p.numel() for p in params)))
    out = {"n_tensors": len(params), "numel": flat.numel()}
    for key, tensors in (("tensors", params), ("flat", [flat])):
        for p in tensors:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(tensors, lr=1e-3, foreach=False)

        def step(tensors=tensors, opt=opt):
            torch.nn.utils.clip_grad_norm_(tensors, 1.0)
            opt.step()

        out[key] = paced_seconds(step, seconds)
    return out


def group_sizes(world_size: int) -> list[int]:
    return [g for g in range(2, world_size + 1) if world_size % g == 0]


def spacing(config, rows: int, forward_backward: float, matmul: float):
    """Rank code: the compute measure_table runs before each timed call of the table (its
    `between`; see the module docstring): the MLP's (rows x d_model) @ (d_model x ff_dim)
    matmul, repeated to last about forward_backward / (4 (n_layer + 1)) seconds at this rank's
    measured `matmul` FLOP/s. forward_backward: the model's seconds on one sequence, so the
    stretch is a step's compute between two of tensor parallelism's calls (4 a layer: 2
    forward, 2 backward), at a micro-batch of one sequence."""
    x, w = torch.randn(rows, config.d_model), torch.randn(config.d_model, config.ff_dim)
    seconds = forward_backward / (4 * (config.n_layer + 1))
    repeats = max(1, round(seconds * matmul / (2 * rows * config.d_model * config.ff_dim)))

    def between():
        for _ in range(repeats):
            x @ w
    return between


def probe(config, micro_batch: int, seq: int, sizes=None, ops=None) -> dict:
    """Rank code, on every rank at once: {"matmul" (FLOP/s at the MLP's shape), "bandwidth"
    (copy bytes/s), "model" (forward+backward seconds per MICRO_BATCHES size), "recipes"
    ({recipe: seconds per RECIPE_MICRO_BATCHES size} for PROBED_RECIPES), "optimizer"
    (optimizer_seconds), "table" (CollectiveTable entries over every group size dividing the
    world, each call after compute: spacing), "table_back_to_back" (the same calls back to
    back)}."""
    dist.barrier()
    matmul = matmul_flops(micro_batch * seq, config.d_model, config.ff_dim)
    dist.barrier()
    model = model_seconds(config, MICRO_BATCHES, seq)
    recipes = {}
    for recipe in PROBED_RECIPES:
        dist.barrier()
        recipes[recipe] = model_seconds(config, RECIPE_MICRO_BATCHES, seq, recipe=recipe)
    dist.barrier()
    optimizer = optimizer_seconds(config)
    dist.barrier()
    bandwidth = copy_bandwidth()
    sizes, ops, groups = TABLE_SIZES if sizes is None else sizes, TABLE_OPS if ops is None else ops, \
        group_sizes(dist.get_world_size())
    between = spacing(config, micro_batch * seq, model[0], matmul)
    table = measure_table(sizes, groups, ops, rounds=1, device=rank_device(), between=between)
    back_to_back = measure_table(sizes, groups, ops, rounds=1, device=rank_device())
    return {"matmul": matmul, "model": model, "recipes": recipes, "optimizer": optimizer, "bandwidth": bandwidth,
            "table": table, "table_back_to_back": back_to_back}


def calibrate(world_size: int, config, micro_batch: int = 1, seq: int | None = None, timeout_s: float = 120,
              memory_bytes: float | None = None, sizes=None, ops=None) -> tuple[Cluster, dict]:
    """Measure on `world_size` ranks at once (see the module docstring) and return the Cluster
    (overlap 0, shared_cores = this machine's cores, links = the measured CollectiveTable) and
    the raw numbers."""
    world_size = check_int("world_size", world_size, minimum=2)
    micro_batch = check_int("micro_batch", micro_batch)
    seq = config.block_size if seq is None else check_int("seq", seq)
    out = run_on_ranks(probe, config, micro_batch, seq, sizes, ops, world_size=world_size, timeout_s=timeout_s,
                       check_collectives=False)  # the table's timing loops would time the checks too
    return cluster_from_probes(out, config, micro_batch, seq, memory_bytes)


def median_of_rounds(rounds: list[dict]) -> dict:
    """One rank's probes over several rounds, each quantity at its median round. Not each at its
    fastest: a step is the sum of its parts measured in the same conditions, and the fastest of
    every part separately is a machine no step ever runs on (benchmarks/bench_planner.py measured
    here: with each probe at its fastest round and each layout at its fastest step, 19 layouts
    of 19 were predicted faster than they ran, median error 20%; with the median round of both,
    7.8%, errors of both signs). The layouts' steps are taken the same way (bench_planner)."""
    med = statistics.median
    out = dict(rounds[0])
    for key in ("matmul", "bandwidth"):
        out[key] = med(r[key] for r in rounds)
    out["model"] = [med(r["model"][i] for r in rounds) for i in range(len(out["model"]))]
    out["recipes"] = {recipe: [med(r["recipes"][recipe][i] for r in rounds) for i in range(len(times))]
                      for recipe, times in out["recipes"].items()}
    out["optimizer"] = dict(out["optimizer"]) | {key: med(r["optimizer"][key] for r in rounds)
                                                 for key in ("tensors", "flat")}
    for key in ("table", "table_back_to_back"):
        if key in out:
            out[key] = {op: {g: [list(sizes), [med(r[key][op][g][1][i] for r in rounds) for i in range(len(times))]]
                             for g, (sizes, times) in by.items()} for op, by in out[key].items()}
    return out


def cores_available() -> int:
    return usable_cores()


def cluster_from_probes(out: list[dict], config, micro_batch: int, seq: int,
                        memory_bytes: float | None = None) -> tuple[Cluster, dict]:
    """The Cluster and raw numbers from every rank's probe() (see calibrate): every time is the
    slowest rank's (a step waits for it); the raw numbers keep each rank's rates."""
    world_size = len(out)
    model = [max(r["model"][i] for r in out) for i in range(len(MICRO_BATCHES))]
    flops = [flops_per_token(config, seq) * mb * seq for mb in MICRO_BATCHES]
    fixed, rate = _fit_model(flops, model, "fp32")
    layer_overhead = fixed / (config.n_layer + 1)
    recipe_rates, recipe_raw = [], {}
    for recipe in out[0].get("recipes", {}):
        times = [max(r["recipes"][recipe][i] for r in out) for i in range(len(RECIPE_MICRO_BATCHES))]
        f = [flops_per_token(config, seq) * mb * seq for mb in RECIPE_MICRO_BATCHES]
        r_fixed, r_rate = _fit_model(f, times, recipe)
        recipe_rates.append((recipe, r_rate, r_fixed / (config.n_layer + 1)))
        recipe_raw[recipe] = {"micro_batches": list(RECIPE_MICRO_BATCHES), "model_seconds": times,
                              "model_fixed_seconds": r_fixed}
    opt = {k: max(r["optimizer"][k] for r in out) for k in ("tensors", "flat")}
    n_tensors, numel = out[0]["optimizer"]["n_tensors"], out[0]["optimizer"]["numel"]
    tensor_overhead = max(0.0, (opt["tensors"] - opt["flat"]) / (n_tensors - 1))
    update_bandwidth = numel * 2 * 16 / opt["flat"]  # fp32 AdamW: weights, grads, 2 moments, read + written
    entries = out[0]["table"]
    sizes, times = entries["all_reduce"][str(world_size)]
    a, b = cost_terms("ring", world_size)  # T/a = alpha + (b/a) S / beta
    try:  # one alpha-beta line beside the table, to compare with; the model reads the table
        ring_fit = fit_alpha_beta([s * b / a for s in sizes], [t / a for t in times],
                                  name=f"gloo all-reduce, {world_size} ranks")
    except ValueError:  # times that do not grow with size (a loaded machine): no line fits
        ring_fit = None
    link = CollectiveTable(f"gloo, {world_size} ranks on {cores_available()} cores (measured)", entries, ring_fit)
    if memory_bytes is None:
        import os
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size
    cluster = Cluster(f"{world_size} gloo CPU ranks (measured)", world_size, world_size, rate, rate,
                      memory_bytes, link, link, memory_bandwidth=update_bandwidth, overlap=0.0,
                      layer_overhead=layer_overhead, tensor_overhead=tensor_overhead,
                      shared_cores=cores_available(), recipe_rates=tuple(recipe_rates))
    raw = {"matmul_shape": [micro_batch * seq, config.d_model, config.ff_dim],
           "matmul_flops_per_rank": [r["matmul"] for r in out],
           "copy_bandwidth_per_rank": [r["bandwidth"] for r in out],
           "micro_batches": list(MICRO_BATCHES), "model_seconds": model, "model_flops": flops,
           "model_fixed_seconds": fixed, "optimizer_seconds": opt, "optimizer_tensors": n_tensors,
           "optimizer_numel": numel, "recipes": recipe_raw,
           "table_back_to_back": out[0].get("table_back_to_back")}
    return cluster, raw


def _fit_model(flops, times, recipe: str) -> tuple[float, float]:
    """(fixed seconds, FLOP/s) of the line t = fixed + F / rate through the probes."""
    try:
        fit = fit_alpha_beta(flops, times, name=f"forward+backward in {recipe}: fixed seconds, FLOP/s")
        return fit.alpha, fit.beta
    except ValueError:  # times that do not grow with the work (a loaded machine): no line fits, so
        # no fixed part can be told apart; the largest probe's throughput is the sustained rate
        return 0.0, flops[-1] / times[-1]


def cluster_to_dict(cluster: Cluster) -> dict:
    d = asdict(cluster)
    for key in ("intra", "inter"):
        link = getattr(cluster, key)
        if isinstance(link, CollectiveTable):
            d[key] = table_to_dict(link)
    return d


def cluster_from_dict(d: dict) -> Cluster:
    d = dict(d)
    d["intra"], d["inter"] = link_from_dict(d["intra"]), link_from_dict(d["inter"])
    d["recipe_rates"] = tuple(tuple(entry) for entry in d.get("recipe_rates", ()))  # JSON stores lists
    return Cluster(**d)
