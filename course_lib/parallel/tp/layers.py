"""Tensor-parallel layers: each rank holds a slice of a weight and computes its share.

A linear layer computes Y = X A with A = W^T (nn.Linear stores W as out x in). Split A two ways
over tp ranks (here tp = 2):

    column split (ColumnParallelLinear)          row split (RowParallelLinear)
                                                                 [ A_0 ]
    Y = X [ A_0 | A_1 ] = [ X A_0 | X A_1 ]      Y = [X_0 | X_1] [ A_1 ] = X_0 A_0 + X_1 A_1
        every rank needs all of X;                   rank r holds only X_r (its columns of X)
        rank r produces Y_r: its columns of Y        and produces a partial sum: add them up

Column-parallel output is already split the way a row-parallel layer wants its input, so
column -> (element-wise op) -> row needs no communication in between: an MLP (fc column, GELU,
proj row) or attention (qkv column by heads, attention per head, proj row) costs one
all-reduce forward (g, after the row layer) and one backward (f, before the column layer).

`rows` / `cols` tables say which features of the full layer each rank holds: table[r] is rank
r's list of indices. They make non-contiguous splits explicit (the fused QKV weight, where each
rank takes whole heads of Q, K and V; with fewer key/value heads than ranks several tables list
the same KV head: its first holder owns it, ColumnParallelLinear.weights hands it to the others).
Each layer reports them as `placements()`, one course_lib.parallel.placement record per parameter
(split along a dim, or replicated over tp), which the full state dict, the global-norm weights and
the checkpoint boxes read.
A vocabulary not divisible by tp is padded with zero rows up to a multiple of tp (Megatron does
the same); the loss ignores the padded logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.comm.autograd import copy_parameter_to_group, copy_to_group, reduce_from_group
from course_lib.dims import check_sequence_parallel
from course_lib.parallel.placement import Placement
from course_lib.parallel.tp.functions import SEQUENCE_DIM, enter_region, gathered_linear, leave_region


def contiguous_table(size: int, tp: int) -> torch.Tensor:
    """(tp, size/tp): rank r holds indices [r*size/tp, (r+1)*size/tp)."""
    return torch.arange(size).view(tp, size // tp)


def padded_size(size: int, tp: int) -> int:
    """The smallest multiple of tp that is >= size."""
    return -(-size // tp) * tp


def _group_info(group):
    return dist.get_world_size(group), dist.get_rank(group)


@torch.no_grad()
def _take_pieces(layer: nn.Module, full: nn.Module) -> None:
    """Each parameter of `layer` := its Placement's piece of the full module's parameter: a split
    one's rows (zeros where the table points past it: vocabulary padding), a replicated one whole."""
    for name, placement in layer.placements().items():
        getattr(layer, name).copy_(placement.local(getattr(full, name)))


def _from_linear(cls, linear: nn.Linear, group, sequence_parallel: bool, table):
    """A `cls` layer (column or row parallel, `table` its rows or cols) holding this rank's
    pieces of the full `linear`, on its device and in its dtype."""
    layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None, sequence_parallel, table)
    layer.to(linear.weight.device, linear.weight.dtype)
    _take_pieces(layer, linear)
    return layer


