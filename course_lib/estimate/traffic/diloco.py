"""LocalSGD's and DiLoCo's traffic across replicas: the whole model every H steps, or Streaming
DiLoCo's fragments at staggered steps (course_lib.parallel.diloco runs them).

Notation: P the model's parameters (a tied weight once), L blocks, F fragments, H inner steps,
e bytes per communicated element (4 fp32, 2 bf16), R replicas. What one rank hands to the
network across replicas after step t (the tracer's bytes_sent: an all-reduce's or all-gather's
input buffer):

    DDP                          P * 4 every step (its buckets' gradients)
    LocalSGD, DiLoCo (F = 1)     P * e at the steps t % H == 0, else 0:  P e / H per step on average
    Streaming DiLoCo (F)         P_f * e for the fragments f with (t - f H / F) % H == 0 (one per
                                 step at most), P_f = (L / F) * block + embeddings (f = 0) + final
                                 norm and untied head (f = F - 1): the peak is max_f P_f e ~ P e / F,
                                 the average the same P e / H

and nothing when R = 1 (no other replica to meet).

FSDP-sharded replicas (shards = S > 1, each replica's S ranks sharding every tensor on dim 0 as
FSDP2 does, course_lib.parallel.zero's per-parameter design): rank j holds rows [j c, (j + 1) c)
of each tensor of d0 rows, c = ceil(d0 / S) (the last rank(s) padded with zero rows), and syncs
only those with rank j of the other replicas (an HSDP-like layout). What it sends is then
P_f^(S) * e, P_f^(S) = sum over fragment f's tensors of ceil(d0 / S) * (elements / d0): ~P_f / S,
a little more where S does not divide d0 (the padding travels too). The schedule (sync_offsets, due) is defined
here and the runtime reads it, so the formula and the run agree on *when*; *what* they count
is their own (this module from the configuration, the run from its tensors).
"""

from __future__ import annotations

from course_lib.estimate.params import cdiv, ff_dim, kv_dim, model_shape, param_breakdown
from course_lib.model.config import GPTConfig
from course_lib.estimate.traffic.records import total_params


def sync_offsets(inner_steps: int, fragments: int) -> list[int]:
    """t_f = f H / F: the step offset of each fragment's syncs (fragments divides inner_steps)."""
    return [f * inner_steps // fragments for f in range(fragments)]


def due(step: int, inner_steps: int, fragments: int = 1) -> list[int]:
    """The fragments synced after step `step` (1-based): those f with step >= t_f and
    (step - t_f) % H == 0. F = 1: [0] at the steps H, 2H, ..."""
    return [f for f, t in enumerate(sync_offsets(inner_steps, fragments)) if step >= t and (step - t) % inner_steps == 0]


def fragment_param_counts(config, fragments: int = 1) -> list[int]:
    """P_f of each fragment (module docstring): block i in fragment i % F, the embeddings in
    fragment 0, the final norm and an untied head in fragment F - 1."""
    parts = param_breakdown(config)
    first = parts["embedding"] + parts["position"]
    last = parts["final_norm"] + parts["head"]
    n_layer = config.n_layer
    block = (total_params(config) - first - last) // n_layer
    counts = [(n_layer // fragments) * block] * fragments
    counts[0] += first
    counts[-1] += last
    return counts


def gpt_tensors(config) -> list[tuple[int, int, int]]:
    """(fragment key, d0, elements) of each tensor of the course GPT (param_breakdown's parts, one
    tensor at a time): key i >= 0 for block i, -1 for the embeddings, -2 for the final norm and an
    untied head."""
    base = model_shape(config).base
    if not isinstance(base, GPTConfig):
        raise ValueError(f"{type(config).__name__}: the sharded sync's formula knows the course GPT's tensors only")
    d, f, v, qkv, b = base.d_model, ff_dim(base), base.vocab_size, base.d_model + 2 * kv_dim(base), base.bias
    block = [(d, d), (qkv, qkv * d), (d, d * d), (d, d), (f, f * d), (d, d * f)]  # norms, qkv, proj, fc, proj
    block += [(d, d), (qkv, qkv), (d, d), (d, d), (f, f), (d, d)] if b else []  # their biases
    out = [(-1, v, v * d), (-1, base.block_size, base.block_size * d), (-2, d, d)] + ([(-2, d, d)] if b else [])
    out += [] if base.tie_weights else [(-2, v, v * d)]
    return out + [(i, d0, n) for i in range(base.n_layer) for d0, n in block]


def sharded_fragment_counts(config, fragments: int = 1, shards: int = 1) -> list[int]:
    """P_f^(S): the elements one of S ranks holds of each fragment, every tensor cut on dim 0 into
    row blocks of ceil(d0 / S) rows (module docstring); shards = 1 is fragment_param_counts."""
    counts = [0] * fragments
    for key, d0, n in gpt_tensors(config):
        f = key % fragments if key >= 0 else (0 if key == -1 else fragments - 1)
        counts[f] += cdiv(d0, shards) * (n // d0)
    return counts


def diloco_sync_bytes(config, replicas: int, inner_steps: int, steps: int, fragments: int = 1,
                      outer_bytes: int = 4, shards: int = 1) -> list[int]:
    """Bytes one rank sends across replicas after each step 1..steps (module docstring); shards = S
    > 1: FSDP-sharded replicas, each rank sending its rows only."""
    if replicas == 1:
        return [0] * steps
    counts = fragment_param_counts(config, fragments) if shards == 1 else sharded_fragment_counts(config, fragments,
                                                                                                  shards)
    return [sum(counts[f] for f in due(t, inner_steps, fragments)) * outer_bytes for t in range(1, steps + 1)]


def ddp_bytes_per_step(config, grad_bytes: int = 4) -> int:
    """DDP's gradients, every step: P * grad_bytes (the sum of its buckets' all-reduce inputs)."""
    return total_params(config) * grad_bytes
