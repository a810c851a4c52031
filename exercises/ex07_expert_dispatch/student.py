"""Exercise 07: expert parallelism's dispatch and combine. Fill in the three functions, then
run the check cells of ex07_expert_dispatch.ipynb. Each check prints PASS when your code is right.

The set-up (notebook 07, sections 2 and 5):
  * ep ranks, E experts dealt round-robin (NOT rank by rank as in notebook 07): rank s owns
    experts s, s + ep, s + 2ep, ...; its j-th local expert is expert j*ep + s;
  * every rank has its own N tokens x (N, d) and has routed them: assignment a sends token
    token[a] to expert expert[a] with gate weight gate[a] (the assignments come in no
    particular order; dropped ones are already removed);
  * the layer's output for token n is  y[n] = sum over n's assignments a of gate[a] * expert(x[n]).
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need these)
import torch.nn as nn

from course_lib.comm.autograd import all_to_all_single  # noqa: F401  (x, output_splits, input_splits, group)


def sort_for_dispatch(expert: torch.Tensor, n_experts: int, ep: int) -> tuple[torch.Tensor, list[int]]:
    """The permutation that lays the assignments out for the dispatch, and the count per expert.

    expert: (A,) int64 in [0, n_experts). Returns (order, counts): order (A,) int64, a
    permutation of the assignments such that, read in that order, the destination ranks
    (expert % ep) never decrease, within one rank the local experts (expert // ep) never
    decrease, and assignments with the same expert keep their input order; counts: list of
    n_experts ints, counts[e] = assignments to expert e (global numbering).
    """
    raise NotImplementedError("exercise 07: write sort_for_dispatch")


def rows_per_rank(counts: list[int], ep: int) -> list[int]:
    """Rows this rank sends to each of the ep ranks, from the counts per expert (global numbering)."""
    raise NotImplementedError("exercise 07: write rows_per_rank")


def expert_parallel_moe(x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor,
                        local_experts: dict[int, nn.Module], n_experts: int, group=None) -> torch.Tensor:
    """y (N, d) of this rank's tokens, with the experts dealt round-robin over the group's ranks.

    local_experts: {global expert index: module} for this rank's experts (r, r + ep, ...).
    Communication: exactly three all-to-alls per forward (the counts, the dispatch of the routed
    rows, the combine), carrying only the routed rows. Each local expert runs once per forward.
    Must be differentiable: gradients flow back to x, to gate (and so to the router) and to
    every expert's weights, on whichever rank the expert lives.
    """
    raise NotImplementedError("exercise 07: write expert_parallel_moe")
