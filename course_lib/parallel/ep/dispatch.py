"""Dispatch and combine: the two all-to-alls of expert parallelism (notebook 07).

ep ranks, E experts, E_l = E / ep per rank; rank s owns experts s*E_l ... (s+1)*E_l - 1. Each
rank has routed its own tokens (model/moe.py `route`): rows (M, d) sorted by expert, counts[e]
of them for expert e. Because experts are numbered rank by rank, the sorted rows are already
grouped by destination rank:

    my rows:    [ to rank 0: experts 0..E_l-1 | to rank 1: experts E_l..2E_l-1 | ... ]
    send[s, j] = counts[s*E_l + j]          (ep, E_l): rows for rank s's local expert j

1. exchange_counts: one all-to-all of the counts (E_l integers to each rank), so every rank
   learns recv[s, j] = rows that rank s sends to my local expert j, before any row moves.
2. dispatch: all-to-all of the rows with uneven splits: input_splits[s] = sum_j send[s, j],
   output_splits[s] = sum_j recv[s, j]. Only the routed rows move (no padding to capacity).
   What arrives is grouped by source rank, then by my local expert:

    received:   [ from rank 0: j=0 | j=1 | ... | from rank 1: j=0 | j=1 | ... | ... ]

3. run_local_experts: gather each local expert's rows from every source (expert j sees
   sum_s recv[s, j] rows in one matmul), run it, and put its outputs back in received order.
4. combine: the all-to-all back with the splits swapped: each row returns to the rank and
   position it came from. The sending rank then scales by the gate weights and adds the rows
   into its tokens (the gates never travel, so the router's gradient stays local).

dispatch_once_per_rank is the deduplicating variant (a token that chose several experts of one
rank crosses once), what makes device-limited routing save bytes (notebook 07, section 12).

Both row all-to-alls are `course_lib.comm.autograd.all_to_all_single`: backward routes the
gradient rows back the opposite way (two more all-to-alls). Bytes per layer and step, for a
rank that sends M rows and receives R rows of d elements of b bytes: forward M*d*b (dispatch)
+ R*d*b (combine) + E*8 (counts); backward the same rows again, R*d*b + M*d*b. The rows a rank
sends to itself are in those buffers too but never leave the rank: off-rank traffic is
M - send[my rank].sum() rows each way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm.autograd import all_to_all_single


def exchange_counts(counts: list[int], group=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """counts[e] = rows this rank sends to global expert e. Returns (send, recv), both (ep, E_l):
    send[s, j] = counts[s*E_l + j]; recv[s, j] = rows rank s sends to my local expert j."""
    ep = dist.get_world_size(group)
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # E_l counts to each rank
    return send.view(ep, -1), recv.view(ep, -1)


def dispatch(rows: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, group=None) -> torch.Tensor:
    """All-to-all the expert-sorted rows (M, d) to the experts' ranks -> (R, d) grouped by source."""
    return all_to_all_single(rows, recv.sum(1).tolist(), send.sum(1).tolist(), group)


def dispatch_once_per_rank(rows: torch.Tensor, tokens: torch.Tensor, send: torch.Tensor, recv: torch.Tensor,
                           group=None) -> torch.Tensor:
    """dispatch's result (R, d), but each token's row crosses to a rank ONCE however many of that
    rank's experts it chose (DeepSeek-V3 sends a token once per node). tokens (M,): the token of
    each sorted row. For the rows to rank s: u_s distinct tokens, and for each row the index of
    its token among them. Moves the u_s rows (autograd: their gradient returns the same way), then
    the receiver expands them by the indices. Bytes per layer, forward: u*d*b + ep*8 (the u_s) +
    M*8 (the indices) instead of M*d*b; backward u*d*b instead of M*d*b (u = sum_s u_s <= M)."""
    ep = send.shape[0]
    firsts, inverse, unique_counts, offset = [], [], [], 0
    for n in send.sum(1).tolist():  # rows to rank s are the contiguous block [offset, offset + n)
        uniq, inv = torch.unique(tokens[offset:offset + n], return_inverse=True)
        first = torch.full((uniq.numel(),), n, dtype=torch.int64, device=rows.device)
        first = first.scatter_reduce(0, inv, torch.arange(n, device=rows.device), "amin")  # a row of each token
        firsts.append(first + offset)
        inverse.append(inv)
        unique_counts.append(uniq.numel())
        offset += n
    u_send = torch.tensor(unique_counts, dtype=torch.int64, device=rows.device)
    u_recv = torch.empty_like(u_send)
    dist.all_to_all_single(u_recv, u_send, group=group)
    inv_recv = torch.empty(int(recv.sum()), dtype=torch.int64, device=rows.device)
    dist.all_to_all_single(inv_recv, torch.cat(inverse), recv.sum(1).tolist(), send.sum(1).tolist(), group=group)
    unique_rows = all_to_all_single(rows[torch.cat(firsts)], u_recv.tolist(), u_send.tolist(), group)
    start = u_recv.cumsum(0) - u_recv  # where each source's distinct rows begin
    source = torch.repeat_interleave(torch.arange(ep, device=rows.device), recv.sum(1))
    return unique_rows[start[source] + inv_recv]  # the gather's backward sums each token's rows


def run_local_experts(received: torch.Tensor, recv: torch.Tensor, experts: list[nn.Module]) -> torch.Tensor:
    """Run local expert j on its rows from every source; outputs in the received order."""
    ep, n_local = recv.shape
    pieces = received.split(recv.reshape(-1).tolist())  # pieces[s * E_l + j]
    outputs = []  # outputs[j]: expert j's rows, split back by source
    for j, expert in enumerate(experts):
        mine = [pieces[s * n_local + j] for s in range(ep)]
        out = expert(torch.cat(mine))  # runs on zero rows too: every expert gets a gradient
        outputs.append(out.split([p.shape[0] for p in mine]))
    return torch.cat([outputs[j][s] for s in range(ep) for j in range(n_local)])


def combine(expert_out: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, group=None) -> torch.Tensor:
    """All-to-all the expert outputs (R, d) back: (M, d) in this rank's original sorted order."""
    return all_to_all_single(expert_out, send.sum(1).tolist(), recv.sum(1).tolist(), group)


def traffic_matrix(kept_per_rank: list[torch.Tensor], d_model: int, bytes_per_element: int = 4) -> torch.Tensor:
    """(ep, ep) bytes of one layer's dispatch: [r, s] = rows rank r sends to rank s * d * b.

    kept_per_rank[r] is rank r's RoutingStats.kept (rows per global expert). The combine
    all-to-all is the transpose; the diagonal is the part that stays on its rank."""
    ep = len(kept_per_rank)
    rows = torch.stack([k.reshape(ep, -1).sum(1) for k in kept_per_rank])
    return rows * d_model * bytes_per_element
