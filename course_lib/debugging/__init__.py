"""Debugging distributed training (notebook 14): a catalogue of broken runs, each a small rank
function with its one-line bug and its mended twin, the symptom, the tool that finds it, the fix.

    catalogue.py   Bug, Evidence, BUGS (name -> Bug), BUG_NAMES, check_bug, catalogue_table
    hangs.py       the entries that hang or crash (collectives out of step, pipelines, experts)
    silent.py      the entries that finish with wrong numbers (or the wrong traffic)
    run.py         run_bug(name, fixed=False, rank=None, ...) -> BugRun, from a notebook or test
    torch_recorder.py  PyTorch's own flight recorder and its analyser (fr_trace) beside the course's

The torchrun form is course_lib.demos.broken_run; loss parity, the comparison with the single
process, is course_lib.observe.parity.loss_parity.
"""

from course_lib.debugging.catalogue import BUG_NAMES, BUGS, Bug, Evidence, catalogue_table, check_bug
from course_lib.debugging.run import BugRun, run_bug

__all__ = ["BUGS", "BUG_NAMES", "Bug", "Evidence", "BugRun", "catalogue_table", "check_bug", "run_bug"]
