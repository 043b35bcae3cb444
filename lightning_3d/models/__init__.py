"""The reference model: a GPT, its config, a LightningModule and a synthetic DataModule; a LightningModule for
Hugging Face causal language models."""

from lightning_3d.models.data import SuccessorDataset, SyntheticDataModule
from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.models.hf import HFCausalLMModule  # imports transformers only when built
from lightning_3d.models.lit_gpt import GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "HFCausalLMModule", "SuccessorDataset", "SyntheticDataModule"]
