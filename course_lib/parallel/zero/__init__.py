"""ZeRO stages 1-3, FSDP and offload (notebook 08): shard the model state over data-parallel ranks.

    flat.py               the flat padded buffer a unit's parameters live in; shard_bounds
    sharded_optimizer.py  ShardedOptimizer: stage 1 over any parameter iterable (the engine of all stages)
    muon.py               ShardedMuon: Muon with row-sharded momentum (gather / owner / balanced Newton-Schulz)
    stage2.py             gradients reduce-scattered in buckets from hooks during backward
    stage3.py             FSDP: per-block all-gather before forward and backward, free after, prefetch
    offload.py            ZeRO-Offload: to_host / to_device (every crossing), bytes across the link, PCIe time
    apply.py              apply_zero(model, stage, optimizer_class, group, offload, **kw) -> (model, optimizer)
    per_param.py          per-parameter sharding (FSDP2): one unit's dim-0 shards, gather and reduce
    per_param_model.py    unit policies (block / whole / module classes) and the stage-3 hooks, prefetch
    per_param_optim.py    apply_zero(..., sharding="per_param"): its optimizer, full_state_dict for both designs
    hsdp.py               the shard / replicate (HSDP) / reshard groups of an R x S mesh
    nvme.py               ZeRO-Infinity's NVMe tier: Adam's state in memory-mapped files, disk bandwidth
    fp8_gather.py         gather_dtype="fp8": stage 3's parameter all-gather in e4m3 with per-shard scales
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
from course_lib.parallel.zero.hsdp import check_mesh_args, hsdp_payloads, mesh_lists
from course_lib.parallel.zero.nvme import check_nvme_dir, disk_bandwidth
from course_lib.parallel.zero.offload import OffloadCounter, offload_bytes_per_step, pcie_seconds
from course_lib.parallel.zero.per_param_model import plan_units
from course_lib.parallel.zero.per_param_optim import (check_per_param_args, full_state_dict, gather_full_parameters,
                                                     local_elements)
from course_lib.parallel.zero.sharded_optimizer import ELEMENTWISE_OPTIMIZERS, ShardedOptimizer
from course_lib.parallel.zero.training import (measure_zero_step, ring_bytes, run_zero, train_zero_reference,
                                               train_zero)

__all__ = ["apply_zero", "dp_traffic", "ShardedOptimizer", "STAGES", "ELEMENTWISE_OPTIMIZERS", "check_zero_args", "FlatUnit",
           "shard_bounds", "measure_state_bytes", "expected_state_bytes", "OffloadCounter",
           "offload_bytes_per_step", "pcie_seconds", "train_zero", "run_zero", "train_zero_reference",
           "measure_zero_step", "ring_bytes", "check_mesh_args", "hsdp_payloads", "mesh_lists", "check_nvme_dir", "disk_bandwidth",
           "plan_units", "check_per_param_args", "full_state_dict", "gather_full_parameters", "local_elements"]
