"""Runs on real ranks that measure what estimate/ predicts (notebook 11 onwards).

    calibrate.py    the step-time model's inputs measured here: fixed costs, FLOP/s, a table of
                    collectives, fitted into an estimate Cluster
    memory.py       memory per rank estimated (estimate.per_gpu_memory) against measured on the
                    course's own layouts
    validation.py   predicted against measured step times; train_as trains a layout with one trainer
    profile.py      any course training function on ranks under torch.profiler: one trace per rank

This package sits above estimate/ (the formulas, which start no process) and parallel/ (the
strategies it runs): it imports both, and neither imports it.
"""
