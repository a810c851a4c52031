"""Muon (Jordan et al. 2024): momentum, then orthogonalise each weight matrix's update.

For a 2-D parameter W (shape A x B) with gradient G, one step is (torch.optim.Muon's algorithm,
written here from its documented maths so the course can shard it, course_lib.parallel.zero.muon):

    B     <- mu B + (1 - mu) G            the momentum buffer (torch writes it as B.lerp_(G, 1 - mu))
    U      = (1 - mu) G + mu B  if nesterov else B
    O      = NS_k(U)                      k Newton-Schulz steps: O ~ U V^T of U's SVD, singular values ~1
    W     <- W (1 - lr wd) - lr' O        decoupled weight decay, then lr' = lr * sqrt(max(1, A/B))
                                          ("original", Jordan's) or lr * 0.2 sqrt(max(A, B))
                                          ("match_rms_adamw", Liu et al. 2025)

Newton-Schulz (newton_schulz): X = U / ||U||_F (so every singular value is <= 1), transposed so
that it is wide (rows <= columns, the Gram matrix X X^T is the small one), then k times

    A = X X^T,    X <- a X + (b A + c A A) X        (a, b, c) = (3.4445, -4.7750, 2.0315)

Each step applies p(s) = a s + b s^3 + c s^5 to every singular value s of X and leaves the
singular vectors alone. The quintic's coefficients are chosen for a steep slope at 0 (a = 3.4445),
so five steps push every singular value into roughly (0.5, 1.5) rather than to exactly 1, which
Jordan et al. report does not hurt training. It runs in bfloat16 (as torch and Jordan's code do):
the result only needs to be roughly orthogonal, and every step is three matmuls.

Muon is for the hidden 2-D matrices only: embeddings, the output head and 1-D parameters (norms,
biases) take AdamW (Jordan et al. 2024; torch.optim.Muon's documentation says the same).
`muon_split(model)` makes the two groups; `MuonAdamW` steps both as one optimizer.

`Muon` equals torch.optim.Muon bit for bit with the same arguments: the same
operations in the same dtypes. Written for the course from the algorithm in torch's
documentation and Jordan's post (https://kellerjordan.github.io/posts/muon/), not copied.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024, as torch.optim.Muon's defaults
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(G: torch.Tensor, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS,
                  eps: float = EPS) -> torch.Tensor:
    """An approximately orthogonal matrix with G's singular vectors (bfloat16, G's shape).

    Normalise by the Frobenius norm (an upper bound of the spectral norm), work on the wide
    orientation, and run `steps` quintic iterations (module docstring)."""
    if G.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(G.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"coefficients={coefficients!r} must be three numbers (a, b, c)")
    if not 0 <= steps < 100:
        raise ValueError(f"steps={steps} must be in [0, 100)")
    a, b, c = coefficients
    tall = G.size(0) > G.size(1)
    X = G.bfloat16()
    if tall:
        X = X.T  # work on X X^T, the smaller Gram matrix
    X.div_(X.norm().clamp(min=eps))  # ||X||_2 <= ||X||_F = 1 after this
    for _ in range(steps):
        gram = X @ X.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A, one fused call
        X = torch.addmm(X, poly, X, beta=a)  # a X + (b A + c A A) X
    return X.T if tall else X


def adjusted_lr(lr: float, adjust_lr_fn, shape) -> float:
    """The learning rate Muon applies to a matrix of `shape` (module docstring)."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")


def check_muon_params(named_shapes) -> None:
    """ValueError naming the first parameter that is not a 2-D matrix: [(name, shape)]."""
    for name, shape in named_shapes:
        if len(shape) != 2:
            raise ValueError(f"Muon orthogonalises 2-D matrices only, but parameter {name} has shape "
                             f"{tuple(shape)}: give 1-D parameters, embeddings and the head to AdamW (muon_split)")


def momentum_update(buf: torch.Tensor, grad: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Advance the momentum buffer in place and return the matrix Newton-Schulz orthogonalises.
    Element-wise: a row block of buf and grad gives that row block of the answer."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def apply_update(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float, lr_adjusted: float) -> None:
    """W <- W (1 - lr wd) - lr' O, in place (element-wise, so it may run on a row block)."""
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr_adjusted)


class Muon(torch.optim.Optimizer):
    """Single-process Muon over 2-D parameters, with torch.optim.Muon's arguments and defaults."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = EPS,
                 ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0:
                raise ValueError(f"{name}={value} must be >= 0")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r} must be one of {ADJUST_LR_FNS}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        check_muon_params([(f"{gi}.{i}", p.shape) for gi, g in enumerate(self.param_groups)
                           for i, p in enumerate(g["params"])])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                u = momentum_update(state["momentum_buffer"], p.grad, g["momentum"], g["nesterov"])
                o = newton_schulz(u, g["ns_steps"], g["ns_coefficients"], g["eps"])
                apply_update(p, o, g["lr"], g["weight_decay"], adjusted_lr(g["lr"], g["adjust_lr_fn"], p.shape))
        return loss


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden 2-D matrices for Muon, everything else for AdamW): embeddings (nn.Embedding weights,
    and the head tied to one), the output head (a module named `head`), and 1-D parameters go to
    AdamW. Each parameter appears once (a tied weight is counted with the embedding)."""
    adamw_ids = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name.split(".")[-1] == "head":
            adamw_ids.update(id(p) for p in module.parameters(recurse=False))
    muon, adamw, seen = [], [], set()
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (muon if p.dim() == 2 and id(p) not in adamw_ids else adamw).append(p)
    return muon, adamw


class MuonAdamW:
    """Muon on `muon_split`'s matrices and AdamW on the rest, stepped together as one optimizer.

        opt = MuonAdamW(model, lr=0.02, adamw_lr=3e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    muon_class: Muon (the default) or anything with its arguments (torch.optim.Muon, a sharded one);
    adamw_class: torch.optim.AdamW or anything called like it (a sharded one)."""

    def __init__(self, model: nn.Module, lr: float = 0.02, adamw_lr: float = 1e-3, weight_decay: float = 0.0,
                 momentum: float = 0.95, adamw_kwargs: dict | None = None, muon_class=Muon,
                 adamw_class=torch.optim.AdamW, **muon_kwargs):
        muon_params, adamw_params = muon_split(model)
        self.muon = muon_class(muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum, **muon_kwargs)
        self.adamw = adamw_class(adamw_params, lr=adamw_lr, weight_decay=weight_decay, **(adamw_kwargs or {}))
        self.optimizers = (self.muon, self.adamw)

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]  # an LR scheduler may change lr here

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported: run forward/backward first")
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)
