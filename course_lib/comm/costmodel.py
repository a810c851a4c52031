"""The alpha-beta cost model of communication, fitted here and applied to real clusters.

One message of S bytes over one link takes

    T(S) = alpha + S / beta          alpha: latency (seconds), beta: bandwidth (bytes/second)

(Hockney 1994's model; the course writes it with beta a bandwidth everywhere.) A collective is a
schedule of such messages, so its time is (number of sequential messages) * alpha + (bytes
through the busiest link, sequentially) / beta:

    ring all-reduce          2(N-1) alpha + 2(N-1)/N S/beta
    ring reduce-scatter       (N-1) alpha +  (N-1)/N S/beta        (all-gather: the same)
    tree (recursive          L (alpha + S/beta),  L = log2(p) + 2[N != p],
          doubling)                            p = largest power of two <= N
    rabenseifner             2 log2(p) alpha + 2(p-1)/p S/beta  (+ 2 (alpha + S/beta) if N != p):
                             reduce-scatter by recursive halving + all-gather by recursive doubling
    parameter server         2(N-1) (alpha + S/beta): the server receives N-1 tensors, then
                             sends N-1, over its one link
    sharded parameter server 2(N-1) alpha + 2(N-1)/N S/beta: every rank serves 1/N of the tensor
    pairwise all-to-all       (N-1) alpha +  (N-1)/N S/beta

(The reduction's own arithmetic is left out: on GPUs it hides under the transfer.) Small S:
the alpha terms dominate (latency-bound), so fewer steps win. Large S: the S/beta terms
dominate (bandwidth-bound), so fewer bytes per link win. Recursive doubling beats the ring
below crossover_bytes("tree", "ring", N, link) = (2(N-1) - L) alpha beta / (L - 2(N-1)/N), for
N a power of two; for such N Rabenseifner has the ring's bandwidth term with logarithmic
latency, so in this model it is never slower than the ring (real networks are not this
model: see course_lib.comm.trees).

`ping_pong` measures T(S) between pairs of ranks, `fit_alpha_beta` fits alpha and beta by
least squares, `predict_time` applies the table, `CLUSTERS` holds published link figures.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from course_lib._validate import check_int
from course_lib.clock import synchronize  # the course's one device-aware clock (measured.py imports it from here)

ALGORITHMS = ("ring", "tree", "rabenseifner", "ps", "sharded_ps", "reduce_scatter", "all_gather", "all_to_all")


@dataclass(frozen=True)
class LinkModel:
    """alpha: seconds per message (latency); beta: bytes per second (bandwidth).
    One message of S bytes takes alpha + S / beta."""

    alpha: float
    beta: float
    name: str = ""

    @property
    def bandwidth(self) -> float:
        """Bytes per second (the same as beta)."""
        return self.beta

    def message_time(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


# Published figures (one direction of one GPU's link; the model's beta is per direction).
# Bandwidths are the vendors' decimal units: GB/s = 1e9 bytes/s.
#   NVLink 3 (A100 SXM): "12 third-generation NVLink links, 600 GB/s total" per GPU, i.e.
#     300 GB/s each way. NVIDIA, https://www.nvidia.com/en-us/data-center/nvlink/ and the
#     NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020).
#   NVLink 4 (H100 SXM): 900 GB/s total = 450 GB/s each way (same NVIDIA NVLink page).
#   HDR InfiniBand: 200 Gb/s per port = 25 GB/s each way; ConnectX-6 HDR adapter guide,
#     https://lenovopress.lenovo.com/lp1195 ("200 Gb/s ... sub-600 nanosecond latency").
#   NDR InfiniBand: 400 Gb/s per port = 50 GB/s each way (ConnectX-7).
# Latency (alpha) is what one step of a collective costs end to end, software included, not
#   the wire's nanoseconds: NCCL's own tuning model (NVIDIA/nccl, src/graph/tuning.cc,
#   `baseLat`/`hwLat`) charges a few microseconds per step (0.4-5.7 us on NVLink, 0.9-6.6 us
#   over the network, by protocol) on top of a few-us base. We use round values of that order.
CLUSTERS = {
    "A100 NVLink 3 (intra-node)": LinkModel(alpha=3e-6, beta=300e9, name="A100 NVLink 3"),
    "H100 NVLink 4 (intra-node)": LinkModel(alpha=3e-6, beta=450e9, name="H100 NVLink 4"),
    "HDR InfiniBand 200 Gb/s (inter-node)": LinkModel(alpha=5e-6, beta=25e9, name="HDR IB"),
    "NDR InfiniBand 400 Gb/s (inter-node)": LinkModel(alpha=5e-6, beta=50e9, name="NDR IB"),
}


def cost_terms(algorithm: str, world_size: int) -> tuple[float, float]:
    """(a, b) such that time = a * alpha + b * S / beta for `algorithm` on N ranks."""
    n = world_size
    check_int("world_size", n, rule="an int >= 1")
    if n == 1:
        return 0.0, 0.0
    p = 1 << (n.bit_length() - 1)
    terms = {
        "ring": (2 * (n - 1), 2 * (n - 1) / n),
        "reduce_scatter": (n - 1, (n - 1) / n),
        "all_gather": (n - 1, (n - 1) / n),
        "all_to_all": (n - 1, (n - 1) / n),
        "tree": (math.log2(p) + (2 if n != p else 0),) * 2,
        "rabenseifner": (2 * math.log2(p) + (2 if n != p else 0), 2 * (p - 1) / p + (2 if n != p else 0)),
        "ps": (2 * (n - 1), 2 * (n - 1)),
        "sharded_ps": (2 * (n - 1), 2 * (n - 1) / n),
    }
    if algorithm not in terms:
        raise ValueError(f"algorithm={algorithm!r} is unknown: use one of {', '.join(ALGORITHMS)}")
    return terms[algorithm]


def predict_time(algorithm: str, nbytes: float, world_size: int, link: LinkModel) -> float:
    """Seconds for one `algorithm` collective on a tensor of `nbytes` per rank (see table)."""
    a, b = cost_terms(algorithm, world_size)
    return a * link.alpha + b * nbytes / link.beta


def regime(algorithm: str, nbytes: float, world_size: int, link: LinkModel) -> str:
    """'latency-bound' when the alpha terms outweigh the beta terms, else 'bandwidth-bound'."""
    a, b = cost_terms(algorithm, world_size)
    return "latency-bound" if a * link.alpha > b * nbytes / link.beta else "bandwidth-bound"


def crossover_bytes(algo_a: str, algo_b: str, world_size: int, link: LinkModel) -> float | None:
    """The size S where the two algorithms take equal time, or None if one is never slower.

    a1 alpha + b1 S/beta = a2 alpha + b2 S/beta  gives  S = (a2 - a1) alpha beta / (b1 - b2).
    Below it the algorithm with fewer alpha terms wins, above it the one with fewer bytes."""
    a1, b1 = cost_terms(algo_a, world_size)
    a2, b2 = cost_terms(algo_b, world_size)
    if b1 == b2:
        return None
    s = (a2 - a1) * link.alpha * link.beta / (b1 - b2)
    return s if s > 0 else None


def fit_alpha_beta(sizes_bytes, seconds, name: str = "measured") -> LinkModel:
    """Least-squares fit of t = alpha + S / beta, weighting each point by 1/t.

    The model is linear in alpha and the inverse bandwidth 1/beta, so the fit solves for
    those two and returns beta = 1 / (fitted slope). Plain least squares would let the
    largest messages (the largest times) decide everything and leave alpha as noise;
    weighting by 1/t minimises *relative* error so the small, latency-bound messages pin
    alpha and the large ones pin beta.
    """
    pts = list(zip(sizes_bytes, seconds))
    if len(pts) < 2 or len({s for s, _ in pts}) < 2:
        raise ValueError(f"need at least two distinct message sizes to fit alpha and beta, got {len(pts)} point(s)")
    if any(t <= 0 for _, t in pts):
        raise ValueError("every time must be > 0 seconds")
    # Normal equations of min sum w^2 (alpha + slope*S - t)^2 with w = 1/t, slope = 1/beta.
    w2 = [1.0 / t**2 for _, t in pts]
    s_w, s_ws = sum(w2), sum(w * s for w, (s, _) in zip(w2, pts))
    s_wss = sum(w * s * s for w, (s, _) in zip(w2, pts))
    s_wt = sum(w * t for w, (_, t) in zip(w2, pts))
    s_wst = sum(w * s * t for w, (s, t) in zip(w2, pts))
    det = s_w * s_wss - s_ws**2
    alpha = (s_wss * s_wt - s_ws * s_wst) / det
    slope = (s_w * s_wst - s_ws * s_wt) / det
    if slope <= 0:
        raise ValueError(f"fitted 1/beta={slope:.3g} s/byte is not positive, so no bandwidth beta fits: times do "
                         "not grow with size (measure larger messages or more iterations)")
    return LinkModel(alpha=max(alpha, 0.0), beta=1.0 / slope, name=name)


# ----------------------------------------------------------------------------- measuring (rank code)
def ping_pong(sizes_bytes=(8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22), rounds: int = 5,
              iters: int = 3, warmup: int = 1, all_pairs: bool = False, device=None) -> list[float] | None:
    """Inside rank code on >= 2 ranks: ranks 0 and 1 bounce one message of each size back and
    forth; returns the one-way times on rank 0 (None on the others).

    all_pairs=True: every pair (0,1), (2,3), ... bounces at the same time, so the link is
    measured under the load a collective puts on the machine (every rank busy at once), not
    in isolation; what matters when ranks share CPU cores, as emulated ranks do.

    One-way time = fastest round trip / 2. The minimum, not the mean: on a shared machine
    every disturbance makes a round trip slower, never faster, so the fastest one is the
    best estimate of what the link itself costs. The sizes are measured in `rounds`
    interleaved passes (iters round trips of each size per pass), so a burst of load from
    elsewhere on the machine slows one pass of every size rather than every round trip of
    one size: a single size far off the fitted line is then rare, not a matter of luck.

    device: where the buffers live: the rank's device (`runtime.device.rank_device()` on GPU
    ranks, whose NCCL communicates CUDA tensors only); None is the CPU of gloo ranks. On a
    GPU the clock is read after `synchronize`, so a time is the transfer, not its launch.
    """
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    if n < 2:
        raise ValueError("ping_pong needs at least 2 ranks")
    check_int("rounds", rounds)
    check_int("iters", iters)
    me, peer = rank % 2, rank ^ 1  # me == 0: the pinger of the pair (rank, rank ^ 1)
    active = rank <= 1 or (all_pairs and peer < n)
    best = [float("inf")] * len(sizes_bytes)
    buffers = [torch.zeros(max(1, int(size)), dtype=torch.uint8, device=device) for size in sizes_bytes]
    for round_ in range(rounds if active else 0):
        for i, buf in enumerate(buffers):
            for it in range((warmup if round_ == 0 else 0) + iters):
                t0 = time.perf_counter()
                if me == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                synchronize(device)
                if round_ > 0 or it >= warmup:
                    best[i] = min(best[i], time.perf_counter() - t0)
    dist.barrier()
    return [b / 2 for b in best] if rank == 0 else None


def time_collective(fn, nbytes: int, iters: int = 5, warmup: int = 1, device=None) -> float:
    """Inside rank code: seconds for one call of fn(tensor) on a float32 tensor of `nbytes`.

    Every iteration starts together (barrier) and counts as long as its slowest rank; the
    fastest iteration is returned on every rank (see ping_pong for why the minimum, and for
    `device`).
    """
    import torch
    import torch.distributed as dist

    x = torch.randn(max(1, int(nbytes) // 4), device=device)
    for _ in range(warmup):
        fn(x)
    best = float("inf")
    elapsed = torch.zeros(1, dtype=torch.float64, device=device)
    for _ in range(iters):
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        fn(x)
        synchronize(device)
        elapsed[0] = time.perf_counter() - t0
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    return best
