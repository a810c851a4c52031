"""The flat, padded parameter buffer that every ZeRO stage shards.

A *unit* is a list of parameters laid end to end in one flat vector of P elements, padded
with zeros to a multiple of the world size N and cut into N equal shards:

    flat (padded to N * S, S = ceil(P / N)):

      | p0 ........ | p1 .... | p2 ............... | 0 0 |     <- padding: N*S - P zeros
      |<-- shard 0 -->|<-- shard 1 -->|<-- shard 2 -->|
        rank 0 owns     rank 1 owns     rank 2 owns       [r*S, (r+1)*S)

Equal shards are what the built-in collectives need: all_gather and reduce_scatter take one
tensor of S elements per rank (gloo rejects uneven all_gather). A parameter may straddle a
shard boundary; that is fine, because every optimizer ZeRO supports works element by element
(Adam's m and v of element i depend only on element i's gradients), so the update of a flat
shard equals the update of the parameters' pieces in it. The padding has zero gradient and
zero value, so it stays zero under Adam and SGD (and under weight decay, which scales it).

`shard_bounds(numel, world_size, rank)` is the rule; `FlatUnit` applies it to a parameter list.
"""

from __future__ import annotations

import torch


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's shard in a flat vector of `numel` elements padded to N*S, S = ceil(numel/N).

    The last ranks' shards may lie partly (or wholly) in the padding: stop can exceed numel.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    size = -(-numel // world_size)
    return rank * size, (rank + 1) * size


class FlatUnit:
    """Parameters params[0..k) flattened, in this order, into one padded vector (see module docstring).

    offsets[i]       where params[i] starts in the flat vector
    numel            P, the number of real elements;  padded_numel = N * shard_numel
    shard_numel      S = ceil(P / N), the same on every rank
    start, stop      this rank's shard [rank*S, (rank+1)*S)
    """

    def __init__(self, params, world_size: int, rank: int):
        self.params = list(params)
        if not self.params:
            raise ValueError("a flat unit needs at least one parameter")
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets, total = [], 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel, self.world_size, self.rank = total, world_size, rank
        self.start, self.stop = shard_bounds(total, world_size, rank)
        self.shard_numel = self.stop - self.start
        self.padded_numel = self.shard_numel * world_size

    def flatten(self, tensors, dtype=None, device=None) -> torch.Tensor:
        """One padded flat vector from tensors shaped like the parameters (None counts as zeros)."""
        ref = self.params[0]
        out = torch.zeros(self.padded_numel, dtype=dtype or ref.dtype, device=device or ref.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            if t is not None:
                out[off:off + n].copy_(t.reshape(-1))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like each parameter (differentiable when flat is)."""
        return [flat[off:off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice [start, stop) of a padded flat vector (a view)."""
        return flat[self.start:self.stop]

    def shard_pieces(self, shard: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(i, view of `shard` holding params[i]'s elements) for every parameter that this rank's
        shard (S elements, [start, stop) of the flat vector) overlaps; the padding is in none."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(off, self.start), min(off + n, self.stop)
            if lo < hi:
                out.append((i, shard[lo - self.start:hi - self.start]))
        return out

    def unflatten_into(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the real (unpadded) elements of `flat`, shaped like each parameter."""
        return [v.clone() for v in self.views(flat)]

    def __repr__(self) -> str:
        return (f"FlatUnit({len(self.params)} params, P={self.numel}, N={self.world_size}, "
                f"S={self.shard_numel}, rank {self.rank} owns [{self.start}, {self.stop}))")
