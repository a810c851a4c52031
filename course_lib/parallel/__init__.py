"""Parallel training strategies, one readable file each.

    data_parallel.py   naive_all_reduce_gradients, DDP (bucketed, overlapped), check_replicas
    dp_training.py     the reference training loop made data parallel (train/run_data_parallel)
    compression.py     gradient compression hooks for DDP (top-k + error feedback, bf16/fp16)
"""

from course_lib.parallel.data_parallel import (
    DDP,
    assign_buckets,
    broadcast_parameters,
    check_replicas,
    naive_all_reduce_gradients,
)
from course_lib.parallel.dp_training import run_data_parallel, train_data_parallel
from course_lib.parallel.compression import LowPrecisionHook, TopKHook

__all__ = [
    "DDP", "naive_all_reduce_gradients", "check_replicas", "broadcast_parameters", "assign_buckets",
    "train_data_parallel", "run_data_parallel", "LowPrecisionHook", "TopKHook",
]
