"""Runs on real ranks that measure what estimate/ predicts (notebook 11 onwards).

    calibrate.py    the step-time model's inputs measured here: fixed costs, FLOP/s, a table of
                    collectives, fitted into an estimate Cluster
    memory.py       memory per rank estimated (estimate.per_gpu_memory) against measured on the
                    course's own layouts
    validation.py   predicted against measured step times; train_as trains a layout with one trainer
    profile.py      any course training function on ranks under torch.profiler: one trace per rank
    torch_memtracker.py  one ZeRO-3 step's memory per rank: the formula, the course's measurement,
                    torch's MemTracker and FSDPMemTracker side by side (notebook 08)
    simulated_ranks.py  a dp x tp layout on 64 simulated ranks in one process (torch's LocalTensorMode):
                    parameters and collectives per rank against the planner's

This package sits above estimate/ (the formulas, which start no process) and parallel/ (the
strategies it runs): it imports both, and neither imports it.
"""
