"""Models written the way users write them, not the way our policies expect: the parity harness runs them as
``Case(module="user_nanogpt")`` / ``"user_llama"``.

* :class:`NanoGPT` follows nanoGPT: blocks in an ``nn.ModuleList``, the token embedding tied to the head, and
  its init in the parent -- ``self.apply(self._init_weights)`` re-draws every Linear and Embedding with std
  0.02, then the residual projections get std 0.02 / sqrt(2 * n_layer). Replaying ``reset_parameters()``
  would give other weights (PyTorch's default Linear init).
* :class:`PublishedGPT` is written the way nanoGPT's own ``model.py`` is: one fused ``c_attn`` (q|k|v), the
  sizes read back from the input (``B, T, C = x.size()``, then ``view(B, T, C)``), the layers in a
  ``ModuleDict``, and ``forward(idx, targets)`` that returns ``(logits, loss)``.
* :class:`UserLlamaModule` builds ``transformers.LlamaForCausalLM(config)`` in ``configure_model()``, the
  ordinary Lightning way: Hugging Face initializes it in ``post_init()``, not in ``reset_parameters()``.
* :class:`LlamaStyleLM` follows Meta's reference Llama: blocks called with a mask, RMSNorm weights made by
  ``torch.ones`` (no ``reset_parameters()``), untied head.
* :class:`StoryLM` is a small language model as tutorials write one, with nothing of GPT's names: pre-norm
  blocks in an ``nn.ModuleList``, its own init in the parent (``self.apply``: N(0, 0.02) weights, zero biases,
  the residual outputs scaled down by sqrt(2 * layers)), learned positions, a SiLU MLP three times the width, an
  untied head; ``"user_conv_lm"`` mixes tokens with a gated short convolution (an ``nn.Conv1d`` of one filter per
  channel) instead of attention.
* :class:`SkipNoneLM` is the exception: written with its own policy (:class:`SkipNonePolicy`) that names
  ``pipeline_root``, ``before`` and ``after``, its forward skipping the modules a stage does not hold.

None of the others is written for lightning_3d: under pipeline parallelism ``policy="auto"`` runs their forward as
written.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.policies import Plan, PlanOptions, Policy
from lightning_3d.policies.base import find_submodule


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.n_head, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled residual projections (GPT-2)
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class FusedSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class PublishedBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), FusedSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class PublishedGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(0.0),
            h=nn.ModuleList([PublishedBlock(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class _NextTokenModule(L.LightningModule):
    """The training step, loss and optimizer a user writes; subclasses build ``self.model``."""

    def __init__(self, config, learning_rate: float = 1e-2, **_ignored) -> None:
        super().__init__()
        self.config = config  # the harness's GPTConfig: sizes only
        self.learning_rate = learning_rate
        self.model = None

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.logits(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # SGD with momentum, not Adam: Adam divides each gradient by its own size, so a weight whose gradient is
        # rounding noise (~1e-9) moves by a full learning rate in a direction that rounding picks, and no
        # tolerance is both tight and safe on every CPU. With SGD a parameter differs from one process's by
        # about lr x steps x the gradient's rounding error: 1e-5 holds with margin.
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)


class NanoGPTModule(_NextTokenModule):
    def configure_model(self):
        if self.model is None:
            c = self.config
            self.model = NanoGPT(c.vocab_size, c.block_size, c.n_layer, c.n_embd, c.n_head)

    def logits(self, tokens):
        return self.model(tokens)


class PublishedGPTModule(_NextTokenModule):
    def configure_model(self):
        if self.model is None:
            c = self.config
            self.model = PublishedGPT(c.vocab_size, c.block_size, c.n_layer, c.n_embd, c.n_head)

    def logits(self, tokens):
        return self.model(tokens)[0]


def user_llama(config) -> nn.Module:
    """``transformers.LlamaForCausalLM`` built from its config, in the harness's sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=2 * c.n_embd,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head // 2,
        max_position_embeddings=c.block_size))


