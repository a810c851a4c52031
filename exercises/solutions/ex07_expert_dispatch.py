"""Exercise 07, reference solution: expert parallelism's dispatch and combine."""

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm.autograd import all_to_all_single  # (x, output_splits, input_splits, group)


def sort_by_expert(expert: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The stable permutation sorting the assignments by expert, and the count per expert."""
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=n_experts).tolist()
    return order, counts


def rows_per_rank(counts: list[int], ep: int) -> list[int]:
    """Rows to each rank: counts summed over each rank's E/ep consecutive experts."""
    per_rank = len(counts) // ep
    return [sum(counts[s * per_rank:(s + 1) * per_rank]) for s in range(ep)]


def expert_parallel_moe(x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor,
                        local_experts: dict[int, nn.Module], n_experts: int, group=None) -> torch.Tensor:
    """y (N, d) of this rank's tokens, with the experts spread over the group's ranks."""
    ep = dist.get_world_size(group)
    n_local = n_experts // ep
    order, counts = sort_by_expert(expert, n_experts)
    rows = x[token[order]]  # (M, d), grouped by destination rank

    send = torch.tensor(counts, dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv.view(ep, n_local)[s, j]: from s to my expert j
    recv = recv.view(ep, n_local)

    received = all_to_all_single(rows, recv.sum(1).tolist(), rows_per_rank(counts, ep), group)
    pieces = received.split(recv.reshape(-1).tolist())  # pieces[s * n_local + j]
    experts = [local_experts[e] for e in sorted(local_experts)]
    outs = []
    for j, module in enumerate(experts):
        mine = [pieces[s * n_local + j] for s in range(ep)]
        outs.append(module(torch.cat(mine)).split([p.shape[0] for p in mine]))
    expert_out = torch.cat([outs[j][s] for s in range(ep) for j in range(n_local)])

    back = all_to_all_single(expert_out, rows_per_rank(counts, ep), recv.sum(1).tolist(), group)
    weighted = back * gate[order].to(back.dtype)[:, None]
    return x.new_zeros(x.shape).index_add(0, token[order], weighted)
