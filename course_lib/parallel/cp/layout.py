"""Which tokens of a sequence each context-parallel rank holds, and how much attention work that
gives it. Pure torch: nothing here communicates.

The sequence of T tokens is cut into equal chunks and the chunks are dealt to the cp ranks:

    contiguous   (load_balance=False)  cp chunks of T/cp tokens, rank r holds chunk r
    zig-zag      (load_balance=True)   2cp chunks of c = T/(2cp) tokens, rank r holds chunks
                                       r and 2cp-1-r (one from each end)

    T = 16, cp = 4        positions 0 ......................... 15
    contiguous            | rank0 | rank1 | rank2 | rank3 |
    zig-zag               |r0 |r1 |r2 |r3 |r3 |r2 |r1 |r0 |

Under a causal mask the query at position p scores p + 1 keys (positions 0..p), so a chunk late
in the sequence costs more than an early one. Contiguous chunks give the last rank about 2cp-1
times the score pairs of the first; pairing chunk r with its mirror 2cp-1-r makes every rank's
count equal (Llama 3 splits its sequences this way for context parallelism: 2cp chunks, rank
i holding chunks i and 2cp-1-i; Dubey et al. 2024 §3.3.2). `attention_work` counts the pairs in
closed form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from course_lib._validate import check_int
from course_lib.dims import check_context_parallel


def chunk_ids(cp: int, rank: int, load_balance: bool) -> list[int]:
    """The chunks rank holds, in position order: [rank] of cp chunks (contiguous), or
    [rank, 2cp-1-rank] of 2cp chunks (zig-zag). cp = 1: [0], the whole sequence, either way."""
    check_int("cp", cp)
    check_int("rank", rank, minimum=0)
    if rank >= cp:
        raise ValueError(f"rank={rank} must be < cp={cp}")
    return [rank, 2 * cp - 1 - rank] if _zigzag(cp, load_balance) else [rank]


def _zigzag(cp: int, load_balance: bool) -> bool:
    return bool(load_balance) and cp > 1  # one rank holds everything: nothing to balance


def _chunk_len(seq_len: int, cp: int, load_balance: bool) -> int:
    check_int("seq_len", seq_len)
    check_context_parallel(cp, seq_len, n_head=None, load_balance=load_balance)
    return seq_len // (2 * cp if _zigzag(cp, load_balance) else cp)


def shard_positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> torch.LongTensor:
    """The absolute positions (int64, increasing) of the T/cp tokens rank holds."""
    return _chunk_positions(_chunk_len(seq_len, cp, load_balance), chunk_ids(cp, rank, load_balance))


def _chunk_positions(c: int, ids: list[int]) -> torch.LongTensor:
    """The positions of chunks `ids` of c tokens each, in order."""
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in ids])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, load_balance: bool, dim: int = 1) -> torch.Tensor:
    """rank's shard of the full tensor x along dim (its chunks concatenated in position order)."""
    c = _chunk_len(x.shape[dim], cp, load_balance)
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(cp, rank, load_balance)], dim=dim)


