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

__all__ = [
    "SequenceLayout", "chunk_ids", "shard_positions", "shard_sequence", "unshard_sequence", "attention_work",
    "block_attention", "merge_partials", "context_attention", "ContextParallelAttention", "ring_work",
]
