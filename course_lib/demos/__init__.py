"""Demos runnable both from a notebook (`run_on_ranks`) and by instructors with torchrun:

    torchrun --nproc-per-node=N -m course_lib.demos.<name>
"""
