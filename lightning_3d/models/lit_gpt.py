"""The reference LightningModule: a GPT trained on next-token prediction, written as for one device."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_3d.models.gpt import GPT, GPTConfig


class NextTokenModule(L.LightningModule):
    """Next-token prediction, written as for one device: the cross-entropy of :meth:`logits` against the
    targets, logged as ``train_loss`` / ``val_loss``; AdamW (``adam_eps``: the gradient size below which its
    update turns linear in the gradient) with a linear warm-up over ``warmup_steps``.
    Subclasses build ``self.model`` and say how it gives logits."""

    def logits(self, tokens: Tensor) -> Tensor:
        """(B, T) token ids -> (B, T, vocab_size) logits, through one call of ``self.model``."""
        raise NotImplementedError

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        return F.cross_entropy(self.logits(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        h = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=h.learning_rate, weight_decay=h.weight_decay,
                                      eps=h.adam_eps)
        warmup = max(1, h.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class GPTLightningModule(NextTokenModule):
    """Trains :class:`GPT` with AdamW and a linear warm-up. The model is built in ``configure_model()``, so
    ``ThreeDStrategy`` builds it on the meta device and materializes only this rank's part.

    Example::

        module = GPTLightningModule(config=GPTConfig(n_layer=2), learning_rate=3e-3)
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        *,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
        adam_eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = config or GPTConfig()
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is None:  # Lightning calls this hook once per fit/validate/test; build once
            self.model = GPT(self.config)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def logits(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)
