"""The automatic planner (notebook 11): every layout that fits, ranked by predicted step time.

Two levels, in the spirit of Alpa (Zheng et al. 2022): the inter-operator split (pp stages,
v chunks per rank, m micro-batches and a schedule) and the intra-operator sharding (tp with
sequence parallelism, cp over the sequence, ep, dp with a ZeRO stage), plus micro-batch size
and recomputation.

    search(config, cluster, global_batch, ...)   every candidate: Candidate(dims, time, memory, fits)
    plan(config, cluster, global_batch, ...)     a Plan: the fitting ones fastest first, and why

A candidate is a course_lib.dims.ParallelDims (the layout the runtime runs) with its costs: it
uses all n_gpus = dp * ep * cp * tp * pp devices, keeps tp inside a node (the TP all-reduces are on
the critical path), and has global_batch = dp * ep * m * micro_batch. The
search is narrower than the rule book (course_lib.dims), by choice: pp | n_layer (uneven stages
run, but a balanced split is never slower here), m >= pp except for GPipe, and cp with
zig-zag load balancing, by the methods in cp_methods (ring by default). ZeRO-2 and 3 compose
with pp and tp (reduced once per step); ZeRO-3 there is tried under both reshard policies. Step
time and memory come from course_lib.estimate.step_time; a layout fits when its busiest rank's
bytes are at most the device's memory_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib._validate import check_int
from course_lib.dims import (RECOMPUTE, ZERO_STAGES, ParallelDims, check_context_parallel, check_experts, check_tp,
                             copies_kv)
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.params import model_shape
from course_lib.estimate.step_time import ALL_TERMS, _memory_per_rank, _step_time, check_layout, composed
from course_lib.units import fmt_bytes


@dataclass(frozen=True)
class Candidate:
    dims: ParallelDims
    batch_size: int  # the global batch it was costed at
    time: dict  # step_time's terms (seconds), "total", "mfu"
    memory: dict  # memory_per_rank's bytes
    fits: bool

    @property
    def biggest_term(self) -> str:
        return max(ALL_TERMS, key=lambda k: self.time[k])

    def label(self) -> str:
        """The layout with its micro-batch size: ParallelDims.describe(batch_size)."""
        return self.dims.describe(self.batch_size)

    def row(self) -> str:
        t = self.time
        terms = ", ".join(f"{k} {t[k] * 1e3:.3g}" for k in ALL_TERMS if t[k] > 0)
        return (f"{self.label():<40} {t['total'] * 1e3:10.4g} ms  MFU {t['mfu']:6.1%}  "
                f"{fmt_bytes(self.memory['total']):>10}  [{terms} ms]")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _obeys(rule, *args) -> bool:
    """Whether a rule of the rule book (course_lib.dims) accepts args: the search skips what it refuses."""
    try:
        rule(*args)
    except ValueError:
        return False
    return True


def search(config, cluster: Cluster, global_batch: int, seq: int | None = None, recipe: str = "bf16_mixed",
           micro_batches=(1, 2, 4, 8), zero_stages=ZERO_STAGES, recomputes=RECOMPUTE,
           schedules=("1f1b", "interleaved_1f1b"), max_v: int = 4, max_tp: int | None = None,
           attention: str | None = None, cps="auto", cp_methods=("ring",), causal: bool = False) -> list[Candidate]:
    """Every valid layout of `config` on all of `cluster`'s devices, fitting or not.

    cps: the context-parallel degrees to try: a list, None for every divisor of the device
    count the rule book accepts for this sequence, or "auto": cp = 1, and every cp > 1 as well
    only when no layout without it fits (memory forces it: a long sequence). cp_methods: how
    cp > 1 attends (course_lib.dims.CP_METHODS). causal: attention under a causal mask."""
    if cps == "auto":
        kw = dict(micro_batches=micro_batches, zero_stages=zero_stages, recomputes=recomputes, schedules=schedules,
                  max_v=max_v, max_tp=max_tp, attention=attention, cp_methods=cp_methods, causal=causal)
        try:
            out = search(config, cluster, global_batch, seq, recipe, cps=(1,), **kw)
        except ValueError:  # no whole layout without cp (e.g. tp does not divide the sequence)
            out = []
        if any(c.fits for c in out):
            return out
        return out + search(config, cluster, global_batch, seq, recipe, cps=divisors(cluster.n_gpus)[1:], **kw)
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster={cluster!r} must be a course_lib.estimate.cluster.Cluster")
    global_batch = check_int("global_batch", global_batch)
    shape = model_shape(config)
    seq = shape.block_size if seq is None else check_int("seq", seq)
    if seq > shape.block_size:
        raise ValueError(f"seq={seq} must be <= block_size={shape.block_size}")
    max_tp = cluster.gpus_per_node if max_tp is None else check_int("max_tp", max_tp)
    n, kv = cluster.n_gpus, shape.n_kv_head
    out = []
    for tp in divisors(n):
        if tp > max_tp or not _obeys(check_tp, tp, shape.n_head, shape.ff_dim, kv, copies_kv(shape)):
            continue
        for cp, method in [(c, m) for c in (divisors(n // tp) if cps is None else cps) for m in cp_methods
                           if (n // tp) % c == 0 and (c > 1 or m == cp_methods[0])
                           and _obeys(check_context_parallel, c, seq, shape.n_head, m, True, kv, tp)]:
            for pp in divisors(n // (tp * cp)):
                if shape.n_layer % pp:
                    continue
                for ep in divisors(n // (tp * cp * pp)):
                    if not _obeys(check_experts, ep, shape.n_experts):
                        continue
                    dp = n // (tp * cp * pp * ep)
                    if global_batch % (dp * ep) or (tp > 1 and (seq // cp) % tp):
                        continue
                    per_replica = global_batch // (dp * ep)
                    out += _inner(config, cluster, global_batch, seq, recipe, attention, causal,
                                  ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, cp_method=method),
                                  per_replica, micro_batches, zero_stages, recomputes, schedules, max_v)
    if not out:
        raise ValueError(f"no layout of n_gpus={n} devices divides global_batch={global_batch} into whole "
                         f"micro-batches per replica with tp | n_head={shape.n_head} (tp <= {max_tp}) and "
                         f"pp | n_layer={shape.n_layer}: change the batch or the device count")
    return out


def _inner(config, cluster, global_batch, seq, recipe, attention, causal, degrees, per_replica, micro_batches,
           zero_stages, recomputes, schedules, max_v, reshard_policies=(True, False)):
    n_layer, pp = model_shape(config).n_layer, degrees.pp
    out = []
    for mb in micro_batches:
        if per_replica % mb:
            continue
        m = per_replica // mb
        shapes = [("1f1b", 1)]
        if pp > 1:
            shapes = [(s, 1) for s in schedules if s != "interleaved_1f1b"]
            if "interleaved_1f1b" in schedules:
                shapes += [("interleaved_1f1b", v) for v in range(2, max_v + 1)
                           if n_layer % (pp * v) == 0 and m % pp == 0]
            if m < pp:
                shapes = [(s, v) for s, v in shapes if s == "gpipe"]
        for schedule, v in shapes:
            for zero in zero_stages if degrees.dp * degrees.ep * degrees.cp > 1 else (0,):
                if zero >= 2 and (degrees.ep > 1 or degrees.cp > 1):
                    continue  # the rule book (ParallelDims.check): stages 2 and 3 reduce over dp alone
                # ZeRO-3 composed with pp / tp: both reshard policies (keep the gathered stage for
                # the step, Llama 3's, or free it after every micro-batch's forward and backward)
                policies = reshard_policies if zero == 3 and composed(degrees) else (True,)
                for rc, reshard in [(rc, k) for rc in recomputes for k in policies]:
                    dims = replace(degrees, virtual_stages=v, microbatches=m, zero=zero, recompute=rc,
                                   schedule=schedule, sequence_parallel=degrees.tp > 1)
                    if not reshard:
                        dims = replace(dims, reshard_after_forward=False)
                    seq, micro_batch = check_layout(config, dims, global_batch, seq)  # once per layout
                    mem = _memory_per_rank(config, dims, seq, micro_batch, recipe, attention)
                    t = _step_time(config, dims, cluster, global_batch, seq, micro_batch, recipe, attention, causal)
                    out.append(Candidate(dims, global_batch, t, mem, mem["total"] <= cluster.memory_bytes))
    return out


@dataclass
class Plan:
    """The planner's answer: `ranked` (fitting candidates, fastest first), `candidates` (all)."""

    ranked: list
    candidates: list
    cluster: Cluster

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def explain(self) -> str:
        """Why the top pick: its biggest cost term, and the binding constraint (memory when a
        faster layout exists that does not fit, else the biggest term itself)."""
        best, fastest = self.best, min(self.candidates, key=lambda c: c.time["total"])
        lines = [f"best: {best.label()}: {best.time['total'] * 1e3:.4g} ms per step, "
                 f"MFU {best.time['mfu']:.1%}, {fmt_bytes(best.memory['total'])} of "
                 f"{fmt_bytes(self.cluster.memory_bytes)} per device",
                 f"biggest cost term: {best.biggest_term} "
                 f"({best.time[best.biggest_term] / best.time['total']:.0%} of the step)"]
        if fastest is not best and not fastest.fits:
            lines.append(f"binding constraint: memory. The fastest layout, {fastest.label()} "
                         f"({fastest.time['total'] * 1e3:.4g} ms), needs {fmt_bytes(fastest.memory['total'])}")
        else:
            lines.append("binding constraint: " + ("compute" if best.biggest_term in ("compute", "recompute")
                                                     else "communication / idle time") + " (memory does not bind)")
        return "\n".join(lines)

    def table(self, top: int = 5) -> str:
        return "\n".join(c.row() for c in self.ranked[:top])


def plan(config, cluster: Cluster, global_batch: int, seq: int | None = None, recipe: str = "bf16_mixed",
         **search_kwargs) -> Plan:
    """search(), keep what fits, sort by predicted step time (equal device count, so also by
    MFU). ValueError when nothing fits, naming the smallest footprint found."""
    cands = search(config, cluster, global_batch, seq, recipe, **search_kwargs)
    ranked = sorted((c for c in cands if c.fits), key=lambda c: c.time["total"])
    if not ranked:
        small = min(cands, key=lambda c: c.memory["total"])
        raise ValueError(f"no layout fits: the smallest, {small.label()}, needs "
                         f"{fmt_bytes(small.memory['total'])} per device > memory_bytes="
                         f"{fmt_bytes(cluster.memory_bytes)}; add devices or memory")
    return Plan(ranked, cands, cluster)
