"""Data parallelism (notebook 03): every rank holds the whole model and a slice of the batch.

    ddp.py           naive_all_reduce_gradients, DDP (bucketed, overlapped), check_replicas
    apply.py         apply_data_parallel(model, group, strategy): the module to call, no_sync, sync
    training.py      the reference training loop made data parallel (train/run_data_parallel)
    compression.py   gradient compression hooks for DDP (top-k + error feedback, bf16/fp16)
    large_batch.py   large global batches: LR scaling, warm-up, gradient-noise scale (notebook 03)
"""

# this axis's per-step collectives: the records notebook 10's bytes and notebook 11's step time read
from course_lib.estimate.traffic import dp_traffic
from course_lib.parallel.dp.apply import DataParallel, apply_data_parallel
from course_lib.parallel.dp.compression import LowPrecisionHook, TopKHook
from course_lib.parallel.dp.ddp import DDP, assign_buckets, broadcast_parameters, check_replicas, naive_all_reduce_gradients
from course_lib.parallel.dp.large_batch import (gradient_noise_scale, noise_scale_from_two_batches, scale_lr,
                                                train_at_token_budget, warmup_factor)
from course_lib.parallel.dp.training import run_data_parallel, train_data_parallel

__all__ = ["apply_data_parallel", "dp_traffic", "DataParallel", "DDP", "naive_all_reduce_gradients", "check_replicas", "broadcast_parameters", "assign_buckets",
           "train_data_parallel", "run_data_parallel", "LowPrecisionHook", "TopKHook",
           "scale_lr", "warmup_factor", "gradient_noise_scale", "noise_scale_from_two_batches", "train_at_token_budget"]