def _shared_rows(rows: torch.Tensor, rank: int):
    """Rows several ranks hold (a key/value head every rank of its group reads): (this rank's positions
    of them, their slots among all shared rows, how many shared rows, whether this rank is each one's
    first holder), or None when every row is on one rank only (the usual split)."""
    held = torch.bincount(rows.flatten())
    shared = (held > 1).nonzero().flatten()
    if not len(shared):
        return None
    local = (held[rows[rank]] > 1).nonzero().flatten()
    first = torch.tensor([int((rows == i).any(dim=1).nonzero()[0]) == rank for i in rows[rank][local].tolist()])
    return local, torch.searchsorted(shared, rows[rank][local]), len(shared), first


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r: rank r computes the output features rows[r] (its columns of A = W^T).

    weight: (len(rows[r]), in_features), bias: (len(rows[r]),). Forward enters the region:
    f (identity; the backward all-reduces dL/dX, since every rank's columns used all of X) or,
    under sequence parallelism, an all-gather of the sequence shards of X.
    """

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = True,
                 sequence_parallel: bool = False, rows: torch.Tensor | None = None):
        super().__init__()
        tp, rank = _group_info(group)
        self.group, self.tp, self.rank, self.sequence_parallel = group, tp, rank, sequence_parallel
        self.in_features, self.out_features = in_features, out_features  # full sizes
        self.rows = contiguous_table(padded_size(out_features, tp), tp) if rows is None else rows
        self.shared = _shared_rows(self.rows, rank)  # rows several ranks read (a KV head, n_kv_head < tp)
        local = self.rows.shape[1]
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.register_parameter("bias", nn.Parameter(torch.zeros(local)) if bias else None)
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, sequence_parallel: bool = False, rows=None):
        """This rank's rows of a full nn.Linear (same weights on every rank)."""
        return _from_linear(cls, linear, group, sequence_parallel, rows)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) as the matmul uses them: the parameters, with any shared rows taken from
        their first holder (_from_first_holders)."""
        if self.shared is None:
            return self.weight, self.bias
        return self._from_first_holders(self.weight), None if self.bias is None else self._from_first_holders(self.bias)

    def _from_first_holders(self, t: torch.Tensor) -> torch.Tensor:
        """t with its shared rows (a KV head its group's tp/n_kv_head ranks all read) replaced by their
        first holder's, the one copy that exists (the others are padding: zeros, like the vocabulary's).
        The first holders write theirs into a zero buffer of all shared rows and one all-reduce, f then
        g (comm.autograd), sums it forward (x + 0 + ... = x) and sums the gradients of every rank's use
        of it backward: the first holder's gradient is the single-process one, the padding's zero."""
        local, slots, n_slots, first = (i.to(t.device) if torch.is_tensor(i) else i for i in self.shared)
        buf = t.new_zeros((n_slots, *t.shape[1:])).index_copy(0, slots[first], t[local[first]])
        every = reduce_from_group(copy_to_group(buf, self.group), self.group)
        return t.index_copy(0, local, every[slots])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weights()
        if self.sequence_parallel:  # x is this rank's T/tp tokens: any length gathers back to T
            return gathered_linear(x, w, b, self.group)
        return F.linear(enter_region(x, self.group, False), w, b)

    def placements(self) -> dict[str, Placement]:
        """{parameter name: Placement}: the weight's and the bias's rows (dim 0) over tp. A row several
        ranks hold (a KV head read by several ranks) is its first holder's; the others list a padding
        index in its place (>= out_features) and keep zeros there: every element on one rank."""
        table = self.rows.clone()
        if self.shared is not None:
            seen, pad = set(), padded_size(self.out_features, self.tp)
            for r in range(self.tp):  # rank order: the first holder keeps the index
                for i in range(table.shape[1]):
                    if int(table[r, i]) in seen:
                        table[r, i], pad = pad, pad + 1
                    seen.add(int(self.rows[r, i]))
        split = Placement.split("tp", 0, table, self.rank, self.out_features)
        return {"weight": split, **({"bias": split} if self.bias is not None else {})}

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}/{self.tp} per rank, sp={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r + b: rank r holds the input features cols[r] (its rows of A = W^T).

    weight: (out_features, len(cols[r])); the bias is whole on every rank and added once, after
    the partial sums are reduced: g (all-reduce; backward identity) or, under sequence
    parallelism, a reduce-scatter to this rank's sequence shard. There the bias meets only that
    shard, so it goes through f: its gradient is summed over the ranks.
    """

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = True,
                 sequence_parallel: bool = False, cols: torch.Tensor | None = None):
        super().__init__()
        tp, rank = _group_info(group)
        self.group, self.tp, self.rank, self.sequence_parallel = group, tp, rank, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.cols = contiguous_table(in_features, tp) if cols is None else cols
        self.weight = nn.Parameter(torch.empty(out_features, self.cols.shape[1]))
        self.register_parameter("bias", nn.Parameter(torch.zeros(out_features)) if bias else None)
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, sequence_parallel: bool = False, cols=None):
        """This rank's input columns of a full nn.Linear (same weights on every rank)."""
        return _from_linear(cls, linear, group, sequence_parallel, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(F.linear(x, self.weight), self.group, self.sequence_parallel)
        if self.bias is None:
            return y
        return y + (copy_parameter_to_group(self.bias, self.group) if self.sequence_parallel else self.bias)

    def placements(self) -> dict[str, Placement]:
        """The weight's input columns (dim 1) over tp; the bias whole on every tp rank."""
        out = {"weight": Placement.split("tp", 1, self.cols, self.rank, self.in_features)}
        return out | ({"bias": Placement.replicated("tp", self.rank, self.tp)} if self.bias is not None else {})

    def extra_repr(self):
        return f"in={self.in_features}/{self.tp} per rank, out={self.out_features}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embedding rows of tokens [r*V'/tp, (r+1)*V'/tp), V' = vocab padded to a
    multiple of tp. A token outside that range looks up nothing (zeros); the rank owning it
    supplies its row, so the sum over ranks (g, or a reduce-scatter under sequence
    parallelism) is the full embedding. Backward: each rank scatters into its own rows only.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False):
        super().__init__()
        tp, rank = _group_info(group)
        self.group, self.tp, self.rank, self.sequence_parallel = group, tp, rank, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows = contiguous_table(padded_size(num_embeddings, tp), tp)
        self.vocab_start = int(self.rows[rank, 0])
        self.weight = nn.Parameter(torch.empty(self.rows.shape[1], embedding_dim))
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None, sequence_parallel: bool = False):
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel).to(emb.weight.device, emb.weight.dtype)
        _take_pieces(layer, emb)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # The model's entry, where every rank still holds the WHOLE sequence: the rule book's
        # T % tp == 0, checked here (once) before the reduce-scatter below would wait on it.
        check_sequence_parallel(self.sequence_parallel, self.tp, idx.shape[SEQUENCE_DIM])
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        partial = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(partial, self.group, self.sequence_parallel)

    def placements(self) -> dict[str, Placement]:
        """The vocabulary rows (dim 0) over tp; rows >= num_embeddings are padding."""
        return {"weight": Placement.split("tp", 0, self.rows, self.rank, self.num_embeddings)}

    def extra_repr(self):
        return f"{self.num_embeddings} tokens ({self.weight.shape[0]} per rank), dim={self.embedding_dim}"


class SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm on this rank's sequence shard. Its weight and bias are whole on every rank but
    each rank's copy only sees 1/tp of the tokens, so they go through f: the gradient is the
    sum over ranks, the single-process gradient (copy_parameter_to_group: summed at the end of
    backward, in one all-reduce with every other such parameter's)."""

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm, group=None):
        new = cls(ln.normalized_shape, eps=ln.eps, bias=ln.bias is not None).to(ln.weight.device, ln.weight.dtype)
        new.load_state_dict(ln.state_dict())
        new.group = group
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = copy_parameter_to_group(self.bias, self.group) if self.bias is not None else None
        weight = copy_parameter_to_group(self.weight, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelPositions(nn.Embedding):
    """The position embedding under sequence parallelism: given the T positions of the whole
    sequence (pos, default 0..T-1, T % tp == 0 checked at the token embedding), rank r returns
    the rows of its sequence shard, pos[r*T/tp : (r+1)*T/tp]; the table goes through f, as above."""

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None):
        new = cls(emb.num_embeddings, emb.embedding_dim).to(emb.weight.device, emb.weight.dtype)
        new.load_state_dict(emb.state_dict())
        new.group, (new.tp, new.rank) = group, _group_info(group)
        return new

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        mine = pos.chunk(self.tp)[self.rank]  # integer ids: a local slice, nothing to send
        return F.embedding(mine, copy_parameter_to_group(self.weight, self.group))
