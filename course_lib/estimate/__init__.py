"""Pure formulas: memory, FLOPs and time, no processes (notebook 01 onwards).

    formulas.py     parameter counts, model state by recipe and ZeRO stage, activations, FLOPs,
                    time to train, per-GPU memory of a 4D layout
    calculator.py   the per-GPU memory and time-to-train calculator (figure and widget)

Every function stays importable as `course_lib.estimate.<name>`.
"""

from course_lib.estimate.formulas import *  # noqa: F401,F403
from course_lib.estimate.formulas import __all__  # noqa: F401
