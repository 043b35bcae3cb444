"""What the Hugging Face policies share: the model call a pipeline stage receives, and the masks it builds.

A Hugging Face model's forward runs every module it owns, so a pipeline stage (a copy of the model holding
some of them, ``lightning_3d.pipeline.split``) runs a ``Plan.stage_forward`` written for the model family
instead. Between stages travel the hidden states and, when the user passed one, the padding mask; each
stage rebuilds the position ids and its attention masks from them, as the model's own forward does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_3d.models.hf import require_transformers
from lightning_3d.pipeline.split import DroppedBlock
from lightning_3d.policies.base import PolicyError

CALL_ARGUMENTS = ("input_ids", "attention_mask")
"""The arguments of the model call a pipeline carries (``self.model(input_ids, attention_mask=...)``)."""


class StageInput(NamedTuple):
    input_ids: Tensor | None
    """On the first stage: the token ids of the user's call."""
    hidden: Tensor | None
    """On later stages: the previous stage's hidden states."""
    attention_mask: Tensor | None
    """The user's padding mask ``(batch, seq)``, 1 for tokens to attend to, or None."""


def stage_input(first: bool, args: tuple, kwargs: dict) -> StageInput:
    """Read a stage's inputs: the user's model call on the first stage, ``(hidden[, mask])`` elsewhere."""
    if not first:
        return StageInput(None, args[0], args[1] if len(args) > 1 else None)
    call = dict(zip(CALL_ARGUMENTS, args), **kwargs)
    unknown = sorted(set(call) - set(CALL_ARGUMENTS))
    if unknown or call.get("input_ids") is None:
        raise PolicyError(
            f"Under pipeline parallelism a Hugging Face model is called with input_ids and optionally"
            f" attention_mask; this call also passed {unknown or 'no input_ids'}. Compute the loss from"
            " .logits in training_step (not labels=), and leave caching off."
        )
    return StageInput(call["input_ids"], None, call.get("attention_mask"))


def stage_output(hidden: Tensor, attention_mask: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    """What a stage that is not the last sends on: the hidden states, and the padding mask if there is one."""
    return hidden if attention_mask is None else (hidden, attention_mask)


def held_layers(layers: Any) -> list[tuple[int, Any]]:
    """(index in the whole model, layer) of the decoder layers this stage holds."""
    return [(i, layer) for i, layer in enumerate(layers) if not isinstance(layer, DroppedBlock)]


def attention_masks(config: Any, batch: int, seq_len: int, like: Tensor, attention_mask: Tensor | None,
                    position_ids: Tensor) -> dict[str, Any]:
    """The masks the model's own forward builds: "full_attention" (causal), and "sliding_attention" when the
    config has a sliding window. None where the attention kernel applies causality itself."""
    masking = require_transformers().masking_utils
    # The mask builders read the batch size, sequence length, dtype and device of the embeddings only.
    embeds = torch.empty(batch, seq_len, 1, dtype=like.dtype, device=like.device)
    arguments = dict(config=config, inputs_embeds=embeds, attention_mask=attention_mask, cache=None,
                     position_ids=position_ids)
    masks = {"full_attention": masking.create_causal_mask(**arguments)}
    if getattr(config, "sliding_window", None) is not None:
        masks["sliding_attention"] = masking.create_sliding_window_causal_mask(**arguments)
    return masks


def layer_attention_type(config: Any, index: int) -> str:
    """Which mask layer ``index`` uses, as the model's forward chooses it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
