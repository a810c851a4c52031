"""Exercise 14, reference solution: three broken runs named and mended."""

import torch
import torch.distributed as dist


def name_the_bugs() -> dict[str, str]:
    """Each run's bug, by its name in the catalogue.

    run 1: the gradient norm is exactly 2 x the single process's at step 1 on 2 ranks while the
           replicas agree: the all-reduce sums (its default op) and nothing divides by the world size.
    run 2: the flight recorder says rank 1 is in an all-reduce rank 0 never entered, and rank 0's last
           call completed: rank 0 left the loop on its own loss (below the target a step earlier than
           rank 1's), a data-dependent branch that skips every later collective.
    run 3: the recorder saw no all-reduce at all and the checksums differ from step 1: the sync sits
           under `i == len(micro_batches)`, which the loop never reaches.
    """
    return {"run 1": "sum_not_avg", "run 2": "skip_collective", "run 3": "never_sync"}


def average_gradients(model) -> None:
    """Run 1 mended: the mean of the ranks' gradients (gloo has no AVG: sum, then divide), in one
    all-reduce: every gradient copied into one flat buffer, reduced, and copied back into place."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def should_stop(local_loss: float, target: float) -> bool:
    """Run 2 mended: every rank decides on the global batch's loss, the mean of the ranks' losses."""
    total = torch.tensor([local_loss], dtype=torch.float64)
    dist.all_reduce(total)  # every rank calls it, every step: no rank can leave the loop alone
    return total.item() / dist.get_world_size() < target


def accumulation_step(model, optimizer, micro_batches) -> float:
    """Run 3 mended: backward on every micro-batch, one sync after the last, then the step."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in micro_batches:
        loss = model(x, y)[1] / len(micro_batches)
        loss.backward()
        total += loss.item()
    average_gradients(model)  # once per step, after the last micro-batch
    optimizer.step()
    return total