class UserLlamaModule(_NextTokenModule):
    def configure_model(self):
        if self.model is None:
            self.model = user_llama(self.config)

    def logits(self, tokens):
        return self.model(input_ids=tokens).logits


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, mask):
        h = x + self.attention(self.attention_norm(x), mask)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class LlamaStyleLM(nn.Module):
    """Meta's reference Llama layout (tok_embeddings, layers, norm, output), untied, its blocks called with a
    mask the forward builds from the causal structure and the caller's padding mask."""

    def __init__(self, vocab_size: int, n_layer: int, dim: int, n_heads: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(n_layer))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens, padding_mask):
        T = tokens.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        mask = causal & padding_mask.bool()[:, None, None, :]  # (B, 1, T, T): attend to earlier, unpadded
        mask = mask | torch.eye(T, dtype=torch.bool, device=tokens.device)  # a padded row still sees itself
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask)
        return self.output(self.norm(h))


class LlamaStyleModule(_NextTokenModule):
    """Calls the model with a padding mask: every other sequence ends in 3 padding positions."""

    def configure_model(self):
        if self.model is None:
            c = self.config
            self.model = LlamaStyleLM(c.vocab_size, c.n_layer, c.n_embd, c.n_head)

    def logits(self, tokens):
        padding_mask = torch.ones_like(tokens)
        padding_mask[::2, -3:] = 0
        return self.model(tokens, padding_mask)


class StoryAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head size)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class StoryShortConvolution(nn.Module):
    """A gated short convolution in place of attention (as LFM2 mixes tokens): ``in_proj`` -> b, c, h; a causal
    depthwise ``nn.Conv1d`` over b * h, called as a module; c gates its output."""

    def __init__(self, dim: int, heads: int, kernel: int = 3) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        y = self.conv((b * h).transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        return self.out(c * y)


class StoryBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mixer: type[nn.Module] = StoryAttention) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), mixer(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 3 * dim), nn.Linear(3 * dim, dim)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.down(F.silu(self.up(self.mlp_norm(x)))))


class StoryLM(nn.Module):
    def __init__(self, vocab_size: int, context: int, layers: int, dim: int, heads: int,
                 mixer: type[nn.Module] = StoryAttention) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab_size, dim), nn.Embedding(context, dim)
        self.layers = nn.ModuleList(StoryBlock(dim, heads, mixer) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.unembed = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init)
        for block in self.layers:  # each residual branch's output, so the stream's variance stays put with depth
            nn.init.normal_(block.attention.out.weight, std=0.02 / math.sqrt(2 * layers))
            nn.init.normal_(block.down.weight, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers:
            x = block(x)
        return self.unembed(self.norm(x))


class StoryLMModule(_NextTokenModule):
    mixer: type[nn.Module] = StoryAttention

    def configure_model(self):
        if self.model is None:
            c = self.config
            self.model = StoryLM(c.vocab_size, c.block_size, c.n_layer, c.n_embd, c.n_head, self.mixer)

    def logits(self, tokens):
        return self.model(tokens)


class ShortConvStoryLMModule(StoryLMModule):
    """:class:`StoryLM` with a gated short convolution in each block instead of attention."""

    mixer = StoryShortConvolution


class SkipNoneLM(nn.Module):
    """Written for a policy of its user's (:class:`SkipNonePolicy`), the pipeline route before models ran as
    written: its forward skips the modules a pipeline stage does not hold (None, or a block missing from
    ``blocks``). Plain ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` init, so it builds on the meta
    device and its init is replayed."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(n_embd, n_head) for i in range(n_layer)})
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x):
        if self.wte is not None:  # (B, T) token ids on the first stage, (B, T, C) hidden states elsewhere
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return x if self.lm_head is None else self.lm_head(self.ln_f(x))


class SkipNonePolicy(Policy):
    """A user's policy for :class:`SkipNoneLM`: blocks, the pipeline root and what runs before and after them."""

    model_classes = (f"{__name__}.SkipNoneLM",)

    def plan(self, root, options=PlanOptions()):
        prefix = find_submodule(root, self.model_classes)
        model = root.get_submodule(prefix)
        return Plan(blocks=[f"{prefix}.blocks.{name}" for name in model.blocks], pipeline_root=prefix,
                    before=[f"{prefix}.wte", f"{prefix}.wpe"], after=[f"{prefix}.ln_f", f"{prefix}.lm_head"])
