"""One traffic model per mesh axis: the collectives of one optimizer step, as small records.
One module per axis (tp.py, pp.py, ep.py, cp.py, dp.py with ZeRO and the global norm), all in
the notation below, so a count can be compared across them and a new axis is one more module;
records.py holds the record, how it is priced, and the parameter counts the records are sized by.

Each axis function returns a list of `Collective`s, read by both sides of the course:
the byte accounting of notebook 10 (course_lib.parallel.topology sums `world_bytes` per axis)
and the step-time model of notebook 11 (course_lib.estimate.step_time prices `priced` calls
of `nbytes` on a link and counts `calls`). Each axis package re-exports its function.

Notation: B global batch, R = dp * ep replicas, m micro-batches of mb = B / (R m) sequences of
s tokens, d = d_model, e bytes per element, L blocks (L_0 on rank 0, the busiest: split_layers
gives the first stages the extra blocks), S = pp * v pipeline stages, M = mb s d e (one
micro-batch of the residual stream). Per micro-batch, summed over the pp stages of one replica
and one tp rank (the course's runtime, counted by course_lib.observe.CommTracer):

    tp   4L + 2 all-reduces of M (Megatron's g after attn.proj and mlp.proj, f before qkv and fc,
         g after the vocabulary-parallel embedding, f before the head) + 3 of s mb fp32 numbers
         (the loss: max, sum, target). Sequence parallelism: each all-reduce an all-gather of M
         (sent M / tp) or a reduce-scatter of M (sent M), 2L + 1 of each in forward; backward
         2L + 1 reduce-scatters, 2(2L + 1) all-gathers (the gradient of each forward reduce-
         scatter, and the re-gather of each saved sequence shard), and the gradients of the
         replicated parameters that saw a shard (norms, row-parallel biases, the position table).
         KV heads copied at tp > n_kv_head: per block 2 all-reduces of qkv's K and V rows
         (weight and bias) forward and 2 backward
    pp   2(S - 1) point-to-point messages of M (an activation forward, a gradient backward per
         boundary), the tied embedding's gradient between the end stages (one message each
         way), and the loss broadcast from the last stage
    ep   per MoE block 4 all-to-alls of the mb s top_k routed rows (dispatch, combine, and their
         gradients) + one of E int64 counts; once per step the dense gradients averaged over ep
    cp   per block the attention's K/V traffic of the method: all-gather + reduce-scatter, ring
         hops of K||V and dK||dV, or Ulysses' 4 all-to-alls (cp_traffic)
    dp   the gradients over the replicas (DDP's buckets, or one all-reduce per parameter group;
         ZeRO-1 reduce-scatter + all-gather; ZeRO-2 the reduce-scatter every micro-batch; ZeRO-3
         per block 2 all-gathers and a reduce-scatter; composed with pp / tp, ZeRO-2 and 3 reduce
         once per step and stage 3 gathers 2m or 1 times per unit: zero_pp_ops), and the loss
         averaged over dp for the log
    norm one all-reduce of the squared global norm (8 bytes) over the world

`calls` is what the tracer counts on rank 0 in one step (the first stage). Sequence parallelism's
re-gathers in backward and its flat all-reduce of the replicated parameters' gradients (one per
micro-batch's backward) are `measured_only`: Megatron overlaps the re-gathers with the
weight-gradient matmul and reduces those gradients once per step, so a published cluster leaves
them out; a measured table (the course's runtime, which makes each call) prices them. `priced`
departs from `calls` only where the step-time model says so, each with its reason in the record (`why`):
it prices the busiest rank, l0 blocks and both ends (embedding, head and loss) on one rank
(tp_traffic's rank=r counts pipeline rank r's calls as the runtime makes them instead: what
the step-time model prices on a measured table); `report` marks the trainer's loss log, which the tracer sees and the step
does not need. Full recomputation: the step-time model prices Megatron's (every block's forward
again: 2 all-reduces, Korthikanti et al. 2022); the course's runtime (torch's non-reentrant
checkpoint) stops once the block's saved tensors are back, before the MLP's g: 1 all-reduce.
Precision bf16 (torch.autocast): the row-parallel matmuls' outputs travel as bf16 (see
tp_traffic); the residual stream between stages and the gradients stay fp32.
"""

from __future__ import annotations

from course_lib.estimate.traffic.cp import cp_traffic
from course_lib.estimate.traffic.dp import dp_traffic, norm_traffic, zero_pp_ops
from course_lib.estimate.traffic.ep import ep_traffic
from course_lib.estimate.traffic.pp import pp_traffic
from course_lib.estimate.traffic.records import (WIRE, Collective, ddp_buckets, dense_params, padded_vocab,
                                                  replica_group_params, seconds, total_params,
                                                  tp_replicated_params, wire_bytes)
from course_lib.estimate.traffic.tp import tp_traffic

__all__ = ["Collective", "WIRE", "cp_traffic", "ddp_buckets", "dense_params", "dp_traffic", "ep_traffic",
           "norm_traffic", "padded_vocab", "pp_traffic", "replica_group_params", "seconds", "step_traffic",
           "total_params", "tp_replicated_params", "tp_traffic", "wire_bytes", "zero_pp_ops"]


def step_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
                 grad_bytes: int | None = None, param_bytes: int | None = None,
                 local_params: int | None = None) -> dict[str, list[Collective]]:
    """{axis: its records} for every axis of `dims` (a course_lib.dims.ParallelDims); element
    sizes: act_bytes on the wire for activations, grad_bytes and param_bytes for the model state
    (default act_bytes). local_params: the busiest rank's parameters (default: the average
    rank's, replica_group_params / (pp * ep * tp))."""
    g = act_bytes if grad_bytes is None else grad_bytes
    if local_params is None:  # the average rank's
        local_params = replica_group_params(config, dims) / (dims.pp * dims.ep * dims.tp)
    return {"tp": tp_traffic(config, dims, batch_size, seq, act_bytes, param_bytes=param_bytes),
            "pp": pp_traffic(config, dims, batch_size, seq, act_bytes, g),
            "ep": ep_traffic(config, dims, batch_size, seq, act_bytes, g),
            "dp": dp_traffic(config, dims, batch_size, seq, local_params, g, param_bytes),
            "norm": norm_traffic(dims)} | ({"cp": cp_traffic(config, dims, batch_size, seq, act_bytes)}
                                           if getattr(dims, "cp", 1) > 1 else {})
