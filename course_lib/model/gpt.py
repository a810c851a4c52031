"""A plain GPT-2-style decoder: the single-device model every parallel version
in this course is compared against.

Block diagram (pre-norm residual stream, B = batch, T = sequence, d = d_model)::

    idx (B, T) int64
      |
      +--> tok_emb (V x d) ---+
      |                       (+)--> drop --> x (B, T, d)
      +--> pos_emb (T x d) ---+
                                              |
      repeated n_layer times (Block):         v
          x = x + attn(ln1(x))     attn: qkv -> attend: causal softmax(Q K^T / sqrt(d_head)) V -> proj
          x = x + mlp(ln2(x))      mlp:  fc (d -> d_ff) -> GELU -> proj (d_ff -> d)
                                              |
                                            ln_f --> head (d -> V) --> logits (B, T, V)

Parameter count. Write d = d_model, f = d_ff, V = vocab_size, T = block_size,
b = 1 if bias else 0 (LayerNorm has a weight, plus a bias when b = 1), and g = n_kv_head * d_head
the width of K and of V (g = d unless the config asks for grouped-query attention):

    per block:
        ln1, ln2:        2 * (d + b*d)
        attn.qkv:        d*(d + 2g) + b*(d + 2g)     (Q: d rows, K and V: g rows each)
        attn.proj:       d*d   + b*d
        mlp.fc:          d*f   + b*f
        mlp.proj:        f*d   + b*d
        total:           2*d^2 + 2*d*g + 2*d*f + 2*d + b*(5*d + 2*g + f)

    with g = d, f = 4d and b = 1 this is 12*d^2 + 13*d.

    whole model:
        n_layer * per_block  +  V*d (tok_emb)  +  T*d (pos_emb)
        + (d + b*d) (ln_f)   +  V*d more only if the head is NOT tied to tok_emb.

`expected_num_params(config)` evaluates this formula and `GPT.num_params()`
counts the real tensors; the tests check that the two agree.

The attention formula itself is a submodule, `block.attn.attend` (layers.CausalAttention,
q, k, v -> out), and the token positions are an argument, `forward(idx, targets, pos)`: the two
seams a strategy that splits the sequence needs (it swaps the one and passes its shard's
positions in the other). The MLP and the attention core live in layers.py, below this file and
moe.py.
GPTConfig and expected_num_params live in config.py (no torch: the estimator reads them).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.config import ATTN_IMPLS, GPTConfig, expected_num_params  # noqa: F401 (re-exported)
from course_lib.model.layers import MLP, CausalAttention
from course_lib.model.moe import MoELayer, auxiliary_loss


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over all B*T positions of -log softmax(logits)[target]; logits (B, T, V)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def sequence_positions(idx: torch.Tensor, block_size: int, pos: torch.Tensor | None = None) -> torch.Tensor:
    """The absolute positions of idx's T tokens: pos if given (checked to be (T,)), else
    arange(T). Every module that embeds token ids (GPT.forward, a pipeline's first stage)
    takes its positions from here, so a sequence shard can carry its own."""
    _, T = idx.shape
    if T > block_size:
        raise ValueError(f"sequence length {T} exceeds block_size={block_size}")
    if pos is None:
        return torch.arange(T, device=idx.device)
    if tuple(pos.shape) != (T,):
        raise ValueError(f"pos of shape {tuple(pos.shape)} must be ({T},): one absolute position per token of idx")
    return pos


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, with grouped-query attention when n_kv_head < n_head.

    For each head h:  A_h = softmax(Q_h K_g^T / sqrt(d_head) + M) V_g, where the
    mask M is -inf above the diagonal so position t only sees positions <= t, and g = h // G
    is the key/value head of h's group: G = n_head / n_kv_head query heads share one K and V
    head (Ainslie et al. 2023; G = 1 is plain multi-head attention, n_kv_head = 1 multi-query).
    The heads are concatenated and mixed by `proj`. The formula itself is the
    submodule `attend` (a CausalAttention: q, k, v -> out), which a strategy that
    splits the sequence replaces; qkv and proj are the weights around it.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.d_head = config.d_head
        self.group = config.n_head // config.kv_heads  # G: query heads per key/value head
        self.qkv = nn.Linear(d, d + 2 * config.kv_dim, bias=config.bias)  # Q, K, V in one matmul
        self.proj = nn.Linear(d, d, bias=config.bias)
        self.attend = CausalAttention(config.attn_impl, config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)

    def local_heads(self, width: int) -> tuple[int, int]:
        """(query heads, key/value heads) in a qkv output `width` wide: (n_head, n_kv_head) here,
        a rank's share under tensor parallelism. A rank holds whole groups (kv KV heads and their
        G*kv query heads: width = (G + 2) * kv * d_head), or, when the tp ranks outnumber the KV
        heads, one KV head and q < G of its query heads (width = (q + 2) * d_head, not a multiple
        of (G + 2) * d_head since q + 2 < G + 2)."""
        heads = width // self.d_head
        kv = heads // (self.group + 2) if heads % (self.group + 2) == 0 else 1
        return heads - 2 * kv, kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        # Shapes are read off qkv's output, not x: a tensor-parallel qkv returns only this rank's
        # heads (and, under sequence parallelism, the whole sequence from a shard of it).
        B, T, width = qkv.shape
        n_q, n_kv = self.local_heads(width)
        q, k, v = qkv.split([n_q * self.d_head, n_kv * self.d_head, n_kv * self.d_head], dim=-1)
        # (B, T, heads * d_head) -> (B, heads, T, d_head): every head attends independently.
        q, k, v = (t.view(B, T, -1, self.d_head).transpose(1, 2) for t in (q, k, v))
        # k, v stay n_kv heads wide: `attend` repeats them to the query heads (layers.repeat_kv), after
        # any communication of a strategy that swaps it (context parallelism sends K, V un-repeated)
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # concatenate the heads
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """One transformer layer with pre-norm residuals:
    x = x + attn(ln1(x));  x = x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MoELayer(config) if config.n_experts else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """GPT-2-style language model. `GPT(config, seed)` is fully determined by the
    seed: the global torch RNG is neither read nor advanced."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        # nn.Linear / nn.Embedding run PyTorch's default init, which draws from
        # the global RNG. We overwrite those values in init_weights, so fork the
        # RNG here to leave the caller's random stream exactly as it was.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.block_size, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # The loss of the logits; a strategy that shards the logits (tensor parallelism's
        # vocabulary split) swaps in its own. A plain function: no parameters, no submodule.
        self.loss_fn = token_cross_entropy
        if config.tie_weights:
            # The same Parameter object in two places: one tensor, two uses,
            # and its gradient is the sum of both contributions.
            self.head.weight = self.tok_emb.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init: weights ~ N(0, 0.02), biases 0, LayerNorm gain 1; the two
        projections that write into the residual stream (attn.proj, mlp.proj)
        use std 0.02 / sqrt(2 * n_layer), because each layer adds two such
        outputs to the stream and we want its variance not to grow with depth.
        """
        gen = torch.Generator().manual_seed(seed)  # local RNG: global seed irrelevant
        std = 0.02
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():  # fixed order -> deterministic
            if isinstance(module, nn.Linear):
                if name == "head" and self.config.tie_weights:
                    continue  # it is tok_emb.weight, initialised as an embedding
                writes_residual = name.endswith(("attn.proj", "mlp.proj")) or (".experts." in name and name.endswith(".proj"))
                s = resid_std if writes_residual else std
                nn.init.normal_(module.weight, 0.0, s, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std, generator=gen)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Number of distinct parameter elements (a tied weight counts once,
        because `parameters()` yields each Parameter object only once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, pos: torch.Tensor | None = None):
        """idx: (B, T) token ids. Returns (logits (B, T, V), loss or None), where
        loss = mean over all B*T positions of -log softmax(logits)[target].

        pos: (T,) int64, the absolute position of each token (default 0..T-1); a process
        holding one shard of a longer sequence passes its shard's positions."""
        pos = sequence_positions(idx, self.config.block_size, pos)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B,T,d) + (T,d) broadcast
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = self.loss_fn(logits, targets)
            if self.config.n_experts:  # + the routers' load-balancing and z-losses (model/moe.py)
                loss = loss + auxiliary_loss(self)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, generator=None):
        """Append `max_new_tokens` sampled tokens to idx (B, T). temperature=0
        means greedy decoding. Only the last block_size tokens are fed back."""
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx
