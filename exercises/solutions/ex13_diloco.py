"""Exercise 13 (reference solution): DiLoCo's outer step on the replicas' group, with a quorum."""

import torch
import torch.distributed as dist


@torch.no_grad()
def outer_step(params, anchor, momentum, outer_lr, mu, group=None, present=True) -> None:
    # this replica's delta (zero when it is not in the round's quorum) and its vote, in one buffer
    vote = torch.ones(1, dtype=anchor[0].dtype, device=anchor[0].device)
    flat = torch.cat([(a - p).reshape(-1) for a, p in zip(anchor, params)] + [vote])
    if not present:
        flat.zero_()
    dist.all_reduce(flat, group=group)  # every replica joins, present or not
    count = flat[-1]
    offset = 0
    for p, a, b in zip(params, anchor, momentum):
        delta = flat[offset:offset + a.numel()].view_as(a) / count  # the mean over the quorum
        offset += a.numel()
        b.mul_(mu).add_(delta)
        a.sub_(outer_lr * (delta + mu * b))
        p.copy_(a)
