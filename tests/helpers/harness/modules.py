"""The LightningModules a :class:`~helpers.harness.cases.Case` names (``Case.module``) and the data it trains on."""

from __future__ import annotations

import lightning as L
import torch

from helpers.harness.cases import ADAM_EPS, SEED, Case
from helpers.toy_model import ToyLightningModule
from helpers.user_models import (LlamaStyleModule, NanoGPTModule, PublishedGPTModule, ShortConvStoryLMModule, StoryLMModule,
                                 UserLlamaModule)
from lightning_3d.models import GPTConfig, GPTLightningModule, HFCausalLMModule, SyntheticDataModule


class EagerGPTModule(GPTLightningModule):
    """The reference module with its model built in ``__init__`` (the "exact" init path)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.configure_model()


class SelfCallingGPTModule(GPTLightningModule):
    """training_step goes through ``self(...)`` (LightningModule.forward), as many modules do."""

    def _loss(self, batch):
        tokens, targets = batch
        logits = self(tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ExplicitPipelineGPTModule(GPTLightningModule):
    """Uses the engine's explicit hook; its training_step calls the model twice (as no interception could
    follow), which the explicit hook never runs under a pipeline."""

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self.model(tokens)
        logits = logits + 0.0 * self.model(tokens)  # a second call, same value
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def pipeline_inputs(self, batch):
        return (batch[0],)

    def pipeline_loss(self, logits, batch):
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


class PaddedHFModule(HFCausalLMModule):
    """Passes a padding mask with the tokens: every other sequence ends in 3 padding positions."""

    def logits(self, tokens):
        mask = torch.ones_like(tokens)
        mask[::2, -3:] = 0
        return self.model(input_ids=tokens, attention_mask=mask).logits


class LabelsHFModule(HFCausalLMModule):
    """Lets the model compute its own loss, the Hugging Face way: ``self.model(input_ids=..., labels=...)``."""

    def _loss(self, batch):
        tokens, _ = batch
        return self.model(input_ids=tokens, labels=tokens).loss


class PaddedLabelsHFModule(HFCausalLMModule):
    """The model's own loss (``labels``) with a padding mask, which a mixture of experts' load-balancing loss
    follows: a sequence whose first token is even ends in 3 padding positions (chosen by its tokens, so the same
    sequences are padded wherever the sampler places them)."""

    def _loss(self, batch):
        tokens, _ = batch
        mask = torch.ones_like(tokens)
        mask[tokens[:, 0] % 2 == 0, -3:] = 0
        return self.model(input_ids=tokens, attention_mask=mask, labels=tokens).loss


class MicrobatchedHFModule(HFCausalLMModule):
    """Computes its logits on the batch in 2 halves, as a pipeline of 2 micro-batches does: one process with a
    pipeline's arithmetic, for models whose output depends on the batch it is computed in (a router's
    near-tie between two experts, decided by rounding that the batch's size changes)."""

    def logits(self, tokens):
        return torch.cat([self.model(input_ids=half).logits for half in tokens.chunk(2)])


MODULES = {"gpt": GPTLightningModule, "gpt_explicit_pipeline": ExplicitPipelineGPTModule, "gpt_eager": EagerGPTModule, "gpt_self": SelfCallingGPTModule,
           "toy": ToyLightningModule, "user_nanogpt": NanoGPTModule, "user_llama": UserLlamaModule,
           "user_llama_style": LlamaStyleModule, "user_published_gpt": PublishedGPTModule,
           "user_story_lm": StoryLMModule, "user_conv_lm": ShortConvStoryLMModule}


def module_and_data(case: Case, per_rank_batch: int, data_cls=SyntheticDataModule):
    """The case's LightningModule and its data (batches of ``per_rank_batch``), both from the seed."""
    L.seed_everything(SEED, verbose=False)
    if case.module.startswith("hf"):  # case.model: {"model_type": ..., "seq_len": ..., the HF config's sizes}
        sizes = dict(case.model)
        model_type, seq_len = sizes.pop("model_type"), sizes.pop("seq_len")
        cls = {"hf": HFCausalLMModule, "hf_padded": PaddedHFModule, "hf_labels": LabelsHFModule,
               "hf_labels_padded": PaddedLabelsHFModule, "hf_microbatched": MicrobatchedHFModule}[case.module]
        pretrained = sizes.pop("pretrained", None)  # a config.json directory: built in configure_model
        module = cls(model_type, sizes, pretrained=pretrained, learning_rate=case.learning_rate, warmup_steps=2,
                     adam_eps=ADAM_EPS)
        vocab_size = sizes["vocab_size"]
    else:
        config = GPTConfig(**case.model)
        module = MODULES[case.module](config=config, learning_rate=case.learning_rate, warmup_steps=2,
                                      adam_eps=ADAM_EPS)
        vocab_size, seq_len = config.vocab_size, config.block_size
    data = data_cls(vocab_size=vocab_size, seq_len=seq_len, batch_size=per_rank_batch, seed=SEED)
    return module, data
