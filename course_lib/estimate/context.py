"""Context parallelism's formulas (notebook 09): the causal attention work of each rank, the
part of the ring's traffic its compute does not cover, and the numbers of the notebook's widget.
Pure Python; the runtime that these formulas describe is course_lib.parallel.cp (which sits
above this package: its tests hold its counts against the closed forms here).

    attention_pairs(seq, cp, load_balance)       causal (query, key) pairs per rank, closed form
    attention_imbalance(seq, cp, load_balance)   the busiest rank's pairs over an even share
    ring_exposed(config, dims, micro_batch, seq, link, flops, act_bytes, causal)
                                                 seconds per layer and micro-batch the ring adds
    cp_costs(config, seq, cp, method, ...)       activations and bytes per rank: the widget's row

The sequence of T tokens is cut into equal chunks (course_lib.dims.check_context_parallel):
contiguous, cp chunks of c = T/cp, rank r holding chunk r; zig-zag (load_balance=True), 2cp
chunks of c = T/(2cp), rank r holding chunks r and 2cp-1-r. Under a causal mask the query at
position p scores the p + 1 keys 0..p, so a chunk of c queries starting at a scores
c*a + c(c+1)/2 pairs.
"""

from __future__ import annotations

from dataclasses import replace

from course_lib.comm.measured import collective_time
from course_lib.dims import ParallelDims, check_context_parallel
from course_lib.estimate.memory import activation_bytes
from course_lib.estimate.params import MoEConfig, kv_rows_per_rank, model_shape, positive_int
from course_lib.estimate.traffic import cp_traffic, wire_bytes


def attention_pairs(seq: int, cp: int, load_balance: bool = True) -> list[int]:
    """Causal (query, key) pairs each of the cp ranks scores, its queries against every key:

        contiguous, c = T/cp:     W_r = c^2 r + c(c+1)/2          (the last rank ~ 2cp-1 times the first)
        zig-zag,    c = T/(2cp):  W_r = c^2 (2cp-1) + c(c+1)      (the same on every rank)

    Both sum to T(T+1)/2, the whole causal triangle; the busiest contiguous rank scores
    about (2cp-1)/cp^2 of it instead of 1/cp."""
    seq = positive_int("seq", seq)
    check_context_parallel(cp, seq, None, "ring", load_balance)
    if cp == 1:
        return [seq * (seq + 1) // 2]
    if load_balance:
        c = seq // (2 * cp)
        return [c * c * (2 * cp - 1) + c * (c + 1)] * cp
    c = seq // cp
    return [c * c * r + c * (c + 1) // 2 for r in range(cp)]


def attention_imbalance(seq: int, cp: int, load_balance: bool = True) -> float:
    """cp * max_r W_r / (T(T+1)/2): how many times an even share of the causal attention work
    the busiest rank does (1 for zig-zag; (2cp-1)/cp as T grows for contiguous chunks)."""
    return cp * max(attention_pairs(seq, cp, load_balance)) / (seq * (seq + 1) // 2)


def ring_exposed(config, dims: ParallelDims, micro_batch: int, seq: int, link, flops: float,
                 act_bytes: int = 2, causal: bool = False) -> dict[str, float]:
    """{"forward", "backward"}: seconds of ring traffic per layer and micro-batch that the
    attention compute of the busiest rank does not cover.

    One hop sends the rank's K||V block, kv = 2 b (T/cp) n_kv d_head e / tp bytes (the tp rank's
    heads; 2 b (T/cp) d_head e at tp > n_kv_head, its one copied head), t_kv = collective_time(link, "send", kv, 2), while the rank attends its queries to
    the block it holds: t_f = f * 4 b (T/cp)^2 d / tp / flops (QK^T and PV of one block pair,
    2 FLOPs a multiply-add). f, the visible part of a block pair under the causal mask: 1/2
    with zig-zag chunks (every off-diagonal pair half visible), 1 for the busiest contiguous
    rank (the last: every earlier block whole), 1 without a mask.

        forward    (cp - 1) max(0, t_kv - t_f)
        backward   (cp - 1) max(0, 2 t_kv - 2 t_f) + t_kv

    backward: K||V and the accumulated dK||dV (as large) travel together against twice the
    forward's compute, and after the last step one more hop brings each dK||dV home."""
    cp = dims.cp
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    base = model_shape(config).base
    q = seq // cp
    kv = 2 * micro_batch * q * (dims.tp * kv_rows_per_rank(config, dims.tp)) * act_bytes / dims.tp  # a copied head's
    t_kv = collective_time(link, "send", kv, 2)
    visible = 0.5 if causal and dims.cp_load_balance else 1.0
    t_f = visible * 4 * micro_batch * q * q * base.d_model / dims.tp / flops
    return {"forward": (cp - 1) * max(0.0, t_kv - t_f),
            "backward": (cp - 1) * max(0.0, 2 * t_kv - 2 * t_f) + t_kv}


def cp_costs(config, seq: int, cp: int, method: str = "ring", load_balance: bool = True, batch: int = 1,
             dtype_bytes: int = 2) -> dict:
    """One point of the widget (sequence length x cp x method), for one rank of a cp group
    holding `batch` rows of `seq` tokens (no tp, no pp; fused attention: what the three methods
    keep, course_lib.estimate.memory.activation_bytes):

        {"seq_per_rank", "activations_per_layer", "activations" (all layers and the ends),
         "bytes_per_layer" (sent by the rank per layer, forward + backward: cp_traffic's records),
         "calls_per_layer", "attention_pairs" (per rank), "imbalance"}

    seq may exceed config.block_size: the model is costed with a context window of seq (its
    position table, if any, grows; nothing else changes)."""
    base = model_shape(config).base
    seq, batch = positive_int("seq", seq), positive_int("batch", batch)
    check_context_parallel(cp, seq, base.n_head, method, load_balance, getattr(base, "n_kv_head", None))
    if seq > base.block_size:
        config = _with_window(config, seq)
        base = model_shape(config).base
    act = activation_bytes(config, batch, seq, dtype_bytes, attention="fused", cp=cp, cp_method=method)
    dims = ParallelDims(cp=cp, cp_method=method, cp_load_balance=load_balance)
    records = [r for r in cp_traffic(config, dims, batch, seq, dtype_bytes) if not r.report]
    return {"seq_per_rank": seq // cp, "activations_per_layer": act["per_layer"], "activations": act["total"],
            "bytes_per_layer": sum(wire_bytes(r) for r in records) / base.n_layer,
            "calls_per_layer": sum(r.calls for r in records) / base.n_layer,
            "attention_pairs": attention_pairs(seq, cp, load_balance),
            "imbalance": attention_imbalance(seq, cp, load_balance)}


def _with_window(config, seq: int):
    """config with block_size = seq (an MoEConfig: its base's)."""
    if isinstance(config, MoEConfig):
        return replace(config, base=replace(config.base, block_size=seq))
    return replace(config, block_size=seq)
