"""Exercise 07: expert parallelism's dispatch and combine. Fill in the parts marked TODO, then
run the check cells of ex07_expert_dispatch.ipynb. Each check prints PASS when your code is right.

The set-up (notebook 07, sections 2 and 5):
  * ep ranks, E experts numbered rank by rank: rank s owns experts s*E/ep ... (s+1)*E/ep - 1;
  * every rank has its own N tokens x (N, d) and has routed them: assignment a sends token
    token[a] to expert expert[a] with gate weight gate[a] (the assignments come in no
    particular order; dropped ones are already removed);
  * the layer's output for token n is  y[n] = sum over n's assignments a of gate[a] * expert(x[n]).
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need these)
import torch.nn as nn

from course_lib.comm.autograd import all_to_all_single  # noqa: F401  (x, output_splits, input_splits, group)


def sort_by_expert(expert: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The permutation that sorts the assignments by expert, and the count per expert.

    expert: (A,) int64 in [0, n_experts). Returns (order, counts): order (A,) int64 such that
    expert[order] is non-decreasing and assignments with the same expert keep their relative
    order (a stable sort); counts: list of n_experts ints, counts[e] = assignments to e.
    Example: expert [2, 0, 2, 1] -> order [1, 3, 0, 2], counts [1, 1, 2] (n_experts = 3).
    """
    raise NotImplementedError("exercise 07: write sort_by_expert")


def rows_per_rank(counts: list[int], ep: int) -> list[int]:
    """Rows this rank sends to each of the ep ranks: counts summed over each rank's experts.
    Example: counts [1, 1, 2, 0], ep = 2 -> [2, 2]."""
    raise NotImplementedError("exercise 07: write rows_per_rank")


def expert_parallel_moe(x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor,
                        local_experts: dict[int, nn.Module], n_experts: int, group=None) -> torch.Tensor:
    """y (N, d) of this rank's tokens, with the experts spread over the group's ranks.

    local_experts: {global expert index: module} for this rank's experts.
    Must be differentiable: gradients flow back to x, to gate (and so to the router) and
    to every expert's weights, on whichever rank the expert lives.
    """
    # TODO 1: permute: order, counts = sort_by_expert(expert, n_experts); the rows to send are
    #         x[token[order]] (M, d), grouped by destination rank because experts are numbered
    #         rank by rank.
    # TODO 2: exchange the counts: one dist.all_to_all_single of an int64 tensor of the E counts
    #         (E/ep to each rank). What arrives, viewed (ep, E/ep), is [s, j] = rows rank s will
    #         send to my j-th local expert.
    # TODO 3: dispatch: all_to_all_single(rows, output_splits, input_splits, group) with
    #         input_splits = rows_per_rank(counts, ep) and output_splits = rows arriving from
    #         each rank. The received rows are grouped by source, then by my local expert.
    # TODO 4: run each local expert ONCE on all its rows (from every source), even if it has
    #         zero rows, and put its outputs back in the received order.
    # TODO 5: combine: the all-to-all back, splits swapped -> (M, d) in the order of `rows`.
    # TODO 6: un-permute: y = zeros (N, d), then add gate[order] * out to the rows token[order]
    #         (Tensor.index_add is differentiable).
    raise NotImplementedError("exercise 07: write expert_parallel_moe")
