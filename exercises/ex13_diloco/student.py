"""Exercise 13: DiLoCo's outer step, written on the replicas' process group, for a round from
which some replicas may be missing. Fill in `outer_step`, then run the check cells of
ex13_diloco.ipynb. Each check prints PASS when your code is right.

The setting (notebook 13, DiLoCo; Douillard et al. 2023, Algorithm 1): R replicas, one rank
each, start a round from the same parameters theta_0 (the outer copy, `anchor`) and take H
inner AdamW steps each on their own data. Then every replica calls `outer_step` once. The round
has a quorum: the replicas whose H steps count this round. A replica outside it (restarted,
late) still calls `outer_step` with present=False; its parameters are ignored, and it leaves the
round exactly like the others. Each rank knows only its own `present`, never the others'.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def outer_step(params: list[torch.Tensor], anchor: list[torch.Tensor], momentum: list[torch.Tensor],
               outer_lr: float, mu: float, group=None, present: bool = True) -> None:
    """One outer step of DiLoCo on this replica, in place; returns nothing.

    params    this replica's parameters theta_r after its H inner steps (tensors, or
              nn.Parameters that require grad), any shapes
    anchor    theta_0, the parameters every replica started the round from: same shapes
    momentum  the outer Nesterov momentum b: same shapes, zeros before the first round
    outer_lr, mu   the outer optimizer: torch.optim.SGD(lr=outer_lr, momentum=mu, nesterov=True)
                   stepping theta_0 with the round's pseudo-gradient as its gradient
    group     the process group of the R replicas (None: the default group)
    present   whether this replica is in the round's quorum; at least one replica is

    The pseudo-gradient is the mean, over the replicas in the quorum only, of theta_0 - theta_r.
    On return, on every replica (in the quorum or not): anchor and momentum hold the new theta_0
    and b, the same on all replicas, and params hold the new theta_0 (the next round starts
    there). Every replica's tensors keep their dtype and device.
    """
    raise NotImplementedError("exercise 13: write outer_step")
