"""Watching what ranks do: every module here records, none changes the computation.

    patching.py   the one engine that wraps torch.distributed's functions (used by the two below)
    checks.py     a collective whose op/dtype/shape differ between ranks becomes an error
    tracer.py     CommTracer: calls and bytes of every collective and send/recv
    flight_recorder/    each rank's last calls, dumped when one hangs; the analysis naming the culprit
                        (its __main__: python -m course_lib.observe.flight_recorder DIR)
    timeline.py   per-rank timelines and the Gantt chart
    memory.py     model-state bytes, saved-activation bytes, CUDA peak memory
    profile.py    a torch.profiler trace read back as a timeline; MFU (the traces: course_lib.measure.profile)
"""

from course_lib.observe.timeline import Timeline, merge_timelines, plot_gantt
from course_lib.observe.tracer import CommRecord, CommTracer, format_summary, merge_summaries

__all__ = ["CommTracer", "CommRecord", "merge_summaries", "format_summary", "Timeline", "merge_timelines", "plot_gantt"]
