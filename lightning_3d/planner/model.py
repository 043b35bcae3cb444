"""What the planner knows about a model: its sizes, and the parameters each piece holds.

A :class:`ModelSpec` is the decoder-only transformer the cost model reasons about: ``num_layers`` blocks of
attention + MLP between a token embedding and an output head. It comes from the reference GPT
(:meth:`ModelSpec.from_gpt_config`), a Hugging Face config (:meth:`ModelSpec.from_hf_config`), plain sizes, or
measurements of any other model whose blocks the policy finds (:class:`MeasuredCosts`,
:meth:`ModelSpec.from_measured`).
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

    def __add__(self, other: "Params") -> "Params":
        return Params(self.split + other.split, self.replicated + other.replicated)


@dataclass(frozen=True, kw_only=True)
class MeasuredCosts:
    """A model's costs as measured on the model itself, for a model no config describes (a user's own, whose
    blocks the policy finds): at launch, on fake tensors, nothing allocated (``strategies/measure_model.py``).
    Per piece the pipeline places: the blocks, what the first stage holds besides them (the embedding) and what
    the last stage holds (the final norm and the output head).

    What a measurement cannot give is taken as follows: the blocks are alike (the mean block); activations
    scale with the micro-batch's sequences; under sequence parallelism a block's activations count as without
    it (an upper bound: sequence parallelism only divides what tensor parallelism leaves whole)."""

    block: Params
    """One block's parameters (the mean over the blocks), split over tp where the policy's plan splits them
    (column- and row-parallel weights, column-parallel biases)."""
    embedding: Params
    """The first stage's parameters besides its blocks: the modules the policy places before the blocks, and any
    the pipeline places nowhere else."""
    head: Params
    """The last stage's parameters besides its blocks, less those tied to the embedding's."""
    tied_head: Params
    """The last stage's parameters that are the embedding's too (a tied output head): counted once on one
    stage, and as a copy on the last stage when pp > 1 (``ModelSpec.head_params``)."""
    tp_sizes: tuple[int, ...]
    """The tensor-parallel sizes the policy's plan splits the model by (1 included): what a layout may take."""
    block_flops_per_token: float
    """Forward FLOPs of one block per token, at the measured sequence length (2 per multiply-add; attention's
    two products counted whole, as ``planner.time`` counts them)."""
    head_flops_per_token: float
    """Forward FLOPs outside the blocks per token: embedding, final norm, output head (not the loss)."""
    block_whole_bytes_per_sequence: float
    """Bytes one block saves for backward per sequence that every tp rank keeps whole (the residual stream,
    norm inputs and outputs, what enters a column-parallel layer), in the precision measured."""
    block_split_bytes_per_sequence: float
    """Bytes one block saves per sequence that tensor parallelism divides over its ranks: what is computed from
    a column-parallel layer's output up to a row-parallel layer's input."""
    first_stage_bytes_per_sequence: float
    """Bytes saved per sequence before the first block (token ids, positions, the embedding's)."""
    last_stage_bytes_per_sequence: float
    """Bytes saved per sequence after the last block, up to the model's output (the final norm, the head's
    input); the loss's are the planner's (``memory.loss_activation_bytes``)."""
    precision: str
    """The precision the bytes were measured in (``planner.memory.PRECISIONS``)."""

    def block_bytes(self, sequences: int, tp: int) -> float:
        """Bytes one block saves for backward on one tp rank for a micro-batch of ``sequences``."""
        return sequences * (self.block_whole_bytes_per_sequence + self.block_split_bytes_per_sequence / tp)


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
    num_experts: int = 0
    """Routed experts of each block's mixture-of-experts MLP (every block's); 0: a dense MLP."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    expert_ffn_size: int | None = None
    """One expert's MLP width; None: ``ffn``."""
    shared_expert_ffn_size: int = 0
    """Width of the MLP every token also runs beside the routed experts (shared experts together); 0: none."""
    name: str = "model"
    measured: MeasuredCosts | None = None
    """Costs measured on the model itself (:class:`MeasuredCosts`), for a model no config describes: its
    parameters, FLOPs and saved tensors come from them instead of the formulas, and its tp sizes from
    ``measured.tp_sizes`` (``num_heads`` is then 1)."""

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
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise PlannerError(f"experts_per_token must be between 1 and num_experts ({self.num_experts}), got"
                               f" {self.experts_per_token}.")
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
    def active_ffn(self) -> int:
        """The MLP width one token runs through: ``ffn``; with experts, its experts' and the shared MLP's."""
        if not self.num_experts:
            return self.ffn
        return self.experts_per_token * (self.expert_ffn_size or self.ffn) + self.shared_expert_ffn_size

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

    def splits_over(self, tp: int) -> bool:
        """Whether tensor parallelism over ``tp`` ranks splits this model: tp divides the heads, the kv heads
        and the vocabulary; for a measured model, tp is one its policy's plan splits it by."""
        if self.measured is not None:
            return tp in self.measured.tp_sizes
        return not (self.num_heads % tp or self.kv_heads % tp or self.vocab_size % tp)

    @property
    def tp_rule(self) -> str:
        """What :meth:`splits_over` asks of tp, with this model's numbers (for error messages)."""
        if self.measured is not None:
            sizes = ", ".join(map(str, self.measured.tp_sizes))
            return f"tp must be a size the policy's plan splits the model by ({sizes})"
        return (f"tp must divide num_heads ({self.num_heads}), num_kv_heads ({self.kv_heads}) and vocab_size"
                f" ({self.vocab_size})")

    # ------------------------------------------------------------------------------------- parameters

    def block_params(self) -> Params:
        """One transformer block. Column-parallel: q, k, v, up (and gate) with their biases; row-parallel: o,
        down, whose biases are added after the reduction and so kept whole, as are the norms. With experts: the
        router (whole), the shared MLP and every expert (:meth:`expert_params`), each expert split over tp by its
        features as an MLP is."""
        if self.measured is not None:
            return self.measured.block
        h, kv, b = self.hidden_size, self.kv_size, int(self.bias)
        split = (h * h + 2 * h * kv + h * h  # q, k, v, o
                 + b * (h + int(self.key_bias) * kv + kv))  # q, k, v biases
        replicated = b * h + 2 * self._norm_params()  # o's bias; two norms
        if not self.num_experts:
            return Params(split + self._mlp_split(self.ffn), replicated + b * h)  # (down's bias)
        router = h * self.num_experts
        shared = self._mlp_split(self.shared_expert_ffn_size) if self.shared_expert_ffn_size else 0
        return Params(split + shared, replicated + router) + self.expert_params()

    def expert_params(self) -> Params:
        """The routed experts of one block, all of them (0 for a dense model): what expert parallelism splits
        over its ep ranks."""
        if self.measured is not None or not self.num_experts:
            return Params(0, 0)
        return Params(self.num_experts * self._mlp_split(self.expert_ffn_size or self.ffn), 0)

    def active_block_params(self) -> int:
        """One block's parameters a token's forward multiplies by: the experts it is routed to, not all."""
        block, experts = self.block_params(), self.expert_params()
        if not self.num_experts:
            return block.total
        return block.total - experts.total + experts.total * self.experts_per_token // self.num_experts

    def active_parameters(self) -> int:
        """Parameters one token's forward uses (as :meth:`num_parameters`, with only its experts): what a
        mixture of experts' "active" size counts."""
        return (self.num_layers * self.active_block_params() + self.embedding_params().total
                + self.head_params().total)

    def splits_experts_over(self, ep: int) -> bool:
        """Whether expert parallelism over ``ep`` ranks can split every block's experts: ep divides them."""
        return ep == 1 or bool(self.num_experts) and self.num_experts % ep == 0

    def _mlp_split(self, width: int) -> int:
        """An MLP of ``width`` features: up (and gate) with their biases, down (split over tp)."""
        h, b = self.hidden_size, int(self.bias)
        return (2 if self.gated_mlp else 1) * (h * width + b * width) + width * h

    def embedding_params(self) -> Params:
        """What the first pipeline stage holds besides blocks: the token embedding (split over the vocabulary)
        and the learned position table (whole)."""
        if self.measured is not None:
            return self.measured.embedding
        return Params(self.vocab_size * self.hidden_size, self.positions * self.hidden_size * self.learned_positions)

    def head_params(self, pipeline_parallel_size: int = 1) -> Params:
        """What the last stage holds besides blocks: the final norm and the output projection (split over the
        vocabulary). Tied to the embedding, the projection adds nothing on one stage, and a copy with pp > 1."""
        if self.measured is not None:
            tied = self.measured.tied_head if pipeline_parallel_size > 1 else Params(0, 0)
            return self.measured.head + tied
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
    def from_measured(cls, costs: MeasuredCosts, *, num_layers: int, hidden_size: int, vocab_size: int,
                      seq_length: int, dropout: float = 0.0, name: str = "model") -> "ModelSpec":
        """A model described by its measured ``costs``, with its sizes where the planner reads sizes: the blocks
        a pipeline splits, the residual width its stages send, the vocabulary its head and loss span, the
        sequence. One head stands for the attention's: its tp sizes are ``costs.tp_sizes``
        (:meth:`splits_over`), not a head count's divisors."""
        return cls(name=name, num_layers=num_layers, hidden_size=hidden_size, num_heads=1, vocab_size=vocab_size,
                   seq_length=seq_length, learned_positions=False, dropout=dropout, measured=costs)

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
        experts = get("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", default=0)
        expert_ffn = get("moe_intermediate_size") if experts else None
        shared = get("shared_expert_intermediate_size", default=0) if experts else 0
        if experts and not shared and get("n_shared_experts"):
            shared = get("n_shared_experts") * (expert_ffn or get("intermediate_size"))
        return cls(
            name=values.get("_name_or_path") or model_type or "hf",
            num_experts=experts, experts_per_token=get("num_experts_per_tok", "moe_topk", default=0) if experts else 0,
            expert_ffn_size=expert_ffn, shared_expert_ffn_size=shared,
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
    """The planner's description of ``module``'s model from its config: the reference GPT (a
    ``lightning_3d.models.GPT`` inside ``module``) or a Hugging Face model; else None (the strategy then
    measures the model, ``strategies/measure_model.py``). A ``GPTConfig`` held by a module whose model is
    not the reference GPT describes nothing: its sizes may be the user's, its architecture is not."""
    from lightning_3d.models import GPT

    gpt = next((m for m in module.modules() if isinstance(m, GPT)), None) if hasattr(module, "modules") else None
    if gpt is not None:
        return ModelSpec.from_gpt_config(gpt.config, seq_length=seq_length)
    hf = getattr(module, "model_config", None) or getattr(getattr(module, "model", None), "config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        try:
            return ModelSpec.from_hf_config(hf, seq_length=seq_length)
        except PlannerError:
            return None
    return None
