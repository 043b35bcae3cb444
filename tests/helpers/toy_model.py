"""A small non-GPT language model and a user-written policy for it: what a user of another model does.

The model differs from the reference GPT on purpose: other layer names, a head count kept as an attribute and
used to reshape (so tensor parallelism must fix it up), a ``Sequential`` feed-forward.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from lightning_3d.policies import Plan, PlanOptions, Policy, register_policy


class SelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.query, self.value, self.out = (nn.Linear(width, width) for _ in range(3))
        # No key bias: its gradient is zero in exact arithmetic (softmax is shift-invariant), so Adam would only
        # amplify rounding noise, which differs between layouts.
        self.key = nn.Linear(width, width, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        # Reshapes by the head-count attribute: under tp the policy must set it to heads per rank.
        q, k, v = (proj(x).view(B, T, self.num_heads, -1).transpose(1, 2) for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class Layer(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = SelfAttention(width, num_heads)
        self.feed_forward = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class ToyLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, num_heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Layer(width, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@register_policy("toy")
class ToyPolicy(Policy):
    """Megatron-style tensor parallel for ToyLM: the worked example of a user policy."""

    model_classes = (f"{ToyLM.__module__}.ToyLM",)

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        layers = [f"model.layers.{i}" for i in range(len(root.model.layers))]
        if options.tp == 1:
            return Plan(blocks=layers)
        replicated_input = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        tp_plan = {
            "model.layers.*.attention": replicated_input,
            "model.layers.*.attention.query": ColwiseParallel(),
            "model.layers.*.attention.key": ColwiseParallel(),
            "model.layers.*.attention.value": ColwiseParallel(),
            "model.layers.*.attention.out": RowwiseParallel(),
            "model.layers.*.feed_forward": replicated_input,
            "model.layers.*.feed_forward.0": ColwiseParallel(),
            "model.layers.*.feed_forward.2": RowwiseParallel(),
        }
        heads = {f"{layer}.attention": {"num_heads": root.model.layers[0].attention.num_heads // options.tp}
                 for layer in layers}
        return Plan(blocks=layers, tp_plan=tp_plan, attribute_fixes=heads)


class ToyLightningModule(L.LightningModule):
    def __init__(self, learning_rate: float = 1e-2, adam_eps: float = 1e-8, **_ignored) -> None:
        super().__init__()
        self.learning_rate, self.adam_eps = learning_rate, adam_eps
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = ToyLM()

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, eps=self.adam_eps)
