"""Context parallelism's collectives of one step (course_lib.estimate.traffic: the notation)."""

from __future__ import annotations

from course_lib.estimate.params import kv_rows_per_rank
from course_lib.estimate.traffic.records import Collective, _shape


def cp_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4) -> list[Collective]:
    """Context parallelism's collectives: the attention of every block, per micro-batch, forward
    and backward (course_lib.parallel.cp.attention). Each of the cp ranks of a replica holds s/cp
    tokens of its mb sequences; C = mb (s/cp) kv e / tp is its keys (or values) of one micro-batch
    (kv the key/value width: d_model, or n_kv_head * d_head under grouped-query attention; tp
    splits the heads, or at tp > n_kv_head each rank holds one copied head: kv / tp = d_head) and Q = mb (s/cp) d e / tp its queries.
    K and V travel un-repeated, as course_lib.parallel.cp sends them (it repeats them to the query heads
    after the communication; Ulysses needs cp | the rank's KV heads, dims.check_context_parallel).
    Per block and micro-batch, on every cp rank (dims.cp_method; the layout, contiguous or zig-zag, moves no byte):

        allgather  forward one all-gather of K||V (2C in, 2 cp C out); backward its gradient, one
                   reduce-scatter of dK||dV (2 cp C in)
        ring       forward cp-1 hops of K||V (2C), backward cp-1 hops of K||V again and cp hops of
                   the dK||dV accumulator (2C); a hop is a send and a receive (the tracer counts
                   both: the receives are a record of their own, with no bytes)
        ulysses    forward two all-to-alls, Q||K||V to head shards (Q + 2C) and the output back
                   (Q); backward their gradients (the same sizes)

    Full recomputation runs every block's forward again, its calls included. The gradients'
    average over the cp replicas (whole weights on every cp rank) is data parallelism's."""
    cp = dims.cp
    if cp == 1:
        return []
    method = dims.cp_method
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    L, m, n, R = base.n_layer, dims.microbatches, dims.tp, dims.replicas
    C, Q = mb * (s // cp) * kv_rows_per_rank(config, n) * act_bytes, mb * (s // cp) * base.d_model * act_bytes // n
    fwd = 1 + int(dims.recompute == "full")  # forwards per block and micro-batch

    def rec(what, op, nbytes, per_block, sent, group=cp, priced=None, why=""):
        """per_block calls per block and micro-batch on rank 0, `sent` bytes per call on every
        rank; the world's bytes over the L blocks of R replicas x tp x cp ranks."""
        return Collective("cp", what, op, nbytes, group, m * l0 * per_block, R * n * cp * m * L * per_block * sent,
                          priced, why)

    if method == "allgather":
        return [rec("all-gather of K||V (forward)", "all_gather", 2 * cp * C, fwd, 2 * C),
                rec("reduce-scatter of dK||dV (backward)", "reduce_scatter", 2 * cp * C, 1, 2 * cp * C)]
    if method == "ring":
        hops = (fwd + 1) * (cp - 1) + cp  # K||V forward (again when recomputed) and backward; dK||dV
        return [rec("K||V sent round the ring, forward and backward", "send", 2 * C, (fwd + 1) * (cp - 1), 2 * C, 2),
                rec("the dK||dV accumulators sent round the ring (backward)", "send", 2 * C, cp, 2 * C, 2),
                rec("the receives of those hops", "send", 0, hops, 0, 2, 0, "a receive: its bytes are its send's")]
    return [rec("all-to-alls of Q||K||V to head shards and of their gradients back", "all_to_all", Q + 2 * C,
                fwd + 1, Q + 2 * C),
            rec("all-to-alls of the output back to sequence shards and of its gradient", "all_to_all", Q,
                fwd + 1, Q)]
