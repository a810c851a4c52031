"""What tensor parallelism sends, as formulas (held against CommTracer / CommDebugMode counts).

b = batch, s = sequence, h = d_model, e = bytes per element, N = tp, M = b*s*h*e (one
activation of the residual stream, all tokens). Per transformer layer:

    without SP   forward: 2 all-reduces of M (after attn.proj and mlp.proj: g)
                 backward: 2 all-reduces of M (before qkv and fc: f)
    with SP      forward: 2 all-gathers (M/N in, M out) + 2 reduce-scatters (M in, M/N out)
                 backward: 2 reduce-scatters (input gradients of qkv and fc), 2 all-gathers
                 (gradients of the reduce-scatters) + 2 all-gathers that re-gather the saved
                 sequence shards (Megatron's memory trick); the gradients of the replicated
                 parameters that saw only a shard (LayerNorms, row-parallel biases, the position
                 table) are summed once per backward pass, all in one flat all-reduce

A ring all-reduce puts 2(N-1)/N * M on each rank's link, a ring all-gather or reduce-scatter
(N-1)/N * M: sequence parallelism's pair costs exactly one all-reduce.

Outside the layers: the vocabulary-parallel embedding leaves with g (SP: a reduce-scatter), the
head enters with f (SP: an all-gather), the loss all-reduces 3 fp32 numbers per token.
"""

from __future__ import annotations

import torch.distributed as dist

AG = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
RS = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def layer_communication(batch: int, seq: int, d_model: int, tp: int, sequence_parallel: bool,
                        dtype_bytes: int = 4) -> dict:
    """One layer's collectives: {"forward": {op: calls}, "backward": {op: calls} (parameter
    all-reduces left out), "message_bytes": M, "ring_bytes_forward"/"ring_bytes_backward":
    what a ring puts on each rank's link}."""
    m = batch * seq * d_model * dtype_bytes
    share = (tp - 1) / tp
    if sequence_parallel:
        fwd, bwd = {"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 4, "reduce_scatter": 2}
    else:
        fwd, bwd = {"all_reduce": 2}, {"all_reduce": 2}
    wire = {"all_reduce": 2 * share * m, "all_gather": share * m, "reduce_scatter": share * m}
    return {"forward": fwd, "backward": bwd, "message_bytes": m,
            "ring_bytes_forward": sum(n * wire[op] for op, n in fwd.items()),
            "ring_bytes_backward": sum(n * wire[op] for op, n in bwd.items())}


def _add(table, op, calls, sent, recv):
    row = table.setdefault(op, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0})
    row["calls"] += calls
    row["bytes_sent"] += calls * sent
    row["bytes_recv"] += calls * recv


def step_communication(config, batch: int, seq: int, tp: int, sequence_parallel: bool, dtype_bytes: int = 4) -> dict:
    """{"forward": summary, "backward": summary} of the whole course TP GPT, in CommTracer's
    summary format ({op: {"calls", "bytes_sent", "bytes_recv"}}, logical bytes per rank)."""
    L, m, n = config.n_layer, batch * seq * config.d_model * dtype_bytes, batch * seq
    fwd, bwd = {}, {}
    _add(fwd, "all_reduce", 3, 4 * n, 4 * n)  # loss: max, sum of exponentials, target logit
    if not sequence_parallel:
        _add(fwd, "all_reduce", 2 * L + 1, m, m)  # g in every layer twice, and after the embedding
        _add(bwd, "all_reduce", 2 * L + 1, m, m)  # f before qkv, fc and the head
        return {"forward": fwd, "backward": bwd}
    _add(fwd, AG, 2 * L + 1, m // tp, m)  # into qkv, fc, head
    _add(fwd, RS, 2 * L + 1, m, m // tp)  # out of attn.proj, mlp.proj, the embedding
    _add(bwd, AG, 2 * L + 1, m // tp, m)  # re-gather the saved shards (qkv, fc, head)
    _add(bwd, AG, 2 * L + 1, m // tp, m)  # gradient of every forward reduce-scatter
    _add(bwd, RS, 2 * L + 1, m, m // tp)  # input gradient of qkv, fc, head
    d, b = config.d_model * dtype_bytes, int(config.bias)
    # one flat all-reduce (copy_parameter_to_group): the LayerNorm gains/biases of ln1, ln2 and
    # ln_f, the row-parallel biases of attn.proj and mlp.proj, the position table
    replicated = (L * (2 + 2 * b) + 1 + b + 2 * L * b) * d + config.block_size * d
    _add(bwd, "all_reduce", 1, replicated, replicated)
    return {"forward": fwd, "backward": bwd}
