"""A LightningModule around a Hugging Face causal language model, written as for one device.

Needs the optional extra ``pip install -e .[hf]`` (``transformers``); nothing is downloaded: the model is
built from a config (sizes given here, or a local ``config.json``), and pretrained weights come in through
``ThreeDStrategy(init_from=DIRECTORY)``.
"""

from __future__ import annotations

from typing import Any, Union

from torch import Tensor

from lightning_3d.models.lit_gpt import NextTokenModule


def require_transformers() -> Any:
    """The ``transformers`` module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError("Hugging Face models need the optional extra: pip install -e '.[hf]'"
                          " (or pip install transformers)") from err
    return transformers


ConfigValue = Union[int, float, bool, str, list, dict, None]
"""A Hugging Face config value; typed so that ``--model.init_args.config.num_key_value_heads=4`` on the
command line gives the int 4, not the string "4"."""


def hf_config(model_type: str, sizes: dict | None = None, pretrained: str | None = None) -> Any:
    """The Hugging Face config: read from the local directory ``pretrained``, else built from the sizes."""
    transformers = require_transformers()
    if pretrained is not None:
        return transformers.AutoConfig.from_pretrained(pretrained, local_files_only=True)
    return transformers.AutoConfig.for_model(model_type, **(sizes or {}))


class HFCausalLMModule(NextTokenModule):
    """Trains ``AutoModelForCausalLM`` on next-token prediction with AdamW and a linear warm-up.

    ``config`` holds the model's sizes (``LlamaConfig`` / ``GPT2Config`` keyword arguments): the model is built
    in ``__init__`` with Hugging Face's random init, and the strategy broadcasts rank 0's weights
    (``model_init="exact"``). Or ``pretrained`` names a local directory with a ``config.json``: the model is
    built in ``configure_model()``, on the meta device under ``ThreeDStrategy``, and
    ``ThreeDStrategy(init_from=that directory)`` reads each rank's slices -- no rank holds the whole model.

    Example::

        module = HFCausalLMModule("llama", config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    """

    def __init__(self, model_type: str = "llama", config: dict[str, ConfigValue] | None = None, *, pretrained: str | None = None,
                 learning_rate: float = 3e-3, weight_decay: float = 0.0, warmup_steps: int = 10,
                 adam_eps: float = 1e-8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_config = hf_config(model_type, config, pretrained)
        self.model = None
        if pretrained is None:  # random weights: built now, on the host, as Hugging Face initializes them
            self.configure_model()

    def configure_model(self) -> None:
        # With pretrained weights this runs inside the strategy's meta-device context: no rank materializes
        # the whole model; ThreeDStrategy(init_from=...) fills each rank's slices.
        if self.model is None:
            self.model = require_transformers().AutoModelForCausalLM.from_config(self.model_config)

    def logits(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits
