"""The reference model: a GPT, its config, a LightningModule and a synthetic DataModule."""

from lightning_3d.models.data import SuccessorDataset, SyntheticDataModule
from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.models.lit_gpt import GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "SuccessorDataset", "SyntheticDataModule"]
