"""A pipeline stage: this rank's share of the single-process GPT.

The model's n blocks are cut into S = p*v contiguous runs, one per stage, as evenly as
possible: every stage gets n // S blocks and the first n % S stages one more (the last stage
already carries the final norm, the head and the loss). Stage s lives on rank s % p as its
chunk s // p, so with v > 1 a rank holds v non-adjacent runs (Megatron's interleaving):

    p = 2, v = 2, 8 blocks:   rank 0: chunk 0 = stage 0 = blocks 0-1,  chunk 1 = stage 2 = blocks 4-5
                              rank 1: chunk 0 = stage 1 = blocks 2-3,  chunk 1 = stage 3 = blocks 6-7

With placement="v" (zbv, dualpipev) each rank holds exactly 2 chunks, stages r and 2p-1-r
(actions.py): rank 0 holds the first and the last stage.

Every chunk runs the GPT's forward, embed -> blocks -> ln_f -> head, with nn.Identity in the
places it does not own: only stage 0 embeds token ids, only stage S-1 produces logits.

Tied embeddings: the head's matrix is the token embedding. Stage 0 and stage S-1 each hold a
copy (equal, since every rank builds the model from the same seed) and each computes only
its own part of the gradient, so after the backward they exchange and sum it; AdamW then
makes the same update on both copies, which stay equal, as Megatron does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib._validate import check_int
from course_lib.dims import split_layers
from course_lib.model.gpt import sequence_positions
from course_lib.parallel.pp.actions import check_placement, rank_of, stage_of
from course_lib.parallel.placement import Placement


class TokenAndPositionEmbedding(nn.Module):
    """The GPT's input: drop(tok_emb(idx) + pos_emb(pos)), pos = 0..T-1 unless given, sharing
    the model's modules (GPT.forward's first line)."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = tok_emb, pos_emb, drop

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        pos = sequence_positions(idx, self.pos_emb.num_embeddings, pos)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class StageChunk(nn.Module):
    """Stage s: embed (or Identity) -> its blocks -> ln_f and head (or Identity)."""

    def __init__(self, model: nn.Module, stage_index: int, n_stages: int, block_ids: range):
        super().__init__()
        self.stage_index, self.block_ids = stage_index, block_ids
        first, last = stage_index == 0, stage_index == n_stages - 1
        self.first = first
        self.embed = TokenAndPositionEmbedding(model.tok_emb, model.pos_emb, model.drop) if first else nn.Identity()
        self.blocks = nn.ModuleList(model.blocks[i] for i in block_ids)
        self.ln_f = model.ln_f if last else nn.Identity()
        self.head = model.head if last else nn.Identity()

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (B, T) on the first stage (pos: their positions, default 0..T-1), else
        the previous stage's activations (B, T, d)."""
        x = self.embed(x, pos) if self.first else self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class PipelineStage(nn.Module):
    """This rank's chunks (chunks[c] is stage c*p + rank, or with placement "v" stages rank and
    2p-1-rank) and what the runner needs to route."""

    def __init__(self, model: nn.Module, group, virtual_stages: int, placement: str = "loop"):
        super().__init__()
        self.group = group
        self.rank, self.n_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.virtual_stages, self.placement = virtual_stages, placement
        self.n_stages = self.n_ranks * virtual_stages
        self.vocab_size = model.config.vocab_size
        self.blocks_per_stage = split_layers(len(model.blocks), self.n_stages)
        self.chunks = nn.ModuleList(
            StageChunk(model, s, self.n_stages, self.blocks_per_stage[s])
            for s in (self.stage_of(c) for c in range(virtual_stages)))
        # Canonical names in the single-process model (a tied weight is "tok_emb.weight").
        name_of = {}
        for name, p in model.named_parameters():  # first name of each Parameter object
            name_of.setdefault(id(p), name)
        self.param_names = [name_of[id(p)] for p in self.parameters()]
        tied = getattr(model.config, "tie_weights", False)
        # the V puts the first and the last stage on rank 0: one Parameter, no exchange
        self.tied_across_ranks = bool(tied) and self.n_ranks > 1 and placement != "v"
        self.last_peak_activation_bytes = 0  # set by every run_schedule
        # The model's loss of the logits (tensor parallelism swaps in its vocabulary-split one).
        self.loss_fn = getattr(model, "loss_fn", None)

    def stage_of(self, chunk: int) -> int:
        return stage_of(self.placement, self.n_ranks, self.rank, chunk)

    def global_rank_of_stage(self, stage: int) -> int:
        """The process (default-group rank) that holds `stage`."""
        r = rank_of(self.placement, self.n_ranks, stage)
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of the tied embedding/head matrix, if it holds stage 0 or S-1."""
        if not self.tied_across_ranks:
            return None
        if self.rank == 0:
            return self.chunks[0].embed.tok_emb.weight
        if self.rank == self.n_ranks - 1:
            return self.chunks[-1].head.weight
        return None

    def sum_tied_gradients(self) -> None:
        """Stage 0 and stage S-1 swap their parts of the tied matrix's gradient and add them."""
        weight = self.tied_weight()
        if weight is None:
            return
        if weight.grad is None:  # both sides must take part, or the other one waits forever
            weight.grad = torch.zeros_like(weight)
        peer = self.global_rank_of_stage(self.n_stages - 1 if self.rank == 0 else 0)
        mine = weight.grad.detach().clone()
        theirs = torch.empty_like(mine)
        # Stage 0's rank sends first, the last stage's receives first: if both sent first, each
        # send would wait for a receive the other posts only after it (NCCL hangs on that).
        if self.rank == 0:
            dist.send(mine, peer, group=self.group)
            dist.recv(theirs, peer, group=self.group)
        else:
            dist.recv(theirs, peer, group=self.group)
            dist.send(mine, peer, group=self.group)
        weight.grad.add_(theirs)

    def placements(self) -> dict[str, Placement]:
        """{single-process name: Placement over pp} of this rank's parameters: whole on this rank
        alone, but the tied matrix on the ranks of stage 0 and stage S-1 (ranks 0 and p-1), which
        hold the same summed gradient after sum_tied_gradients."""
        alone = Placement.whole("pp", (self.rank,), self.rank, self.n_ranks)
        tied = Placement.whole("pp", (0, self.n_ranks - 1), self.rank, self.n_ranks) if self.tied_across_ranks else alone
        return {name: tied if name == "tok_emb.weight" else alone for name in self.param_names}

    def copies(self, name: str) -> int:
        """How many ranks of the group hold parameter `name` (its placement's copies): 2 for the
        tied matrix, else 1."""
        return self.placements()[name].copies


def build_stage(model: nn.Module, group=None, virtual_stages: int = 1, placement: str = "loop") -> PipelineStage:
    """This rank's PipelineStage of `model` (the same single-process GPT on every rank) within
    `group` (None: the default group). Must be called by every rank of the group."""
    check_int("virtual_stages", virtual_stages)
    check_placement(placement, virtual_stages)
    return PipelineStage(model, group, virtual_stages, placement)
