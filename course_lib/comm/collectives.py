"""Collectives built from point-to-point messages only (send / recv / isend / irecv).

Every function here runs inside rank code (e.g. under `run_on_ranks`) and gives the same
answer as its `torch.distributed` built-in; what differs is *how the bytes travel*, which
is the point of notebook 02. With N ranks and a tensor of S bytes per rank:

    algorithm              messages on the critical path   bytes sent by the busiest rank
    ring_reduce_scatter    N-1                              (N-1)/N * S
    ring_all_gather        N-1                              (N-1)/N * S
    ring_all_reduce        2(N-1)                           2(N-1)/N * S   (RS then AG)
    tree_all_reduce        log2(p) (+2 if N != p)           log2(p) * S (+S), p = 2**floor(log2 N)
    ps_all_reduce          2(N-1) through the server        (N-1) * S      (the server)
    pairwise_all_to_all    N-1                              (N-1)/N * S

The ring's per-rank traffic barely grows with N (it tends to 2S) and every link is busy
at every step; the parameter server's grows linearly with N on one machine. That is
the whole argument for rings (Baidu 2017, Horovod): see `course_lib.comm.costmodel`.

Chunks: a tensor of numel elements is cut into N contiguous chunks exactly like
`torch.tensor_split(flat, N)` (the first numel % N chunks are one element longer; chunks
may be empty when numel < N). Rank r owns chunk r after a reduce-scatter, as with the
built-in. Empty chunks send no message.

The ring schedule lives in ONE function, `ring_send_chunk`, used by the ring code below
and by the pure-Python simulation in `course_lib.comm.ringviz`, so the picture cannot drift
from the code.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- helpers
def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[(start, end)] of the N chunks of a flat tensor, same split as torch.tensor_split."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    q, rem = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + q + (1 if i < rem else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_send_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk `rank` sends to its right neighbour (rank+1) at `step` of a ring all-reduce.

    Steps 0..N-2 are the reduce-scatter phase (the receiver adds the chunk to its own),
    steps N-1..2N-3 the all-gather phase (the receiver overwrites its copy). One formula
    serves both phases:

        send chunk = (rank - step - 1) mod N,    receive chunk = ring_send_chunk(rank - 1, step)

    Each rank forwards at step k+1 exactly the chunk it received (and summed) at step k, so
    chunk c travels once around the ring picking up one contribution per hop; after step N-2
    rank r holds the complete sum of chunk r (what a reduce-scatter must leave), and at step
    N-1 it starts by sending that chunk.
    """
    return (rank - step - 1) % world_size


def _rank_and_size(group) -> tuple[int, int]:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this rank is not a member of `group`: only members may call the collective")
    return rank, n


def _global(group, group_rank: int) -> int:
    """send/recv take global ranks; translate a rank within `group`."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _flat(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """A 1-D view sharing memory with `tensor` (in-place collectives need one flat buffer)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first): "
                         "the collectives work in place on one flat buffer")
    return tensor.view(-1)


def _exchange(send_buf, dst, recv_buf, src, group):
    """Send to dst while receiving from src; both directions overlap. Empty buffers are skipped."""
    works = []
    if send_buf is not None and send_buf.numel():
        works.append(dist.isend(send_buf, _global(group, dst), group=group))
    if recv_buf is not None and recv_buf.numel():
        works.append(dist.irecv(recv_buf, _global(group, src), group=group))
    for w in works:
        w.wait()


