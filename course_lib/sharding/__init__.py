"""Sharding as a type (appendix A1): the course's layouts as DTensor placements and JAX PartitionSpecs.

    layouts.py      the layouts (dp, tp, sp, fsdp, dp x tp) as one table of PartitionSpecs, from
                    which DTensor's placements follow; the course's formula for one MLP step;
                    the mapping table (Megatron / DeepSpeed / FSDP names)
    hlo.py          the collectives the partitioner inserted, read from XLA's compiled HLO text
    jax_program.py  the step in JAX (jit with shardings, shard_map, and explicit sharding mode), run as its own process
    torch_side.py   the step on gloo ranks: the course's hand-written strategy (CommTracer) and
                    DTensor (CommDebugMode with bytes)
    run.py          run all three and compare: collectives against the formula, numbers against
                    the single process
"""

from course_lib.sharding.layouts import (HIDDEN, LAYOUTS, ShardingPlan, Record, Shapes, check_layout, formula, mapping_table,
                                        totals)

__all__ = ["HIDDEN", "LAYOUTS", "ShardingPlan", "Record", "Shapes", "check_layout", "formula", "mapping_table", "totals"]
