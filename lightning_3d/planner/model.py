"""What the planner knows about a model: its sizes, and the parameters each piece holds.

A :class:`ModelSpec` is the decoder-only transformer the cost model reasons about: ``num_layers`` blocks of
attention + MLP between a token embedding and an output head. It comes from the reference GPT
(:meth:`ModelSpec.from_gpt_config`), a Hugging Face config (:meth:`ModelSpec.from_hf_config`) or plain sizes.
Parameters are counted per piece and split into what tensor parallelism divides over ``tp`` ranks and what
every tp rank keeps whole (norms, the biases of row-parallel layers, a learned position table), because that
is what one rank holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_3d.common import is_positive_int
from lightning_3d.errors import PlannerError


@dataclass(frozen=True)
class Params:
    """A parameter count split by how tensor parallelism treats it."""

    split: int
    """Divided over the tp ranks (column- or row-parallel matrices, column-parallel biases, the vocabulary)."""
    replicated: int
    """Kept whole on every tp rank (norms, row-parallel biases, the position table)."""

    def per_rank(self, tp: int) -> float:
        return self.split / tp + self.replicated

    @property
    def total(self) -> int:
        return self.split + self.replicated


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Sizes of a decoder-only transformer, as the planner needs them.

    Example::

        ModelSpec(num_layers=24, hidden_size=2304, num_heads=24, vocab_size=51200, seq_length=2048)
    """

    num_layers: int
    """Transformer blocks (what pipeline parallelism splits into stages)."""
    hidden_size: int
    """Width of the residual stream (h)."""
    num_heads: int
    """Attention heads (a); tensor parallelism splits them whole, so tp must divide it."""
    vocab_size: int
    """Token ids (V); the output head and the token embedding are split over tp along it."""
    seq_length: int
    """Tokens per sequence in training (s)."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: as many as num_heads."""
    ffn_hidden_size: int | None = None
    """MLP width (f); None: 4 * hidden_size."""
    gated_mlp: bool = False
    """SwiGLU-style MLP (gate, up and down matrices) as in Llama; False: up, activation, down as in GPT."""
    gelu_formula: bool = False
    """The MLP's GELU is written as its tanh formula in separate ops (transformers' ``gelu_new``, GPT-2's),
    which save three more (b, s, f) tensors than a fused activation: the tanh, half the input, 1 + the tanh."""
    bias: bool = True
    """Biases in the linear layers and norms."""
    key_bias: bool = True
    """A bias on the key projection (the reference GPT has none: softmax cancels it)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """LayerNorm (weight, bias; saves mean and 1/std) or RMSNorm (weight; saves 1/rms)."""
    norm_output_saved: bool = False
    """The norm saves its normalized output for the multiply by its weight, one more (b, s, h) tensor per norm:
    Hugging Face's RMSNorm, written as separate ops (configs with ``rms_norm_eps``). False: a fused kernel that
    saves its input and statistics only (``nn.LayerNorm``, Megatron-LM's fused norms)."""
    learned_positions: bool = True
    """A learned position table (max_positions x h, kept whole on every tp rank); False: rotary, no params."""
    max_positions: int | None = None
    """Rows of the learned position table; None: seq_length."""
    tied_embeddings: bool = False
    """The output head reuses the token embedding; under pipeline parallelism the first and last stage each
    hold a copy."""
    flash_attention: bool = True
    """Attention through a fused kernel that keeps no (s x s) score matrix (PyTorch's SDPA flash /
    memory-efficient kernels); False: scores, softmax and its dropout are saved (Korthikanti et al. 2022)."""
    dropout: float = 0.0
    """Dropout probability; above 0 each dropout keeps a 1-byte mask for backward."""
    fused_qkv: bool = True
    """q, k and v come from one matrix (Megatron-LM, GPT-2); False: three Linear modules (the reference GPT,
    Llama), whose common input autocast casts to bf16 once for each, so it is saved three times."""
    name: str = "model"

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"):
            _require_positive(field, getattr(self, field))
        for field in ("num_kv_heads", "ffn_hidden_size", "max_positions"):
            if getattr(self, field) is not None:
                _require_positive(field, getattr(self, field))
        if self.hidden_size % self.num_heads:
            raise PlannerError(
                f"num_heads ({self.num_heads}) does not divide hidden_size ({self.hidden_size}): every head has"
                f" hidden_size / num_heads dimensions. Use e.g. hidden_size="
                f"{self.num_heads * max(1, round(self.hidden_size / self.num_heads))}.")
        if self.num_heads % self.kv_heads:
            raise PlannerError(
                f"num_kv_heads ({self.kv_heads}) does not divide num_heads ({self.num_heads}): each key/value"
                " head serves a whole group of query heads.")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise PlannerError(f"norm={self.norm!r} is not supported; choose 'layernorm' or 'rmsnorm'.")
        if not 0.0 <= self.dropout < 1.0:
            raise PlannerError(f"dropout must be in [0, 1), got {self.dropout}.")
        if self.learned_positions and self.seq_length > self.positions:
            raise PlannerError(f"seq_length ({self.seq_length}) exceeds the position table's {self.positions}"
                               " rows (max_positions).")

    # ------------------------------------------------------------------------------------------- sizes

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output."""
        return self.kv_heads * self.head_dim

    @property
    def positions(self) -> int:
        return self.max_positions or self.seq_length

    # ------------------------------------------------------------------------------------- parameters

    def block_params(self) -> Params:
        """One transformer block. Column-parallel: q, k, v, up (and gate) with their biases; row-parallel: o,
        down, whose biases are added after the reduction and so kept whole, as are the norms."""
        h, f, kv, b = self.hidden_size, self.ffn, self.kv_size, int(self.bias)
        mlp_in = 2 if self.gated_mlp else 1
        split = (h * h + 2 * h * kv + h * h  # q, k, v, o
                 + b * (h + int(self.key_bias) * kv + kv)  # q, k, v biases
                 + mlp_in * (h * f + b * f) + f * h)  # up (and gate) with biases, down
        replicated = b * 2 * h + 2 * self._norm_params()  # o and down biases; two norms
        return Params(split, replicated)

    def embedding_params(self) -> Params:
        """What the first pipeline stage holds besides blocks: the token embedding (split over the vocabulary)
        and the learned position table (whole)."""
        return Params(self.vocab_size * self.hidden_size, self.positions * self.hidden_size * self.learned_positions)

    def head_params(self, pipeline_parallel_size: int = 1) -> Params:
        """What the last stage holds besides blocks: the final norm and the output projection (split over the
        vocabulary). Tied to the embedding, the projection adds nothing on one stage, and a copy with pp > 1."""
        own_matrix = not self.tied_embeddings or pipeline_parallel_size > 1
        return Params(self.vocab_size * self.hidden_size * own_matrix, self._norm_params())

    def num_parameters(self) -> int:
        """Distinct parameters of the whole model (a tied head counted once)."""
        return (self.num_layers * self.block_params().total + self.embedding_params().total
                + self.head_params().total)

    def _norm_params(self) -> int:
        return self.hidden_size * (1 + int(self.bias and self.norm == "layernorm"))

    # ---------------------------------------------------------------------------------- constructors

    @classmethod
    def from_gpt_config(cls, config: Any, *, seq_length: int | None = None) -> "ModelSpec":
        """The reference GPT (``lightning_3d.models.GPTConfig``); ``seq_length`` defaults to its block_size.

        Example::

            ModelSpec.from_gpt_config(GPTConfig(n_layer=4, n_embd=64, n_head=4))
        """
        return cls(name="gpt", num_layers=config.n_layer, hidden_size=config.n_embd, num_heads=config.n_head,
                   vocab_size=config.vocab_size, seq_length=seq_length or config.block_size,
                   max_positions=config.block_size, ffn_hidden_size=config.mlp_ratio * config.n_embd,
                   bias=config.bias, key_bias=False, dropout=config.dropout, fused_qkv=False)

    @classmethod
    def from_hf_config(cls, config: Any, *, seq_length: int | None = None) -> "ModelSpec":
        """A Hugging Face ``PretrainedConfig``, a ``config.json`` dict, or a local directory / file holding one
        (Llama/Mistral/Qwen-style gated models and GPT-2-style ones). Needs ``transformers`` only for a
        directory that is not a plain ``config.json``."""
        values = _hf_values(config)
        get = lambda *names, default=None: next((values[n] for n in names if values.get(n) is not None), default)  # noqa: E731
        model_type = values.get("model_type", "")
        gpt2_like = model_type in ("gpt2", "gpt_neo", "gptj", "gpt_bigcode")
        hidden = get("hidden_size", "n_embd", "d_model")
        positions = get("max_position_embeddings", "n_positions", "n_ctx")
        if hidden is None or get("num_hidden_layers", "n_layer") is None:
            raise PlannerError(f"Hugging Face config of type {model_type!r} names no hidden size / layer count"
                               " the planner knows; give the sizes directly (layers, hidden, heads, ...).")
        return cls(
            name=values.get("_name_or_path") or model_type or "hf",
            num_layers=get("num_hidden_layers", "n_layer"), hidden_size=hidden,
            num_heads=get("num_attention_heads", "n_head"), num_kv_heads=get("num_key_value_heads"),
            ffn_hidden_size=get("intermediate_size", "n_inner", default=4 * hidden),
            vocab_size=get("vocab_size"), seq_length=seq_length or positions, max_positions=positions,
            gated_mlp=not gpt2_like, bias=gpt2_like or bool(get("attention_bias", default=False)),
            norm="layernorm" if gpt2_like else "rmsnorm", norm_output_saved="rms_norm_eps" in values,
            learned_positions=gpt2_like,
            tied_embeddings=bool(get("tie_word_embeddings", default=gpt2_like)),
            dropout=float(get("attention_dropout", "attn_pdrop", default=0.0)), fused_qkv=gpt2_like,
            gelu_formula=get("activation_function", "hidden_act") == "gelu_new")


def _hf_values(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    path = Path(config)
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:
        from transformers import AutoConfig  # optional extra "hf"
    except ImportError as err:
        raise PlannerError(f"{config!r} is not a config.json file or a directory holding one, and without"
                           " `transformers` (pip install lightning-3d[hf]) no other source can be read.") from err
    return AutoConfig.from_pretrained(str(config), local_files_only=True).to_dict()


def _require_positive(name: str, value: Any) -> None:
    if not is_positive_int(value):
        raise PlannerError(f"{name} must be a positive integer, got {value!r}.")


def model_spec(module: Any, seq_length: int | None = None) -> ModelSpec | None:
    """The planner's description of ``module``'s model: the reference GPT or a Hugging Face model; else None."""
    from lightning_3d.models import GPTConfig

    config = getattr(module, "config", None)
    if isinstance(config, GPTConfig):
        return ModelSpec.from_gpt_config(config, seq_length=seq_length)
    hf = getattr(module, "model_config", None) or getattr(getattr(module, "model", None), "config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        try:
            return ModelSpec.from_hf_config(hf, seq_length=seq_length)
        except PlannerError:
            return None
    return None
