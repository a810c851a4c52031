"""Tensor parallelism (Megatron) and sequence parallelism (notebook 05).

    functions.py   entering / leaving a tensor-parallel region: f and g, or all-gather and
                   reduce-scatter along the sequence (from course_lib.comm.autograd)
    async_tp.py    all_gather_matmul, matmul_reduce_scatter: the collective decomposed into p ring
                   steps, each hidden behind one chunk's matmul (asynchronous TP, under SP)
    layers.py      ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, and the
                   sequence-parallel LayerNorm and position embedding
    loss.py        cross-entropy over vocabulary-split logits (three all-reduces of N numbers)
    apply.py       apply_tensor_parallel(model, group, sequence_parallel=False, async_tp=False); gather the full
                   state dict back; the global-norm gradient clip
    costs.py       the communication per layer and per step, as formulas
    training.py    the reference training loop, tensor parallel (course layers or DTensor)
    dtensor.py     the same model through torch's DTensor parallelize_module, for comparison
    figures.py     notebook 05's figures and its tp / sequence-parallel widget
"""

# this axis's per-step collectives: the records notebook 10's bytes and notebook 11's step time read
from course_lib.estimate.traffic import tp_traffic
from course_lib.parallel.tp.apply import (
    TensorParallelInfo,
    apply_tensor_parallel,
    check_tensor_parallel,
    clip_grad_norm_,
    full_logits,
    gather_full_gradients,
    gather_full_state_dict,
    qkv_rows,
    sharded_parameters,
    tp_placements,
)
from course_lib.parallel.tp.async_tp import all_gather_matmul, check_async_tp, matmul_reduce_scatter
from course_lib.parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceParallelPositions,
    VocabParallelEmbedding,
)
from course_lib.parallel.tp.loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy

__all__ = [
    "apply_tensor_parallel", "tp_traffic", "check_tensor_parallel", "TensorParallelInfo", "gather_full_state_dict",
    "gather_full_gradients", "full_logits", "clip_grad_norm_", "sharded_parameters", "qkv_rows", "tp_placements",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SequenceParallelLayerNorm",
    "SequenceParallelPositions", "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
    "all_gather_matmul", "matmul_reduce_scatter", "check_async_tp",
]
