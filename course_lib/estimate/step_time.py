"""The step-time model of one layout (notebook 10): compute + exposed communication + bubble.

A layout runs n_gpus = dp * ep * tp * pp ranks (course_lib.parallel.mesh's order: tp innermost,
then ep, dp, pp), m micro-batches of `micro_batch` sequences per data-parallel replica, so the
global batch is B = dp * ep * m * micro_batch sequences of `seq` tokens. One optimizer step:

    compute     F / (n_gpus * R)                   F = flops_per_token * B * seq (notebook 01),
                                                   R = achievable FLOP/s of one device;
                                                   forward = F/3, backward = 2F/3
    recompute   + forward again ("full") or + the attention scores' forward ("selective")
    tp          every layer, every micro-batch: 2 all-reduces forward, 2 backward (Megatron f, g;
                with sequence parallelism all-gather + reduce-scatter pairs, the same bytes);
                on the critical path, never hidden (the next matmul needs the result)
    pp          each micro-batch crosses each stage boundary as an activation and a gradient
    ep          2 all-to-alls forward and 2 backward per MoE layer
    bubble      busy * f / (1 - f), f = the schedule's bubble fraction (course_lib.parallel.pp.bubble)
    dp          the gradient all-reduce (ZeRO-1: the same; ZeRO-2: reduce-scatter + all-gather;
                ZeRO-3: + a parameter all-gather in forward), overlapped with backward: only
                max(0, T_dp - overlap * T_backward / m) is exposed (the gradients are final
                only during the last micro-batch's backward)
    optimizer   bytes the update touches / memory bandwidth (AdamW reads and writes the
                weights, gradients and both moments of the parameters this rank owns)

Every collective is costed by course_lib.comm.costmodel (T = a alpha + b S / beta, ring
algorithms) on the link its group crosses, placed as make_mesh places it (notebook 09's
course_lib.parallel.topology.link_of): the node's link (`intra`) when the whole group sits
on one node, else the network (`inter`), which a ring then crosses at its slowest hop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib._validate import check_int, check_one_of
from course_lib.comm.costmodel import LinkModel, predict_time
from course_lib.estimate.compute import flops_per_token
from course_lib.estimate.memory import RECIPES, RECOMPUTE, ZERO_STAGES
from course_lib.estimate.params import unpack
from course_lib.estimate.per_gpu import per_gpu_memory

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class Cluster:
    """Devices and links. peak_flops: the spec sheet's dense rate (MFU's denominator);
    achievable_flops: what large matmuls really reach (measured: course_lib.estimate.calibrate);
    memory_bytes: usable device memory; memory_bandwidth: bytes/s for the optimizer update;
    overlap: the fraction of backward that can hide gradient traffic (1 on GPUs with separate
    communication engines; less where communication and compute share the same cores)."""

    name: str
    n_gpus: int
    gpus_per_node: int
    peak_flops: float
    achievable_flops: float
    memory_bytes: float
    intra: LinkModel
    inter: LinkModel
    memory_bandwidth: float = 2e12
    overlap: float = 1.0

    def __post_init__(self):
        check_int("n_gpus", self.n_gpus)
        check_int("gpus_per_node", self.gpus_per_node)
        for name in ("peak_flops", "achievable_flops", "memory_bytes", "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap!r} must satisfy 0 <= overlap <= 1")

    def link(self, size: int, stride: int) -> LinkModel:
        """The link a group of `size` ranks `stride` apart crosses: the node's when its span
        fits a node without straddling two (course_lib.parallel.topology.link_of's rule)."""
        span = size * stride
        return self.intra if span <= self.gpus_per_node and self.gpus_per_node % span == 0 else self.inter

    def link_of(self, dim: str, layout: "Layout") -> LinkModel:
        """The link of mesh dimension `dim` of `layout`, placed as make_mesh places it
        (course_lib.parallel.topology, TOPOLOGY_AWARE order: tp innermost)."""
        from course_lib.parallel.topology import link_of

        sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep}
        return self.inter if link_of(dim, sizes, self.gpus_per_node) == "inter" else self.intra

    def with_gpus(self, n_gpus: int) -> "Cluster":
        return replace(self, n_gpus=n_gpus)


