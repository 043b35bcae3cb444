"""A LightningModule written the ordinary Lightning way, with the idioms issue 17 lists, around the
independently written :class:`user_models.NanoGPT`; the trainer set-up that goes with it; and steps that
pipeline parallelism cannot run (each must fail at the first step, naming the pattern).

``run_conformance`` runs it with any strategy and returns what a user would look at: ``callback_metrics``
at the end of training, what a callback saw of the step's returned dict, the learning rate per step and the
checkpoint callback's best score.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from helpers.harness import SEED, ReferenceDataModule
from helpers.user_models import NanoGPT, NanoGPTModule, SkipNoneLM, SkipNonePolicy, user_llama
from lightning_3d.models import GPT, GPTConfig, SyntheticDataModule

CONFIG = dict(n_layer=4, n_embd=32, n_head=4, block_size=16)
GLOBAL_BATCH = 8
VAL_SAMPLES = 22  # batches of 8, 8 and 6 in one process (11 per rank at dp=2: 8 and 3)


class ConformanceModule(L.LightningModule):
    """The idioms around the model of one pipeline route (:data:`ROUTES`), built in ``configure_model()``."""

    def __init__(self, config, route: str = "as_written", mask_rate: float = 0.15, learning_rate: float = 0.05) -> None:
        super().__init__()
        self.config, self.route, self.mask_rate, self.learning_rate = config, route, mask_rate, learning_rate
        self.model = None
        self.train_acc = MulticlassAccuracy(num_classes=config.vocab_size)
        self.train_acc_micro = MulticlassAccuracy(num_classes=config.vocab_size, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=config.vocab_size)

    def configure_model(self):
        if self.model is None:
            self.model = ROUTES[self.route][0](self.config)

    def logits(self, tokens):
        output = self.model(tokens)
        return output.logits if hasattr(output, "logits") else output  # a Hugging Face model's output

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        if self.mask_rate:  # MLM-style masking: random draws before the model call
            tokens = tokens.masked_fill(torch.rand(tokens.shape) < self.mask_rate, 0)
        assert self.model.training  # attribute access on the model
        logits = self.logits(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        preds = logits.argmax(-1)
        self.train_acc(preds.flatten(), targets.flatten())
        self.train_acc_micro(preds.flatten(), targets.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("loss_over_epoch", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("tokens", float(tokens.numel()), reduce_fx="sum", on_step=True, on_epoch=True, sync_dist=True)
        self.log("logit_max", logits.detach().max(), reduce_fx="max", on_step=True, on_epoch=True, sync_dist=True)
        self.log("logit_min", logits.detach().min(), reduce_fx=torch.min, on_epoch=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_acc_micro", self.train_acc_micro, on_step=True, on_epoch=True)
        return {"loss": loss, "correct": (preds == targets).sum(), "preds": preds}

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self.logits(tokens)
        self.val_acc(logits.argmax(-1).flatten(), targets.flatten())
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1), targets.flatten()), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _sizes(config) -> tuple:
    return config.vocab_size, config.block_size, config.n_layer, config.n_embd, config.n_head


ROUTES = {
    "gpt": (GPT, "gpt"),                                               # the reference GPT and its policy
    "user_policy": (lambda c: SkipNoneLM(*_sizes(c)), SkipNonePolicy()),  # a user's policy naming pipeline_root
    "as_written": (lambda c: NanoGPT(*_sizes(c)), "auto"),             # nanoGPT, its forward run as written
    "hf": (user_llama, "auto"),                                        # transformers' Llama: policy "llama"
}
"""Pipeline route -> (config -> model, the policy that takes it there)."""


class StepOutputs(L.Callback):
    """What on_train_batch_end receives of the step's dict (summed over data-parallel ranks), and the lr."""

    def __init__(self) -> None:
        self.correct: list[int] = []
        self.preds_sum: list[int] = []
        self.lr: list[float] = []
        self.acc: list[list[float]] = []  # per batch: the step values of the two accuracies

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.acc.append([float(trainer.callback_metrics[k]) for k in ("train_acc_step", "train_acc_micro_step")])
        self.correct.append(int(trainer.strategy.reduce(outputs["correct"], reduce_op="sum")))
        assert outputs["preds"].shape == batch[1].shape, (outputs["preds"].shape, batch[1].shape)
        self.preds_sum.append(int(trainer.strategy.reduce(outputs["preds"].sum(), reduce_op="sum")))
        self.lr.append(trainer.optimizers[0].param_groups[0]["lr"])


class ValidationData(SyntheticDataModule):
    """Validation keeps its last, smaller batch (no drop_last)."""

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=False)


class ReferenceData(ReferenceDataModule, ValidationData):
    pass


def run_conformance(strategy, devices: int, dp: int, out_dir: Path, mask_rate: float, route: str = "as_written") -> dict:
    L.seed_everything(SEED, verbose=False)
    config = GPTConfig(**CONFIG)
    module = ConformanceModule(config, route=route, mask_rate=mask_rate)
    data_cls = ReferenceData if devices == 1 else ValidationData
    data = data_cls(vocab_size=config.vocab_size, seq_len=config.block_size, batch_size=GLOBAL_BATCH // dp,
                    num_val_samples=VAL_SAMPLES, seed=SEED)
    outputs = StepOutputs()
    checkpoint = ModelCheckpoint(dirpath=out_dir / "checkpoints", monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, accumulate_grad_batches=2,
        val_check_interval=3,  # after batches 3 and 6: the first inside an accumulation window
        gradient_clip_val=0.5, logger=CSVLogger(out_dir / "logs"), enable_progress_bar=False,
        enable_model_summary=False,  # Lightning's sanity check (2 batches) on, as a user's run has it
        callbacks=[outputs, checkpoint, EarlyStopping(monitor="val_loss", patience=10),
                   LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(module, data)
    return {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "correct": outputs.correct, "preds_sum": outputs.preds_sum, "lr": outputs.lr, "acc": outputs.acc,
        "best_val_loss": float(checkpoint.best_model_score), "global_step": trainer.global_step,
    }


# ---------------------------------------------------------------------------------------------- cannot run


class CallsModelTwice(NanoGPTModule):
    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self.model(tokens) + self.model(tokens.flip(1)).flip(1)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GathersInStep(NanoGPTModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.print(self.all_gather(loss.detach()))  # a world-wide collective after the model call
        return loss


UNSUPPORTED = {"model_called_twice": CallsModelTwice, "collective_in_step": GathersInStep}


def run_unsupported(name: str, strategy) -> dict:
    """Fit ``UNSUPPORTED[name]``; the error every rank raised and the optimizer steps taken before it."""
    L.seed_everything(SEED, verbose=False)
    config = GPTConfig(**CONFIG)
    module = UNSUPPORTED[name](config)
    data = SyntheticDataModule(vocab_size=config.vocab_size, seq_len=config.block_size, batch_size=GLOBAL_BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    try:
        trainer.fit(module, data)
    except Exception as err:  # noqa: BLE001 -- the test reads the type and message
        return {"error": f"{type(err).__name__}: {err}", "global_step": trainer.global_step,
                "batch": trainer.fit_loop.epoch_loop.batch_progress.total.ready}
    return {"error": None, "global_step": trainer.global_step}
