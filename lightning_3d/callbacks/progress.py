"""A Rich progress bar that counts optimizer steps towards ``max_steps``, the default of ``lightning-3d``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class StepsProgressBar(RichProgressBar):
    """Lightning's Rich bar, described as "Epoch 0, step 12/150" where a run is bounded by ``max_steps``.

    Lightning's says "Epoch 0/-2" there: it counts epochs out of ``max_epochs``, which Lightning sets to -1
    when only ``max_steps`` is given. The bar itself still counts the epoch's batches.

    Example::

        L.Trainer(callbacks=[StepsProgressBar()], max_steps=150)
    """

    # Lightning builds the description in this one private method (at epoch start and when the bar is made);
    # overriding it is the least code, and on_train_batch_end below refreshes it after every batch.
    @override
    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        description = f"Epoch {current_epoch}"
        if trainer.max_epochs is not None and trainer.max_epochs > 0:
            description += f"/{trainer.max_epochs - 1}"
        if trainer.max_steps > 0:  # -1: no step limit
            description += f", step {trainer.global_step}/{trainer.max_steps}"
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation" (no flicker)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.progress is not None and self.train_progress_bar_id is not None and not self.is_disabled:
            self.progress.update(self.train_progress_bar_id,
                                 description=self._get_train_description(trainer.current_epoch))
