"""Published clusters as course_lib.estimate.cluster.Cluster values (notebook 11).

    gpu_cluster(gpu, n_gpus, gpus_per_node=8)    a cluster of one of calculator.GPUS
    PUBLISHED                                     the runs the planner is held against
    LONG_CONTEXT                                  a published run with context parallelism (notebook 09)
    ROCE_400                                      Llama 3 405B's network link (RoCE, 400 Gb/s per GPU)
    published_estimate(name, **changes)           the estimator's memory and step time of one of them

Links per direction, from course_lib.comm.costmodel.CLUSTERS (NVLink 3/4, HDR/NDR InfiniBand)
plus NVLink 5 (B200: 1.8 TB/s total per GPU = 900 GB/s each way, NVIDIA's NVLink page), for
which GB200 NVL72 racks put 72 GPUs in one NVLink domain (gpus_per_node=72). Every GPU has its own network port
(DGX/HGX nodes: one 200 or 400 Gb/s NIC per GPU). HBM bandwidth (spec sheets): A100 80 GB
2.0 TB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s, B200 and GB200 8 TB/s.

achievable_flops is an assumption, not a measurement: 75% of the dense peak, about what large
bf16 GEMMs reach on these parts; course_lib.measure.calibrate measures it on the machine at hand instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib.comm.costmodel import CLUSTERS as LINKS, LinkModel
from course_lib.estimate.calculator import GPUS
from course_lib.estimate.params import GPT3_175B, LLAMA3_405B
from course_lib.dims import ParallelDims
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.step_time import memory_per_rank, step_time

GEMM_EFFICIENCY = 0.75
_NVLINK5 = LinkModel(alpha=3e-6, beta=900e9, name="NVLink 5")
_FABRIC = {  # gpu -> (intra-node link, network link per GPU, HBM bytes/s)
    "A100 SXM 80 GB": (LINKS["A100 NVLink 3 (intra-node)"], LINKS["HDR InfiniBand 200 Gb/s (inter-node)"], 2.0e12),
    "H100 SXM 80 GB": (LINKS["H100 NVLink 4 (intra-node)"], LINKS["NDR InfiniBand 400 Gb/s (inter-node)"], 3.35e12),
    "H200 SXM 141 GB": (LINKS["H100 NVLink 4 (intra-node)"], LINKS["NDR InfiniBand 400 Gb/s (inter-node)"], 4.8e12),
    "B200 180 GB": (_NVLINK5, LINKS["NDR InfiniBand 400 Gb/s (inter-node)"], 8.0e12),
    "GB200 186 GB": (_NVLINK5, LINKS["NDR InfiniBand 400 Gb/s (inter-node)"], 8.0e12),  # 576 TB/s per NVL72 rack
}


@dataclass(frozen=True)
class GPUCluster(Cluster):
    """A Cluster of spec-sheet GPUs, with the FP8 matmul rates the "fp8" recipe's linears run at
    (step_time reads achievable_fp8_flops; 0 where the GPU has no FP8 peak entered)."""

    peak_fp8_flops: float = 0.0
    achievable_fp8_flops: float = 0.0


def gpu_cluster(gpu: str, n_gpus: int, gpus_per_node: int = 8, recipe: str = "bf16_mixed") -> GPUCluster:
    """n_gpus of `gpu` (a key of _FABRIC), gpus_per_node sharing one NVLink domain. The FP8
    rate is assumed to reach the same GEMM_EFFICIENCY of its peak as bf16 does of its own."""
    if gpu not in _FABRIC:
        raise ValueError(f"gpu={gpu!r} must be one of {tuple(_FABRIC)}")
    spec, (intra, inter, hbm) = GPUS[gpu], _FABRIC[gpu]
    peak = spec.peak_tf32 if recipe == "fp32" else spec.peak_bf16
    return GPUCluster(f"{n_gpus} x {gpu}", n_gpus, gpus_per_node, peak, GEMM_EFFICIENCY * peak, spec.memory,
                      intra, inter, memory_bandwidth=hbm, peak_fp8_flops=spec.peak_fp8,
                      achievable_fp8_flops=GEMM_EFFICIENCY * spec.peak_fp8)


# Llama 3 405B trained on RDMA over Converged Ethernet (RoCE), the smaller Llama 3 models on
# InfiniBand, both at 400 Gb/s per GPU (Dubey et al. 2024, §3.3.1). The course prices RoCE with
# NDR InfiniBand's figures (the same 50 GB/s each way; the paper gives no latency, NDR's 5 us
# kept), under its own name, so that what prints a link names the one the run used.
ROCE_400 = replace(LINKS["NDR InfiniBand 400 Gb/s (inter-node)"], name="RoCE 400 Gb/s")
_LLAMA3_CLUSTER = replace(gpu_cluster("H100 SXM 80 GB", 16384), inter=ROCE_400)

# 126 layers do not split into 16 stages; Llama 3 gave the first and last stages one layer
# less (they hold the embedding and the head). We mimic that with 128 equal layers: the two
# extra layers stand for the embedding and head stages' work (1.6% more FLOPs).
LLAMA3_405B_128 = replace(LLAMA3_405B, n_layer=128)

# What the papers ran, and what they report. MFU here is model FLOPs (recomputation excluded)
# per second over peak; Narayanan et al. count the recomputed forward too ("hardware FLOPs").
PUBLISHED = {
    "GPT-3 175B on 1024 A100": dict(
        config=GPT3_175B, cluster=gpu_cluster("A100 SXM 80 GB", 1024), global_batch=1536, seq=2048,
        dims=ParallelDims(dp=8, tp=8, pp=16, virtual_stages=2, microbatches=1536 // 8, recompute="full",
                            schedule="interleaved_1f1b", sequence_parallel=False),
        reported="Narayanan et al. 2021, §5.1: 140 TFLOP/s per GPU for GPT-3 175B on 1024 A100s at batch "
                 "1536 = 45% of peak counting the recomputed forward (x 3/4 without it: about 34% MFU); "
                 "layout tp 8, pp 16, dp 8 from the Megatron-LM README's GPT-3 175B example (Table 1 has "
                 "no 175B row); v = 2 is the course's assumption",
        reported_mfu=0.45 * 3 / 4),
    "Llama 3 405B on 16k H100": dict(
        config=LLAMA3_405B_128, cluster=_LLAMA3_CLUSTER, global_batch=2048, seq=8192,
        dims=ParallelDims(dp=128, tp=8, pp=16, microbatches=16, zero=1, recompute="none",
                            schedule="1f1b", sequence_parallel=True),
        reported="Dubey et al. 2024, Table 4: tp 8, cp 1, pp 16, dp 128, 16M tokens per batch, "
                   "about 400 TFLOP/s per GPU, 38-43% BF16 MFU across their configurations",
        reported_mfu=0.41),
}

# Llama 3's long-context stage: 131,072-token sequences, 16M tokens per batch (128 sequences),
# tp 8, cp 16, pp 16 on 16,384 H100s at 380 TFLOP/s per GPU (Dubey et al. 2024, Table 4, as
# Balaji's SC'24 slide repeats it). dp = 16,384 / (8 * 16 * 16) = 8, what the product leaves:
# 16 sequences per replica. From the paper (§3.3.2): context parallelism that all-gathers K and
# V, each sequence cut into 2 cp chunks, rank r holding chunks r and 2cp - 1 - r (zig-zag; the
# paper's document masks are left out: plain causal attention). Simplified as in PUBLISHED
# (notebook 10, section 7): ZeRO-1 and plain 1F1B where the paper ran FSDP without resharding
# after forward and an interleaved schedule. Not in the paper, the course's choice: full
# recomputation (without it the estimator puts even the 8K stage's activations above 80 GB) and
# one sequence per micro-batch.
LONG_CONTEXT = {
    "Llama 3 405B 128K on 16k H100": dict(
        config=replace(LLAMA3_405B_128, block_size=131072), cluster=_LLAMA3_CLUSTER,
        global_batch=128, seq=131072, causal=True,
        dims=ParallelDims(dp=8, tp=8, pp=16, cp=16, cp_method="allgather", microbatches=16, zero=1,
                          recompute="full", schedule="1f1b", sequence_parallel=True),
        reported="Dubey et al. 2024, Table 4: tp 8, cp 16, pp 16 on 16,384 H100s, sequences of 131,072 "
                 "tokens, 16M tokens per batch, 380 TFLOP/s per GPU",
        reported_mfu=380e12 / 989e12),
}


def published_estimate(name: str, **changes) -> dict:
    """The estimator on a run of PUBLISHED or LONG_CONTEXT, with `changes` to its layout (e.g.
    cp=1: the same other degrees without context parallelism, on pp * dp * tp GPUs):
    {"dims", "memory" (memory_per_rank's bytes), "time" (step_time's seconds), "fits" (in the
    GPU's memory_bytes, 80 GB for an H100)}."""
    runs = {**PUBLISHED, **LONG_CONTEXT}
    if name not in runs:
        raise ValueError(f"name={name!r} must be one of {list(runs)}")
    run = runs[name]
    dims = replace(run["dims"], **changes)
    args = (run["config"], dims)
    memory = memory_per_rank(*args, run["global_batch"], run["seq"])
    time = step_time(*args, run["cluster"], run["global_batch"], run["seq"], causal=run.get("causal", False))
    return {"dims": dims, "memory": memory, "time": time, "fits": memory["total"] <= run["cluster"].memory_bytes}
