"""Exercise 14: three broken runs. Fill in the parts marked TODO, then run the check cells of
ex14_debugging.ipynb. Each check prints PASS when your code is right.

Every run is data parallelism on N ranks: each rank takes its 1/N share of the global batch,
computes its loss (a mean over its share) and its gradients, and the ranks must then agree, so
that the run equals one process training on the whole batch (notebook 03).
"""

import torch  # noqa: F401  (you will need these)
import torch.distributed as dist  # noqa: F401


def name_the_bugs() -> dict[str, str]:
    """{"run 1": NAME, "run 2": NAME, "run 3": NAME}: each run's bug, by its name in the catalogue
    (the names are listed in the exercise notebook)."""
    # TODO: read each run's evidence (its loss curve, gradient norms, checksums, flight recorder)
    raise NotImplementedError("exercise 14: name the three bugs")


def average_gradients(model) -> None:
    """Run 1 mended, and cheaper: after backward, leave on every rank, in each p.grad, the mean over
    the ranks of their gradients, with ONE collective call per step for the whole model, however
    many parameters it has (each call pays a fixed latency). gloo has no ReduceOp.AVG."""
    # TODO
    raise NotImplementedError("exercise 14: write average_gradients")


def should_stop(local_loss: float, target: float) -> bool:
    """Run 2 mended: called on every rank after each step with that rank's own loss; return True to
    leave the training loop. Every rank must return the same decision: True exactly when the loss of
    the global batch (the one the single process sees) is below target."""
    # TODO
    raise NotImplementedError("exercise 14: write should_stop")


def accumulation_step(model, optimizer, micro_batches) -> float:
    """Run 3 mended: one optimizer step over this rank's micro_batches, a list of (x, y) of equal
    sizes (2 or more of them), that equals one step on the rank's whole share with the ranks'
    gradients averaged, communicating one gradient's worth of bytes per step. Return the rank's
    loss over its whole share (a float)."""
    # TODO
    raise NotImplementedError("exercise 14: write accumulation_step")
