"""Exercise 15, reference solution: list the layouts the course's 3D trainer can run, price each
with the estimator's formulas, choose the fastest that fits, and read off what binds and what
was given up. (One solution of several: any layout within the throughput budget passes.)"""

from course_lib.dims import ParallelDims
from course_lib.estimate.step_time import memory_per_rank, step_time

FRACTION = 0.75  # the notebook's FRACTION: the throughput budget


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config, cluster, global_batch: int, seq: int, recipe: str):
    """(layout, seconds, bytes per rank) of every layout the 3D trainer runs here: dp * tp * pp =
    every device, tp dividing the heads (and so d_model and the MLP), pp dividing the layers,
    m micro-batches dividing each replica's share of the batch, m >= pp (the problem's), ZeRO 0 or 1 (1 only with dp > 1),
    whole-block recomputation or none."""
    out = []
    for tp in divisors(config.n_head):
        for pp in divisors(config.n_layer):
            if cluster.n_gpus % (tp * pp):
                continue
            dp = cluster.n_gpus // (tp * pp)
            if global_batch % dp:
                continue
            for m in divisors(global_batch // dp):
                if m < pp:  # the problem asks for a micro-batch for every stage
                    continue
                for zero in (0, 1) if dp > 1 else (0,):
                    for recompute in ("none", "full"):
                        layout = ParallelDims(dp=dp, tp=tp, pp=pp, microbatches=m, zero=zero, recompute=recompute)
                        out.append((layout, step_time(config, layout, cluster, global_batch, seq, recipe)["total"],
                                    memory_per_rank(config, layout, global_batch, seq, recipe)["total"]))
    return sorted(out, key=lambda row: row[1])  # fastest first


def choose_layout(config, cluster, global_batch: int, seq: int, recipe: str = "fp32") -> ParallelDims:
    rows = candidates(config, cluster, global_batch, seq, recipe)
    return next(layout for layout, _, memory in rows if memory <= cluster.memory_bytes)


def binding_constraint(config, cluster, global_batch: int, seq: int, recipe: str = "fp32"):
    # The fastest layout of all does not fit (the stated problem's case): memory binds until
    # the device holds what that layout needs.
    fastest, _, memory = candidates(config, cluster, global_batch, seq, recipe)[0]
    if memory > cluster.memory_bytes:
        return "memory", memory
    t = step_time(config, fastest, cluster, global_batch, seq, recipe)  # it fits: the largest group of terms binds
    groups = {"compute": t["compute"] + t["recompute"], "overhead": t["overhead"],
              "communication": t["tp"] + t["pp"] + t["ep"] + t["dp_exposed"], "bubble": t["bubble"],
              "optimizer": t["optimizer"]}
    name = max(groups, key=groups.get)
    return name, groups[name]


def rejected_layout(config, cluster, global_batch: int, seq: int, recipe: str = "fp32"):
    # The faster layout that came closest to fitting: what the chosen one gave up, and for how
    # few bytes. When every faster layout fits (memory does not bind), a fitting layout that
    # misses the budget: the fastest of those, the closest call.
    rows = candidates(config, cluster, global_batch, seq, recipe)
    chosen = choose_layout(config, cluster, global_batch, seq, recipe)
    faster = [(layout, memory) for layout, _, memory in rows[:[r[0] for r in rows].index(chosen)]]
    if faster:
        layout, memory = min(faster, key=lambda row: row[1])
        return layout, "memory", memory - cluster.memory_bytes
    best = rows[0][1]  # the chosen layout is the fastest of all
    layout, seconds = next((layout, t) for layout, t, memory in rows
                           if memory <= cluster.memory_bytes and best / t < FRACTION)
    return layout, "throughput", best / seconds
