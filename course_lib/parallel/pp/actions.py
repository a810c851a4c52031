"""The vocabulary of schedules: actions, per-rank action lists, and where each stage lives.

An action is F (forward), B (backward) or W (weight gradient) of one micro-batch j on one of
a rank's model chunks c. Two placements of the S = p*v stages on p ranks:

    "loop" (Megatron's interleaving)   chunk c of rank r is stage c*p + r
                                       p = 4, v = 2:  rank 0: stages 0, 4   rank 3: stages 3, 7
    "v"    (Qi et al., 2024)           exactly 2 chunks: chunk 0 of rank r is stage r, chunk 1 is
                                       stage 2p-1-r; the micro-batch goes down the ranks and back up
                                       p = 4:         rank 0: stages 0, 7   rank 3: stages 3, 4

With "v" rank 0 holds the first and the last stage (the embedding and the loss on one rank,
so a tied embedding/head needs no exchange) and the turn, stage p-1 -> p, stays on rank p-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEMENTS = ("loop", "v")


class ScheduleError(ValueError):
    """A schedule that misses an action, runs one twice, deadlocks or holds too much."""


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    __repr__ = __str__


def stage_of(placement: str, n_ranks: int, rank: int, chunk: int) -> int:
    """The stage that chunk `chunk` of rank `rank` runs."""
    if placement == "v":
        return rank if chunk == 0 else 2 * n_ranks - 1 - rank
    return chunk * n_ranks + rank


def rank_of(placement: str, n_ranks: int, stage: int) -> int:
    """The rank (within the pipeline group) that holds `stage`."""
    if placement == "v":
        return stage if stage < n_ranks else 2 * n_ranks - 1 - stage
    return stage % n_ranks


def check_placement(placement: str, virtual_stages: int) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} must be one of {PLACEMENTS}")
    if placement == "v" and virtual_stages != 2:
        raise ValueError(f"placement='v' puts exactly 2 chunks on each rank (stages r and 2p-1-r), "
                         f"got virtual_stages={virtual_stages}")


@dataclass
class Schedule:
    """Per-rank action lists. actions[r] is what rank r runs, in order. placement: where the
    stages live (see the module docstring). overlapped[r]: indices i such that actions i (an F)
    and i+1 (a B of another micro-batch) of rank r form one overlapped F&B pair (DualPipe):
    the pair starts when both can, and runs as one unit."""

    name: str
    n_ranks: int
    n_microbatches: int
    virtual_stages: int
    actions: list[list[Action]]
    placement: str = "loop"
    overlapped: list[set] = field(default_factory=list)

    @property
    def split_backward(self) -> bool:
        return any(a.kind == "W" for acts in self.actions for a in acts)

    @property
    def n_stages(self) -> int:
        return self.n_ranks * self.virtual_stages

    def pairs(self, rank: int) -> set:
        return self.overlapped[rank] if rank < len(self.overlapped) else set()

    def table(self) -> str:
        """One line per rank: 'rank 0: F0 F1 B0 ...' (an overlapped pair as F3.1&B0)."""
        lines = []
        for r, acts in enumerate(self.actions):
            words, pairs, i = [], self.pairs(r), 0
            while i < len(acts):
                if i in pairs:
                    words.append(f"{acts[i]}&{acts[i + 1]}")
                    i += 2
                else:
                    words.append(str(acts[i]))
                    i += 1
            lines.append(f"rank {r}: " + " ".join(words))
        return "\n".join(lines)
