"""ZeRO stages 1-3, FSDP and offload (notebook 08): shard the model state over data-parallel ranks.

    flat.py               the flat padded buffer a unit's parameters live in; shard_bounds
    sharded_optimizer.py  ShardedOptimizer: stage 1 over any parameter iterable (the engine of all stages)
    stage2.py             gradients reduce-scattered in buckets from hooks during backward
    stage3.py             FSDP: per-block all-gather before forward and backward, free after, prefetch
    offload.py            ZeRO-Offload: bytes across the host link, the PCIe time model
    apply.py              apply_zero(model, stage, optimizer_class, group, offload, **kw) -> (model, optimizer)
    memory.py             bytes a rank holds, measured, beside notebook 01's formula
    training.py           train_zero / run_zero (rank side, on train_loop), train_zero_reference, measure_zero_step
    native.py             the same runs with torch's ZeroRedundancyOptimizer and FSDP2 fully_shard
    viz.py                notebook 08's figures and widget (the paper's table, memory by stage, offload time)
"""

# this axis's per-step collectives: the records notebook 10's bytes and notebook 11's step time read
from course_lib.estimate.traffic import dp_traffic
from course_lib.parallel.zero.apply import STAGES, apply_zero, check_zero_args
from course_lib.parallel.zero.flat import FlatUnit, shard_bounds
from course_lib.parallel.zero.memory import expected_state_bytes, measure_state_bytes
from course_lib.parallel.zero.offload import OffloadCounter, offload_bytes_per_step, pcie_seconds
from course_lib.parallel.zero.sharded_optimizer import ELEMENTWISE_OPTIMIZERS, ShardedOptimizer
from course_lib.parallel.zero.training import (measure_zero_step, ring_bytes, run_zero, train_zero_reference,
                                               train_zero)

__all__ = ["apply_zero", "dp_traffic", "ShardedOptimizer", "STAGES", "ELEMENTWISE_OPTIMIZERS", "check_zero_args", "FlatUnit",
           "shard_bounds", "measure_state_bytes", "expected_state_bytes", "OffloadCounter",
           "offload_bytes_per_step", "pcie_seconds", "train_zero", "run_zero", "train_zero_reference",
           "measure_zero_step", "ring_bytes"]