def unshard_sequence(shards: list, cp: int, load_balance: bool, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (shards in rank order): the inverse of
    shard_sequence."""
    if len(shards) != cp:
        raise ValueError(f"got {len(shards)} shards, need one per rank: cp={cp}")
    n_chunks = 2 * cp if _zigzag(cp, load_balance) else cp
    chunks: list = [None] * n_chunks
    for rank, shard in enumerate(shards):
        ids = chunk_ids(cp, rank, load_balance)
        for i, piece in zip(ids, shard.chunk(len(ids), dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)


def _pairs(start: int, c: int) -> int:
    """Causal score pairs of the c queries at positions start..start+c-1: sum of (p + 1)."""
    return c * start + c * (c + 1) // 2


def attention_work(seq_len: int, cp: int, load_balance: bool) -> list[int]:
    """Per rank, the (query, key) score pairs it computes under the causal mask (query position
    >= key position), all keys of the sequence available to it.

    A chunk of c queries starting at position a scores sum_{p=a}^{a+c-1} (p + 1) = c·a + c(c+1)/2.

        contiguous, c = T/cp:      W_r = c²·r + c(c+1)/2
                                   W_{cp-1} / W_0 = 1 + 2c(cp-1)/(c+1)  ->  2cp-1 as c grows
        zig-zag, c = T/(2cp):      W_r = c²·r + c(c+1)/2 + c²·(2cp-1-r) + c(c+1)/2
                                       = c²(2cp-1) + c(c+1)         the same on every rank

    Both sum to T(T+1)/2, the whole causal triangle. (Counted in whole c x c blocks, with a
    diagonal block as one, the contiguous ratio is cp: the last rank's cp blocks against the
    first rank's one.)
    """
    c = _chunk_len(seq_len, cp, load_balance)
    return [sum(_pairs(i * c, c) for i in chunk_ids(cp, r, load_balance)) for r in range(cp)]


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence of seq_len tokens is split over cp ranks (contiguous or zig-zag).
    The divisibility rule (cp | T, or 2cp | T with load_balance) is checked on construction;
    `check(n_head, method)` adds what depends on the model and the method (Ulysses: cp | heads).
    Built once per run: the chunk length and every rank's positions are computed (and checked)
    on construction, so a step reads them instead of recomputing them per batch."""

    seq_len: int
    cp: int
    load_balance: bool = True
    _chunk: int = field(init=False, repr=False, compare=False, default=0)
    _positions: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        c = _chunk_len(self.seq_len, self.cp, self.load_balance)  # raises naming the rule
        object.__setattr__(self, "_chunk", c)
        object.__setattr__(self, "_positions", tuple(_chunk_positions(c, chunk_ids(self.cp, r, self.load_balance))
                                                     for r in range(self.cp)))

    def check(self, n_head: int, method: str, n_kv_head: int | None = None) -> None:
        """The whole rule book for running `method` with n_head heads on this layout."""
        check_context_parallel(self.cp, self.seq_len, n_head, method=method, load_balance=self.load_balance,
                               n_kv_head=n_kv_head)

    @property
    def shard_len(self) -> int:
        """Tokens per rank, T/cp."""
        return self.seq_len // self.cp

    @property
    def chunk_len(self) -> int:
        return self._chunk

    def chunk_ids(self, rank: int) -> list[int]:
        return chunk_ids(self.cp, rank, self.load_balance)

    def positions(self, rank: int) -> torch.LongTensor:
        """The absolute positions rank holds (increasing): shard_positions, computed on
        construction (a copy, so the layout's own stays as built)."""
        self._check_rank(rank)
        return self._positions[rank].clone()

    def _check_rank(self, rank: int) -> None:
        check_int("rank", rank, minimum=0)
        if rank >= self.cp:
            raise ValueError(f"rank={rank} must be < cp={self.cp}")

    def all_positions(self) -> torch.LongTensor:
        """Every rank's positions concatenated in rank order: the order of a sequence gathered
        from the ranks (all-gather, Ulysses' all-to-all)."""
        return torch.cat([self.positions(r) for r in range(self.cp)])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """shard_sequence with the layout's chunk length (x's length along dim must be seq_len)."""
        self._check_rank(rank)
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"the tensor's length {x.shape[dim]} along dim {dim} must be the layout's "
                             f"seq_len={self.seq_len}")
        c = self._chunk
        return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(self.cp, rank, self.load_balance)], dim=dim)

    def unshard(self, shards: list, dim: int = 1) -> torch.Tensor:
        return unshard_sequence(shards, self.cp, self.load_balance, dim)

    def work(self) -> list[int]:
        """attention_work for this layout: causal score pairs per rank."""
        return attention_work(self.seq_len, self.cp, self.load_balance)
