"""Exercise 07, reference solution: expert parallelism's dispatch and combine, with the experts
dealt round-robin (expert e on rank e mod ep)."""

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm.autograd import all_to_all_single  # (x, output_splits, input_splits, group)


def _slot(expert: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """Where an assignment's expert sits in the send buffer: its rank e mod ep, then its local index e // ep."""
    return (expert % ep) * (n_experts // ep) + expert // ep


def sort_for_dispatch(expert: torch.Tensor, n_experts: int, ep: int) -> tuple[torch.Tensor, list[int]]:
    """The stable permutation grouping the assignments by destination rank, and within a rank by
    local expert; and the count per expert (indexed by the global expert number)."""
    order = torch.argsort(_slot(expert, n_experts, ep), stable=True)
    counts = torch.bincount(expert, minlength=n_experts).tolist()
    return order, counts


def rows_per_rank(counts: list[int], ep: int) -> list[int]:
    """Rows to each rank: rank s owns experts s, s + ep, s + 2ep, ..."""
    return [sum(counts[s::ep]) for s in range(ep)]


def expert_parallel_moe(x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor,
                        local_experts: dict[int, nn.Module], n_experts: int, group=None) -> torch.Tensor:
    """y (N, d) of this rank's tokens, with the experts dealt round-robin over the group's ranks."""
    ep = dist.get_world_size(group)
    n_local = n_experts // ep
    order, counts = sort_for_dispatch(expert, n_experts, ep)
    rows = x[token[order]]  # (M, d), grouped by destination rank, then local expert

    # the counts in send order: send[s * n_local + j] = rows for rank s's j-th expert, j*ep + s
    send = torch.tensor([counts[j * ep + s] for s in range(ep) for j in range(n_local)], dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv.view(ep, n_local)[s, j]: from s to my expert j
    recv = recv.view(ep, n_local)
    to_rank = rows_per_rank(counts, ep)

    received = all_to_all_single(rows, recv.sum(1).tolist(), to_rank, group)
    pieces = received.split(recv.reshape(-1).tolist())  # pieces[s * n_local + j]
    experts = [local_experts[e] for e in sorted(local_experts)]
    outs = []
    for j, module in enumerate(experts):
        mine = [pieces[s * n_local + j] for s in range(ep)]
        outs.append(module(torch.cat(mine)).split([p.shape[0] for p in mine]))
    expert_out = torch.cat([outs[j][s] for s in range(ep) for j in range(n_local)])

    back = all_to_all_single(expert_out, to_rank, recv.sum(1).tolist(), group)
    weighted = back * gate[order].to(back.dtype)[:, None]
    return x.new_zeros(x.shape).index_add(0, token[order], weighted)
