"""The outer step of LocalSGD and DiLoCo, Streaming DiLoCo's fragments, and the rules of a run.

R replicas each train their own copy theta_r with AdamW (the inner optimizer, its state kept
by each replica across syncs). Every H inner steps they meet once:

    LocalSGD (Stich 2019; Lin et al. 2020)   theta <- (1/R) sum_r theta_r
    DiLoCo   (Douillard et al. 2023, Alg. 1) Delta = theta_0 - (1/R) sum_r theta_r       the pseudo-gradient
                                             b     <- mu b + Delta                        (b = 0 at first)
                                             theta_0 <- theta_0 - lr_out (Delta + mu b)   Nesterov: torch.optim.SGD(
                                             theta_r <- theta_0                           momentum=mu, nesterov=True)

theta_0 is the outer copy: the parameters every replica started the round from. Delta points
from where the replicas went back to where they started, as a gradient does (a step *against*
it follows the replicas), so lr_out = 1, mu = 0 is LocalSGD's average.

Streaming DiLoCo (Douillard et al. 2025) syncs the model in F fragments at staggered steps:
fragment f holds the blocks i with i % F == f (strided, as the paper's best layout), fragment 0
also the embeddings, fragment F-1 the final norm and an untied head. Fragment f is synced after
step t when (t - f H / F) % H == 0, each fragment with its own theta_0 and b, so at most one
fragment crosses the network per step: the peak is ~1/F of the whole model. The delta may
travel in a lower precision (outer_dtype): it is cast before it is sent and summed in fp32.
"""

from __future__ import annotations

import torch

from course_lib._validate import check_int
from course_lib.estimate.traffic.diloco import due, sync_offsets  # the schedule: the formula's, read here

ALGORITHMS = ("local_sgd", "diloco")
OUTER_DTYPES = (torch.float32, torch.bfloat16)


def check_diloco(world_size: int, replicas: int, inner_steps: int, n_layer: int, fragments: int = 1,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_dtype=torch.float32,
                 algorithm: str = "diloco") -> None:
    """Refuse a run that cannot be made, naming the value and the rule (call it in the parent)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} must be one of {ALGORITHMS}")
    check_int("replicas", replicas)
    if world_size % replicas:
        raise ValueError(f"world size {world_size} must be divisible by replicas={replicas}: "
                         f"every replica has the same number of ranks")
    check_int("inner_steps", inner_steps, rule="an int >= 1 (H: the replicas meet every H steps)")
    check_int("fragments", fragments, rule="an int >= 1")
    if n_layer % fragments:
        raise ValueError(f"fragments={fragments} must divide n_layer={n_layer}: each fragment takes "
                         f"n_layer / fragments blocks (blocks i with i % fragments == f)")
    if inner_steps % fragments:
        raise ValueError(f"fragments={fragments} must divide inner_steps={inner_steps}: fragment f is synced "
                         f"at the steps t with (t - f * H / F) % H == 0, evenly staggered")
    if algorithm == "local_sgd":
        if fragments != 1 or outer_dtype != torch.float32:
            raise ValueError("algorithm='local_sgd' averages the whole model in fp32: fragments=1, "
                             "outer_dtype=torch.float32")
        return
    if not (isinstance(outer_lr, (int, float)) and not isinstance(outer_lr, bool) and outer_lr > 0):
        raise ValueError(f"outer_lr={outer_lr!r} must be > 0")
    if not (isinstance(outer_momentum, (int, float)) and not isinstance(outer_momentum, bool)
            and 0 <= outer_momentum < 1):
        raise ValueError(f"outer_momentum={outer_momentum!r} must be in [0, 1)")
    if outer_dtype not in OUTER_DTYPES:
        raise ValueError(f"outer_dtype={outer_dtype!r} must be one of {OUTER_DTYPES}")


def fragment_index(name: str, fragments: int, n_layer: int) -> int:
    """The fragment of the GPT parameter `name`: block i -> i % F; embeddings -> 0; the rest
    (final norm, an untied head) -> F - 1."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) % fragments
    if name.startswith(("tok_emb.", "pos_emb.")):
        return 0
    return fragments - 1


def fragment_params(model, fragments: int) -> list[list[torch.nn.Parameter]]:
    """The model's parameters (a tied weight once) in F fragments, each in named_parameters order."""
    out = [[] for _ in range(fragments)]
    for name, p in model.named_parameters():
        out[fragment_index(name, fragments, model.config.n_layer)].append(p)
    return out


class NesterovOuter:
    """The outer copy theta_0 of one fragment and its momentum b (module docstring), by hand."""

    def __init__(self, params, lr: float, momentum: float):
        self.params = list(params)
        self.anchor = [p.detach().clone() for p in self.params]  # theta_0, where the round started
        self.buf = [torch.zeros_like(p) for p in self.params]
        self.lr, self.momentum = lr, momentum

    def deltas(self) -> list[torch.Tensor]:
        """This replica's Delta_r = theta_0 - theta_r, per parameter."""
        return [a - p.detach() for a, p in zip(self.anchor, self.params)]

    @torch.no_grad()
    def step(self, mean_deltas) -> None:
        """b <- mu b + Delta; theta_0 <- theta_0 - lr (Delta + mu b); every theta_r <- theta_0."""
        for a, b, d, p in zip(self.anchor, self.buf, mean_deltas, self.params):
            b.mul_(self.momentum).add_(d)
            a.sub_(self.lr * (d + self.momentum * b))
            p.copy_(a)