@dataclass(frozen=True)
class Layout:
    """One way to run the model: mesh degrees, schedule, micro-batching, ZeRO, recomputation."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    v: int = 1  # model chunks per pipeline rank (interleaved 1F1B)
    m: int = 1  # micro-batches per step and replica
    micro_batch: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    sequence_parallel: bool = False

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "ep", "v", "m", "micro_batch"):
            check_int(name, getattr(self, name))
        check_one_of("zero_stage", self.zero_stage, ZERO_STAGES)
        check_one_of("recompute", self.recompute, RECOMPUTE)
        check_one_of("schedule", self.schedule, SCHEDULES)
        if self.v > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError(f"v={self.v} > 1 needs schedule='interleaved_1f1b', not {self.schedule!r}")
        if self.pp > 1 and self.schedule in ("1f1b", "interleaved_1f1b", "zero_bubble") and self.m < self.pp:
            raise ValueError(f"m={self.m} micro-batches must be >= pp={self.pp} stages for {self.schedule!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.ep * self.tp * self.pp

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("sp" if self.sequence_parallel else ""), f"pp{self.pp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.pp > 1:
            parts.append(f"v{self.v} m{self.m}" if self.v > 1 else f"m{self.m}")
        elif self.m > 1:
            parts.append(f"accum{self.m}")
        parts.append(f"mb{self.micro_batch}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        return " ".join(parts)


def check_layout(config, layout: Layout, seq: int | None = None) -> int:
    """ValueError unless `layout` can run `config`; returns seq."""
    base, n_experts, _ = unpack(config)
    seq = base.block_size if seq is None else check_int("seq", seq)
    if seq > base.block_size:
        raise ValueError(f"seq={seq} must be <= block_size={base.block_size}")
    L = layout
    if base.n_layer % (L.pp * L.v):
        raise ValueError(f"pp * v = {L.pp} * {L.v} must divide n_layer={base.n_layer}: every chunk holds whole layers")
    if L.ep > 1 and n_experts == 1:
        raise ValueError(f"ep={L.ep} needs a mixture-of-experts model (this one is dense)")
    # per_gpu_memory checks tp against heads and d_ff, ep against the experts
    per_gpu_memory(config, 1, seq, "fp32", 0, L.dp, L.tp, L.pp, L.ep)
    return seq


def memory_per_rank(config, layout: Layout, seq: int | None = None, recipe: str = "bf16_mixed",
                    attention: str | None = None) -> dict:
    """notebook 01's per_gpu_memory for this layout, with the in-flight micro-batches of the
    schedule: 1F1B holds min(m, pp) on stage 0 (per_gpu_memory's assumption), GPipe all m,
    interleaving (1 + (pp - 1) / (pp * v)) times 1F1B's (Narayanan et al. 2021)."""
    seq = check_layout(config, layout, seq)
    L = layout
    mem = per_gpu_memory(config, L.micro_batch, seq, recipe, L.zero_stage, L.dp, L.tp, L.pp, L.ep, L.recompute,
                         attention=attention, sequence_parallel=L.sequence_parallel)
    if L.pp > 1:
        factor = {"gpipe": L.m / L.pp, "interleaved_1f1b": 1 + (L.pp - 1) / (L.pp * L.v)}.get(L.schedule, 1.0)
        mem["activations"] = int(mem["activations"] * factor)
        mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
    return mem


def step_time(config, layout: Layout, cluster: Cluster, seq: int | None = None, recipe: str = "bf16_mixed",
              attention: str | None = None, causal: bool = False) -> dict:
    """Seconds of one optimizer step by term (see the module docstring) and the totals:
    {"compute", "recompute", "tp", "pp", "ep", "bubble", "dp_total", "dp_exposed", "optimizer",
    "total", "flops" (model FLOPs of the step, recomputation excluded), "mfu", "tokens"}."""
    seq = check_layout(config, layout, seq)
    check_one_of("recipe", recipe, RECIPES)
    L, C = layout, cluster
    if L.n_gpus > C.n_gpus:
        raise ValueError(f"the layout needs dp*ep*tp*pp = {L.n_gpus} devices, the cluster has n_gpus={C.n_gpus}")
    base, n_experts, top_k = unpack(config)
    e = 4 if recipe in ("fp32", "bf16_autocast") else 2  # bytes of an activation / gradient on the wire
    batch = L.dp * L.ep * L.m * L.micro_batch
    tokens = batch * seq
    flops = flops_per_token(config, seq, causal=causal) * tokens
    compute = flops / (L.n_gpus * C.achievable_flops)
    attn_fraction = 4 * base.n_layer * seq * base.d_model * (0.5 if causal else 1.0) / (
        flops_per_token(config, seq, causal=causal, training=False))
    recompute = {"none": 0.0, "full": compute / 3, "selective": compute / 3 * attn_fraction}[L.recompute]

    layers = base.n_layer // L.pp  # per rank, over its v chunks
    message = L.micro_batch * seq * base.d_model * e  # one residual-stream activation
    # tp: 4 ring all-reduces of `message` per layer and micro-batch (+2 when the forward is recomputed)
    tp_link = C.link_of("tp", L)
    per_layer = 4 + (2 if L.recompute == "full" else 0)
    tp = per_layer * layers * L.m * predict_time("ring", message, L.tp, tp_link)
    # pp: an activation forward and a gradient backward per micro-batch and chunk boundary
    pp_link = C.link_of("pp", L)
    pp = 0.0 if L.pp == 1 else 2 * L.v * L.m * pp_link.message_time(message / (L.tp if L.sequence_parallel else 1))
    # ep: 2 all-to-alls forward, 2 backward, of top_k copies of each token, per MoE layer
    ep = 0.0
    if L.ep > 1:
        ep = 4 * layers * L.m * predict_time("all_to_all", message * top_k, L.ep, C.link_of("ep", L))
    busy = compute + recompute + tp + pp + ep
    bubble = 0.0
    if L.pp > 1:
        from course_lib.parallel.pp.bubble import formula_for  # the schedules' own formulas
        f = formula_for(L.schedule, L.pp, L.m, L.v)
        bubble = busy * f / (1 - f)

    # dp: the gradients of the parameters this rank holds, over dp*ep replicas (experts: dp)
    mem = per_gpu_memory(config, L.micro_batch, seq, recipe, L.zero_stage, L.dp, L.tp, L.pp, L.ep)
    local = mem["params_on_gpu"]
    replicas = L.dp * L.ep
    dp_link = C.link_of("dp", L)
    grad_bytes = local * RECIPES[recipe].grad
    if L.zero_stage <= 1:
        dp_total = predict_time("ring", grad_bytes, replicas, dp_link)
    else:  # reduce-scatter the gradients, all-gather the updated parameters (stage 3: gathered in forward too)
        gathers = 2 if L.zero_stage == 3 else 1
        dp_total = (predict_time("reduce_scatter", grad_bytes, replicas, dp_link)
                    + gathers * predict_time("all_gather", local * RECIPES[recipe].param, replicas, dp_link))
    # gradients are final only in the last micro-batch's backward, so only that one hides them
    hidden_by = C.overlap * (2 / 3) * compute / L.m
    dp_exposed = max(0.0, dp_total - hidden_by)
    owned = local if L.zero_stage == 0 else -(-local // replicas)
    optimizer = owned * 2 * RECIPES[recipe].total / C.memory_bandwidth
    total = busy + bubble + dp_exposed + optimizer
    return {"compute": compute, "recompute": recompute, "tp": tp, "pp": pp, "ep": ep, "bubble": bubble,
            "dp_total": dp_total, "dp_exposed": dp_exposed, "optimizer": optimizer, "total": total,
            "flops": flops, "tokens": tokens, "batch": batch,
            "mfu": flops / (total * L.n_gpus * C.peak_flops)}


TERMS = ("compute", "recompute", "tp", "pp", "ep", "bubble", "dp_exposed", "optimizer")
