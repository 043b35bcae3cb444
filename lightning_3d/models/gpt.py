"""A small, honest GPT: pre-norm blocks, causal self-attention through ``scaled_dot_product_attention``, an MLP.

Initialization follows one rule that makes layout-independent init possible: every module that owns
parameters initializes exactly those (and nothing else) in ``reset_parameters()``, and calls it from its own
constructor. Built on the meta device, the model can then be initialized later, shard by shard, by replaying
``reset_parameters()`` in construction order with the same random stream (see ``lightning_3d.parallel.weight_init``),
and gets the weights an eager build with the same seed has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_3d.common import is_positive_int


@dataclass(kw_only=True)
class GPTConfig:
    """Sizes of a GPT. The defaults are a tiny model that learns the synthetic task in ~100 CPU steps."""

    vocab_size: int = 64
    """Number of token ids; a multiple of the tensor-parallel size keeps the vocabulary split even."""
    block_size: int = 32
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Transformer blocks; the pipeline splits them across stages."""
    n_head: int = 4
    """Attention heads; tensor parallelism splits them across ranks, so a multiple of tp."""
    n_embd: int = 64
    """Width of the residual stream; a multiple of n_head."""
    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio * n_embd (4 as in GPT-2)."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms."""
    init_std: float = 0.02
    """Standard deviation of the normal init of Linear and Embedding weights (GPT-2's 0.02)."""
    dropout: float = 0.0
    """Dropout on attention probabilities, on each block's residual branches and on the embeddings."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head});"
                f" try n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))}."
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_parameters(self) -> int:
        """Parameter count without building the model (for planning and logging)."""
        c, b = self, int(self.bias)
        hidden = c.mlp_ratio * c.n_embd
        attn = 4 * c.n_embd * c.n_embd + 3 * b * c.n_embd  # q, k, v, o; no key bias
        mlp = c.n_embd * hidden + b * hidden + hidden * c.n_embd + b * c.n_embd
        norms = 2 * (c.n_embd + b * c.n_embd)
        block = attn + mlp + norms
        embeddings = (c.vocab_size + c.block_size) * c.n_embd
        head = c.n_embd + b * c.n_embd + c.n_embd * c.vocab_size
        return embeddings + c.n_layer * block + head


class Linear(nn.Linear):
    """``nn.Linear`` with GPT-2's init: weight ~ N(0, std), bias = 0."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, std: float) -> None:
        self.std = std  # read by reset_parameters(), which nn.Linear's constructor calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` with GPT-2's init: weight ~ N(0, std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, std: float) -> None:
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        # Separate q/k/v projections so tensor parallelism can split each by heads with a plain column split.
        self.q_proj = Linear(c.n_embd, c.n_embd, bias=c.bias, std=c.init_std)
        # No key bias: softmax is shift-invariant, so q . b_k cancels out and the bias would never learn.
        self.k_proj = Linear(c.n_embd, c.n_embd, bias=False, std=c.init_std)
        self.v_proj = Linear(c.n_embd, c.n_embd, bias=c.bias, std=c.init_std)
        # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 * n_layer).
        self.o_proj = Linear(c.n_embd, c.n_embd, bias=c.bias, std=c.init_std / math.sqrt(2 * c.n_layer))
        self.head_dim = c.head_dim
        self.dropout = c.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        # The number of heads is read off the projection's output, so a tensor-parallel rank that holds
        # n_head / tp heads needs no attribute fix-up.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        hidden = c.mlp_ratio * c.n_embd
        self.up_proj = Linear(c.n_embd, hidden, bias=c.bias, std=c.init_std)
        self.act = nn.GELU(approximate="tanh")
        self.down_proj = Linear(hidden, c.n_embd, bias=c.bias, std=c.init_std / math.sqrt(2 * c.n_layer))

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn_dropout(self.attn(self.ln_1(x)))
        return x + self.mlp_dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Token ids ``(B, T)`` -> next-token logits ``(B, T, vocab_size)``.

    Pipeline-ready: its forward skips the modules a pipeline stage does not hold (set to None, blocks
    deleted from ``blocks``), the convention any model needs to run under ``pipeline_parallel_size > 1``.

    Example::

        model = GPT(GPTConfig(n_layer=2, n_embd=32))
        logits = model(torch.randint(0, 64, (4, 16)))  # (4, 16, 64)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = Embedding(config.vocab_size, config.n_embd, std=config.init_std)
        self.pos_emb = Embedding(config.block_size, config.n_embd, std=config.init_std)
        self.emb_dropout = nn.Dropout(config.dropout)
        # A dict keyed "0", "1", ... (FQNs "blocks.0", as with a list): a pipeline stage deletes the blocks
        # it does not run and the others keep their names.
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False, std=config.init_std)

    def forward(self, x: Tensor) -> Tensor:
        # Under pipeline parallelism a stage holds some of these modules (the rest are None) and gets the
        # previous stage's hidden states (B, T, C) instead of token ids (B, T).
        if self.tok_emb is not None:
            B, T = x.shape
            if T > self.config.block_size:
                raise ValueError(f"sequence length {T} exceeds GPTConfig.block_size={self.config.block_size}")
            pos = torch.arange(T, device=x.device)
            x = self.emb_dropout(self.tok_emb(x) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        return x
