"""Activation checkpointing: keep only segment boundaries, recompute the rest in backward.

Split the L blocks into segments of k consecutive blocks. The forward pass runs each segment
under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: autograd keeps only the
segment's input (the "checkpoint", one (B, T, d) tensor) and throws away everything the
blocks inside would have saved. In backward, when the gradient reaches a segment, its forward
is run again from the stored input to rebuild those tensors, and then back-propagated.

Memory, with a = bytes one block saves normally and b = bytes of one boundary tensor::

    kept through the whole forward:   ceil(L / k) * b        (one input per segment)
    extra while one segment is in backward:   k * a           (its recomputed activations)
    peak  M(k) ~ (L / k) * b + k * a,   minimised at  k* = sqrt(L * b / a)

When a block saves about as much as its input (a ~ b, the chain of Chen et al. 2016) this is
k* = sqrt(L) and M = 2 sqrt(L) b instead of L b. A transformer block saves far more than its
input (a >> b), which is why transformer training checkpoints every block (k = 1).

Cost: every checkpointed block runs its forward twice, so a step costs about
forward + forward + backward ~ 4/3 of the plain step when backward ~ 2 x forward.

The model stays plain and GPT.forward exists once: checkpointing wraps blocks. Inside
`checkpointed_blocks(model, every_k)` the model's `blocks` are replaced by segments of k
blocks, each a `CheckpointedSegment`; GPT.forward runs its usual loop over them, and on exit
the original blocks are back (the parameters are the same objects throughout).
`checkpointed_forward(model, idx, targets, every_k)` is one forward in that state, and
`CheckpointedGPT` a module that always runs so.
Dropout is safe: checkpoint restores the RNG state before recomputing, so the same units drop.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from course_lib._validate import check_int


def check_every_k(every_k, n_layer: int) -> None:
    check_int("every_k", every_k, maximum=n_layer, rule=f"an int with 1 <= every_k <= n_layer={n_layer}")


def segments(n_layer: int, every_k: int) -> list[range]:
    """Block indices of each checkpointed segment: [0, k), [k, 2k), ... (the last may be shorter)."""
    check_every_k(every_k, n_layer)
    return [range(s, min(s + every_k, n_layer)) for s in range(0, n_layer, every_k)]


def _run_blocks(x: torch.Tensor, blocks: Sequence[nn.Module]) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def checkpoint_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, every_k: int) -> torch.Tensor:
    """Run x through `blocks` in order, checkpointing every `every_k` consecutive blocks."""
    blocks = list(blocks)
    for seg in segments(len(blocks), every_k):
        x = checkpoint(_run_blocks, x, blocks[seg.start : seg.stop], use_reentrant=False)
    return x


class CheckpointedSegment(nn.Module):
    """Consecutive blocks run as one checkpointed unit: only its input is saved for backward."""

    def __init__(self, blocks: Sequence[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(_run_blocks, x, list(self.blocks), use_reentrant=False)


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, every_k: int = 1):
    """Within the block, model.blocks is a ModuleList of CheckpointedSegments of every_k blocks
    (the same block objects); the original list is restored on exit. The recomputation in
    backward calls the segments' own block lists, so backward may run after the block ends."""
    check_every_k(every_k, len(model.blocks))
    original = model.blocks
    model.blocks = nn.ModuleList(CheckpointedSegment(original[seg.start:seg.stop])
                                 for seg in segments(len(original), every_k))
    try:
        yield model
    finally:
        model.blocks = original


def recompute_in_place(blocks: Sequence[nn.Module]) -> None:
    """Make each block run under checkpoint from now on, in place: block.forward becomes
    checkpoint(block's own forward, x). Unlike `checkpointed_blocks`, no module is added or
    moved, so parameter names stay the single-process names (state dicts, sharded
    checkpoints, tensor/expert/pipeline wrappers that hold the blocks see the same model).
    Calling it twice on a block is a no-op."""
    for block in blocks:
        if getattr(block, "recomputed", False):
            continue
        plain = block.forward  # the bound method of the class (tensor parallelism changed submodules only)
        block.forward = lambda x, plain=plain: checkpoint(plain, x, use_reentrant=False)
        block.recomputed = True


def checkpointed_forward(model, idx: torch.Tensor, targets: torch.Tensor | None = None, every_k: int = 1,
                         pos: torch.Tensor | None = None):
    """model(idx, targets, pos) with the blocks checkpointed in segments of `every_k`: same
    (logits, loss), same gradients, fewer saved activations. Embeddings, ln_f, head and the
    loss run as GPT.forward runs them (it is GPT.forward)."""
    check_every_k(every_k, model.config.n_layer)
    with checkpointed_blocks(model, every_k):
        return model(idx, targets, pos)


class CheckpointedGPT(nn.Module):
    """Wrap a plain GPT so that calling it checkpoints every `every_k` blocks. The parameters
    are the wrapped model's own (no copy): `CheckpointedGPT(model, 2)(idx, y)` trains `model`."""

    def __init__(self, model: nn.Module, every_k: int = 1):
        super().__init__()
        check_every_k(every_k, model.config.n_layer)
        self.model, self.every_k = model, every_k
        self.config = model.config

    def forward(self, idx, targets=None, pos=None):
        return checkpointed_forward(self.model, idx, targets, self.every_k, pos)


def checkpoint_memory(n_layer: int, every_k: int, per_layer_bytes: float, boundary_bytes: float) -> dict[str, float]:
    """The model of the module docstring: {"kept", "recompute", "peak"} bytes for the blocks."""
    check_every_k(every_k, n_layer)
    kept = math.ceil(n_layer / every_k) * boundary_bytes
    recompute = every_k * per_layer_bytes
    return {"kept": kept, "recompute": recompute, "peak": kept + recompute}


def best_every_k(n_layer: int, per_layer_bytes: float, boundary_bytes: float) -> int:
    """The k in 1..n_layer with the smallest modelled peak (close to sqrt(L * b / a))."""
    return min(range(1, n_layer + 1), key=lambda k: checkpoint_memory(n_layer, k, per_layer_bytes, boundary_bytes)["peak"])


class Chain(nn.Module):
    """L small layers x -> tanh(x W_i + c_i): each layer saves about one (B, width) tensor,
    the same size as its input, so a ~ b and the best segment length is ~ sqrt(L)."""

    def __init__(self, n_layer: int = 16, width: int = 256, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.n_layer = n_layer
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n_layer))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(width, width, generator=gen) / math.sqrt(width))
                layer.bias.zero_()

    def forward(self, x: torch.Tensor, every_k: int | None = None) -> torch.Tensor:
        blocks = [nn.Sequential(layer, nn.Tanh()) for layer in self.layers]
        return _run_blocks(x, blocks) if every_k is None else checkpoint_blocks(blocks, x, every_k)