# ----------------------------------------------------------------------------- the ring
def _ring_steps(flat: torch.Tensor, steps: range, group, on_step) -> None:
    """Run ring steps `steps` on `flat` in place (see ring_send_chunk for the schedule)."""
    rank, n = _rank_and_size(group)
    chunks = [flat[s:e] for s, e in chunk_bounds(flat.numel(), n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    # One scratch buffer for the whole call (no per-step allocation): in the reduce-scatter
    # phase the incoming chunk must be added, so it cannot land directly in place.
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype, device=flat.device)
    for step in steps:
        send = chunks[ring_send_chunk(rank, step, n)]
        target = chunks[ring_send_chunk(left, step, n)]
        if step < n - 1:  # reduce-scatter: receive into scratch, then add in place
            incoming = scratch[: target.numel()]
            _exchange(send, right, incoming, left, group)
            torch.add(target, incoming, out=target)
        else:  # all-gather: the incoming chunk is final, receive it straight into place
            _exchange(send, right, target, left, group)
        if on_step is not None:
            on_step(step, flat)


def ring_reduce_scatter(tensor: torch.Tensor, group=None, on_step=None) -> torch.Tensor:
    """Sum `tensor` over ranks; rank r ends with the complete sum of chunk r. N-1 steps.

    Works in place: `tensor` is the send buffer and the work space (its other chunks hold
    partial sums afterwards). Returns the view of chunk r (`torch.tensor_split` chunking).
    Each rank sends and receives (N-1)/N * S bytes.
    on_step(step, flat_tensor), if given, is called after every step (for visualisation).
    """
    flat = _flat(tensor)
    rank, n = _rank_and_size(group)
    _ring_steps(flat, range(0, n - 1), group, on_step)
    start, end = chunk_bounds(flat.numel(), n)[rank]
    return flat[start:end]


def ring_all_gather(tensor: torch.Tensor, group=None, on_step=None) -> torch.Tensor:
    """In-place all-gather: on entry chunk r of `tensor` holds rank r's piece; on return every
    rank holds every piece. N-1 steps, (N-1)/N * S bytes sent and received per rank.

    This is the all-gather phase of the ring all-reduce (steps N-1..2N-3 of the schedule).
    Returns `tensor`.
    """
    flat = _flat(tensor)
    _, n = _rank_and_size(group)
    _ring_steps(flat, range(n - 1, 2 * (n - 1)), group, on_step)
    return tensor


def ring_all_reduce(tensor: torch.Tensor, group=None, on_step=None) -> torch.Tensor:
    """Sum `tensor` over ranks in place: ring reduce-scatter, then ring all-gather.

    Time ~ 2(N-1) * alpha + 2(N-1)/N * S * beta: the bandwidth term is almost independent
    of N, which is why rings scale. Each chunk is summed in one fixed order on one rank and
    then copied, so every rank ends with bit-identical values. Returns `tensor`.
    """
    flat = _flat(tensor)
    _, n = _rank_and_size(group)
    _ring_steps(flat, range(0, 2 * (n - 1)), group, on_step)
    return tensor


# ----------------------------------------------------------------------------- tree
def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum in place by recursive doubling (a butterfly of log2 N pairwise exchanges).

    At round j rank r swaps its whole partial sum with rank r XOR 2**j and adds: after
    log2(p) rounds every rank holds the total. Few messages (good for small, latency-bound
    tensors) but each carries the full S bytes (bad for large ones).

    Non-power-of-two N: let p = largest power of two <= N. Ranks p..N-1 first hand their
    tensor to rank r-p (which adds it), sit out the butterfly, and receive the result at the
    end. Time ~ (log2 p + 2[N != p]) * (alpha + S * beta). Partners add the same two values
    (a+b == b+a exactly), so all ranks end bit-identical. Returns `tensor`.
    """
    flat = _flat(tensor)
    rank, n = _rank_and_size(group)
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if rank >= p:  # folded-in rank: contribute, then wait for the answer
        _exchange(flat, rank - p, None, None, group)
        _exchange(None, None, flat, rank - p, group)
        return tensor
    scratch = torch.empty_like(flat)
    if rank < extra:
        _exchange(None, None, scratch, rank + p, group)
        flat.add_(scratch)
    mask = 1
    while mask < p:
        partner = rank ^ mask
        _exchange(flat, partner, scratch, partner, group)
        flat.add_(scratch)
        mask <<= 1
    if rank < extra:
        _exchange(flat, rank + p, None, None, group)
    return tensor


# ----------------------------------------------------------------------------- parameter server
def ps_all_reduce(tensor: torch.Tensor, group=None, server: int = 0) -> torch.Tensor:
    """Sum in place through one parameter server: everyone sends to `server`, it adds the
    N-1 tensors (in rank order, so the result is deterministic) and sends the sum back.

    The server receives and sends (N-1) * S bytes while workers send and receive only S:
    its link is the bottleneck, time ~ 2(N-1) * (alpha + S * beta). Returns `tensor`.
    """
    flat = _flat(tensor)
    rank, n = _rank_and_size(group)
    if not 0 <= server < n:
        raise ValueError(f"server={server} must be a rank of the group (0..{n - 1})")
    if rank != server:
        _exchange(flat, server, None, None, group)   # push my gradient
        _exchange(None, None, flat, server, group)   # pull the sum
        return tensor
    scratch = torch.empty_like(flat)
    for src in range(n):
        if src != server:
            _exchange(None, None, scratch, src, group)
            flat.add_(scratch)
    works = [dist.isend(flat, _global(group, dst), group=group) for dst in range(n) if dst != server and flat.numel()]
    for w in works:
        w.wait()
    return tensor


# ----------------------------------------------------------------------------- all-to-all
def pairwise_all_to_all(output_list: list[torch.Tensor], input_list: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """input_list[j] goes to rank j; output_list[j] receives what rank j sent here.

    Same contract as `dist.all_to_all`, but sizes may differ per pair (expert-parallel token
    dispatch needs that). N-1 rounds: at round k rank r sends to r+k and
    receives from r-k, so every rank is busy sending and receiving in every round, and
    each pair talks exactly once. (N-1)/N * S bytes each way per rank when splits are even.
    """
    rank, n = _rank_and_size(group)
    if len(input_list) != n or len(output_list) != n:
        raise ValueError(f"input_list and output_list need one tensor per rank ({n}), "
                         f"got {len(input_list)} and {len(output_list)}")
    output_list[rank].copy_(input_list[rank])
    for k in range(1, n):
        dst, src = (rank + k) % n, (rank - k) % n
        _exchange(input_list[dst], dst, output_list[src], src, group)
    return output_list


ALL_REDUCE_ALGORITHMS = {"ring": ring_all_reduce, "tree": tree_all_reduce, "ps": ps_all_reduce}


def theory_bytes_sent(algorithm: str, nbytes: int, world_size: int, rank: int | None = None) -> float:
    """Bytes a rank sends under `algorithm` (the busiest rank when rank is None; the parameter
    server is rank 0), from the formulas in the module docstring, ignoring chunk rounding
    (exact when N divides numel)."""
    n, s = world_size, nbytes
    p = 1 << (n.bit_length() - 1)
    table = {
        "ring": 2 * (n - 1) / n * s,
        "reduce_scatter": (n - 1) / n * s,
        "all_gather": (n - 1) / n * s,
        "all_to_all": (n - 1) / n * s,
        "ps": (n - 1) * s if rank in (None, 0) else s,
    }
    if algorithm == "tree":
        if rank is None:
            return (math.log2(p) + (1 if n > p else 0)) * s
        if rank >= p:
            return s
        return (math.log2(p) + (1 if rank < n - p else 0)) * s
    if algorithm not in table:
        raise ValueError(f"algorithm={algorithm!r} is unknown: use one of {sorted(table) + ['tree']}")
    return table[algorithm]
