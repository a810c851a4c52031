"""Context parallelism (notebook 09): the sequence of every layer's input split over a cp group.

    layout.py      which positions each rank holds (contiguous or zig-zag chunks), the shard of a
                   tensor and back, the causal attention work per rank (pure torch)
    blocks.py      attention of a query block against a key block by absolute positions, the
                   log-sum-exp merge of partial results, one block's backward (pure torch)
    ring.py        ring attention: K/V round the ring with send/recv, backward a second ring
    ulysses.py     DeepSpeed-Ulysses: all-to-all from sequence shards to head shards and back
    attention.py   context_attention(q, k, v, q_pos, group, layout, method) with method
                   "allgather", "ring" or "ulysses" (the calls each makes), and
                   ContextParallelAttention, the drop-in for the model's CausalAttention
    apply.py       apply_context_parallel(model, group, method, load_balance): every block's attention
                   swapped, the layout kept; shard_batch (a batch's tokens and positions per rank)
    training.py    the reference training loop on dp x cp ranks (train/run_context_parallel)
"""

from course_lib.parallel.cp.attention import ContextParallelAttention, context_attention
from course_lib.parallel.cp.blocks import block_attention, merge_partials
from course_lib.parallel.cp.layout import (
    SequenceLayout,
    attention_work,
    chunk_ids,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from course_lib.parallel.cp.ring import ring_work
# the strategy (apply.py, training.py) and this axis's per-step collectives (the records the byte
# accounting and the step-time model read)
from course_lib.estimate.traffic import cp_traffic
from course_lib.parallel.cp.apply import (ContextParallelInfo, apply_context_parallel, context_parallel_loss,
                                          cp_placements, set_sequence_length, shard_batch)
from course_lib.parallel.cp.training import run_context_parallel, train_context_parallel

__all__ = [
    "SequenceLayout", "chunk_ids", "shard_positions", "shard_sequence", "unshard_sequence", "attention_work",
    "block_attention", "merge_partials", "context_attention", "ContextParallelAttention", "ring_work",
    "apply_context_parallel", "cp_traffic", "shard_batch", "set_sequence_length", "context_parallel_loss",
    "cp_placements", "ContextParallelInfo", "train_context_parallel", "run_context_parallel",
]
