"""The capstone (notebook 15): plan, train a 3D (or MoE) layout with mixed precision, activation
checkpointing and ZeRO, checkpoint it, lose ranks, resume at another world size, and check the
whole loss curve against the single process; then compare prediction with measurement.

    config.py   the TOML config (configs/capstone_*.toml), every key checked: load_config
    run.py      train_segment (rank code), run_capstone (parent: both segments, the single process)
    report.py   predicted vs measured, the report cell, the live loss plot, generated text

The same run under torchrun: course_lib.demos.capstone.
"""

from course_lib.capstone.config import (SCHEMA, TOLERANCE, CapstoneConfig, config_from_dict,
                                        load_config, read_toml)
from course_lib.capstone.report import (LiveLossPlot, compare, estimate_inputs, generate_text, gpu_peak_flops,
                                        report_text, traffic_formula)
from course_lib.capstone.run import CapstoneRun, run_capstone, train_segment

__all__ = ["CapstoneConfig", "load_config", "config_from_dict", "read_toml", "train_segment",
           "run_capstone", "CapstoneRun", "SCHEMA", "TOLERANCE", "estimate_inputs", "compare", "report_text",
           "LiveLossPlot", "generate_text", "gpu_peak_flops", "traffic_formula"]
