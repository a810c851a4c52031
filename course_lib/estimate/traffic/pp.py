"""The pipeline's point-to-point messages of one step (course_lib.estimate.traffic: the notation)."""

from __future__ import annotations

from course_lib.estimate.traffic.records import Collective, _shape


def pp_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
               grad_bytes: int | None = None) -> list[Collective]:
    """The pipeline's point-to-point messages (module docstring)."""
    if dims.pp == 1:
        return []
    base, s, mb, _ = _shape(config, dims, batch_size, seq)
    s //= dims.cp  # context parallelism: a rank's tokens of each sequence
    m, v, n, R = dims.microbatches, dims.virtual_stages, dims.tp, dims.replicas * dims.cp
    # sequence parallelism sends each tp rank's shard of the sequence (Megatron; the runtime's stage.sequence_shards)
    M = mb * s * base.d_model * act_bytes // (n if dims.sequence_parallel else 1)
    # rank 0: v activations sent and v gradients received per micro-batch, and 2 (v - 1) more
    # (its later chunks both receive and send): the step-time model prices a boundary crossing once
    out = [Collective("pp", "activations forward, gradients backward", "send", M, 2, m * (4 * v - 2),
                      R * n * m * 2 * (dims.pp * v - 1) * M, 2 * v * m,
                      "each chunk boundary priced once per direction (the interleaved schedule's v times 1F1B's)"
                      if v > 1 else "")]
    if getattr(base, "tie_weights", False):
        rows = -(-base.vocab_size // n)
        g = rows * base.d_model * (act_bytes if grad_bytes is None else grad_bytes)
        out.append(Collective("pp", "the tied embedding's gradient between the end stages", "send", g, 2, 2,
                              R * n * 2 * g))
    # the mean loss, broadcast from the last stage at the end of the schedule (run_schedule returns it to
    # every rank): inside the step the trainer times, on the path of every rank that waits for it, so
    # priced (a binomial tree: records.broadcast_hops); not the trainer's loss log, which comes after
    out.append(Collective("pp", "the loss, broadcast from the last stage", "broadcast", 4, dims.pp, 1, R * n * 4))
    return out
