"""Which causal LMs are in the census, and the tiny config each is built from.

The census takes every model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that is a decoder-only
language model (:func:`not_decoder_only` says why the others are not) and builds it from its own config class
with the sizes of ``TINY`` set wherever the class has the field, configured the way users set a model up for
training: ``use_cache=False``, every dropout 0, eager attention, grouped key/value heads (2 query heads per
kv head) wherever the config has a kv-head count, the model's own default for tied embeddings. ``OVERRIDES``
holds what single models need beyond that, each with its reason.
"""

from __future__ import annotations

import functools

SEQ_LEN = 16
VOCAB = 64
WIDTH = 32
DEPTH = 4
"""Blocks per model: 2 per stage at pp=2."""
HEADS = 4
KV_HEADS = 2
"""Grouped-query attention, 2 query heads per kv head: at tp=2 each rank keeps one kv head and its 2 query heads."""
HEAD_DIM = WIDTH // HEADS
FFN = 2 * WIDTH
EXPERT_FFN = WIDTH
MAX_PARAMETERS = 2_000_000
"""The tiny models have 30k-300k parameters; above this, some size of the model's config is not in ``TINY``
(and the model would be slow, or too large to build at all)."""

TINY = {
    # width, depth, heads: heads and kv heads divisible by tp=2
    ("hidden_size", "n_embd", "d_model", "embedding_size", "hidden_size_global"): WIDTH,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"): DEPTH,
    ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "swa_num_attention_heads",
     "linear_num_heads"): HEADS,
    ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads"): KV_HEADS,
    ("head_dim", "attention_head_dim", "kv_channels", "v_head_dim", "qk_head_dim", "dim_head", "swa_head_dim",
     "global_head_dim", "linear_head_dim"): HEAD_DIM,
    ("intermediate_size", "ffn_dim", "n_inner", "d_inner", "dim_ff", "dff", "decoder_ffn_dim", "ffn_hidden_size",
     "intermediate_size_mlp", "dense_intermediate_size", "first_dense_intermediate_size",
     "mlp_only_intermediate_size"): FFN,
    # mixture of experts: a few small experts, two routed per token, in one group (4 experts make no 8 groups)
    ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size"): EXPERT_FFN,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k"): 2,
    ("n_group", "num_expert_group", "topk_group"): 1,
    # multi-head latent attention (DeepSeek): low-rank projections, each head a rotary and a plain part
    ("qk_rope_head_dim", "qk_nope_head_dim"): HEAD_DIM // 2,
    ("kv_lora_rank", "q_lora_rank", "o_lora_rank"): 2 * HEAD_DIM,
    # linear attention and state-space layers (hybrids, Mamba): state-space heads x head size = 2 x width
    ("linear_key_head_dim", "linear_value_head_dim", "mamba_head_dim", "mamba_d_head", "mamba_headdim"): HEAD_DIM,
    ("linear_num_key_heads", "linear_num_value_heads"): HEADS,
    ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"): 2 * WIDTH // HEAD_DIM,
    ("mamba_d_ssm",): 2 * WIDTH,
    ("mamba_d_state", "state_size", "ssm_state_size"): HEAD_DIM,
    ("time_step_rank", "mamba_dt_rank"): HEAD_DIM // 2,
    ("chunk_size", "mamba_chunk_size"): SEQ_LEN,
    # a sparse-attention indexer (DeepSeek V3.2, GLM MoE DSA)
    ("index_n_heads", "index_num_heads"): 2,
    ("index_head_dim",): HEAD_DIM,
    ("index_topk",): SEQ_LEN,
    ("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input", "encoder_hash_byte_group_vocab"): VOCAB,
    ("hidden_size_per_layer_input",): HEAD_DIM,  # Gemma's per-layer embeddings
    ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"): 4 * SEQ_LEN,
}
"""The tiny sizes, each set where the model's config has the field, to a number or from None (a size the
config derives, e.g. ``head_dim``), except the fields of ``OFF_WHEN_NONE``."""

RANDOM_FIELDS = ("dropout", "pdrop", "layerdrop", "jitter")
"""Words in the names of a config's probabilities and noise scales, all set to 0.0: one process and a layout
draw different random numbers (PhiMoE's router jitter is 0.01 by default)."""

OFF_WHEN_NONE = {"q_lora_rank", "num_experts", "moe_intermediate_size", "n_group", "topk_group"}
"""Size fields whose None turns a feature off (a full-rank query, a dense MLP, ungrouped routing): left None."""

OVERRIDES: dict[str, dict] = {
    "bert-generation": dict(is_decoder=True),  # causal attention, as transformers asks for its use as a decoder
    "dots3_note_text": dict(head_dim=2 * (HEAD_DIM // 2)),  # its sliding-window heads: rotary + plain part
    "dots1": dict(n_shared_experts=1),  # its default None fails the build; DeepSeek-style, one shared expert
    # Its sigmoid router's scores sit near 0.5 at the default init: at step 3 of the census data two experts'
    # scores were 6e-8 apart, which a tp sum's order decides (measured in one process); at 0.1 the closest
    # pair in 3 steps is 3e-5 apart.
    "exaone_moe": dict(initializer_range=0.1),
    # Its config's init_std is 1.0 (every weight N(0, 1)): the attention's softmax saturates and one process
    # in float32 is 7e-3 from float64 on the weights after the 3 steps (4e-4 on the loss), so no layout could
    # be held to 1e-4; at 0.1 the two are 1.4e-7 apart. Its position bias table stays distinct per head.
    "cpmant": dict(init_std=0.1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]]),  # alternating layers, 2 pairs = 4 blocks
    # identity ("zero") experts beside the 4 routed ones, half as many as the default's 256 beside 512: the
    # default's 256 would make the router a fifth of the tiny block (on LongCat-Flash itself it is 0.5%)
    "longcat_flash": dict(zero_expert_num=2),
    "mamba2": dict(num_heads=8),  # heads x head size = expansion (2) x width; `num_heads` is not attention's
    # layer ids within 4 blocks; its key/value rounding works on heads of a multiple of 16
    "kolibri1_1": dict(head_dim=16, index_layers=[3], kv_source_layers=[0, 1, 2, 3]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),  # None fails the build
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),  # its default: attention only
    # the sparse-attention indexer's sizes default to None, which fails the build
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                           indexer_compress_ratio=2),
    # attention runs on the hidden states and the embeddings side by side; two hybrid layers share weights
    # the only routing it supports; its router's width as ZAYA1's is to its hidden size (256 of 2048): the
    # default 256, 8 times the tiny width, would make the router (whole on every rank) 90% of the block
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=WIDTH // 8),
    # the last 2 layers reuse the keys and values of earlier ones: a producer of each kind before them
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2),
    # the audio encoder's convolutions have widths of their own
    "phi4_multimodal": dict(audio_config=dict(nemo_conv_channels=WIDTH, ext_pw_out_channel=WIDTH,
                                              depthwise_separable_out_channel=WIDTH)),
    # µP multipliers as trained models set them (Falcon-H1's config defaults are all 1): distinct per part of
    # in_proj's [z | x | B | C | dt], so a split that takes another rank's multipliers shows
    "falcon_h1": dict(ssm_multipliers=[0.35, 0.25, 0.5, 0.7, 0.18], mlp_multipliers=[0.6, 0.4],
                      attention_in_multiplier=0.9, key_multiplier=0.8),
    # its relative-bias bank of profiles (d_rel x rel_extent, or x sliding_window_size in sliding layers) covers
    # the census' distances at SEQ_LEN: the defaults' 1024 and 512 would make it half of the tiny block, which
    # tp keeps whole (every head mixes it); on Inkling itself it is 0.03% of a block
    **{name: dict(rel_extent=SEQ_LEN, sliding_window_size=SEQ_LEN)
       for name in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
    # 2 residual streams: its hyper-connections' mixing weights ((2 + n) * n x n * width, whole on every rank)
    # grow as the square of the streams, and the default 4 would make them 22% of the tiny block (on V4-Flash
    # itself they are under 0.1% of a block); heavily compressed windows of 8 tokens, not 128, so that the
    # census's SEQ_LEN tokens reach that compressor
    "deepseek_v4": dict(hc_mult=2, compress_rates={"compressed_sparse_attention": 4,
                                                   "heavily_compressed_attention": 8}),
    # the same for HY-V4's hyper-connections (on HY-V4 itself, 4 streams of 2816, they are under 0.1% of a block)
    "hy_v4": dict(hc_mult=2),
    # the rank of its gated norms' MLP as AXK2's is to its width (16 of 2048): the default 16, half the tiny
    # width, would make those MLPs (whole on every rank: they scale the stream) 12% of the tiny block
    "axk2": dict(gated_norm_rank=2),
    "zamba": dict(attention_hidden_size=2 * WIDTH, layers_block_type=["linear_attention", "hybrid"] * 2),
    "zamba2": dict(attention_hidden_size=2 * WIDTH, hybrid_layer_ids=[1, 3],
                   layers_block_type=["linear_attention", "hybrid"] * 2),
}
"""What single models need beyond ``TINY`` to build and train from tokens."""


def model_types() -> list[str]:
    """Every model type of transformers' causal-LM mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def _default_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


def not_decoder_only(model_type: str) -> str | None:
    """Why ``model_type`` is outside the census (an encoder, an encoder-decoder's decoder, a multimodal
    model, a wrapper of another entry), else None."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type].endswith("ForConditionalGeneration"):
        return "multimodal: takes pixel or audio inputs"
    if "Assistant" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]:
        return "a draft model for assisted generation: reads its target model's keys and values"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:  # BERT and its kin, BART and its kin
        return "an encoder (masked LM) run as a decoder"
    try:
        config = _default_config(model_type)
    except Exception:  # an invalid default: the model is in the census, and does_not_build says why
        return None
    if getattr(config, "is_encoder_decoder", False):
        return "the decoder of an encoder-decoder"
    text = getattr(getattr(config, "text_config", None), "model_type", None)
    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text) == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]:
        return f"the same model as {text} (its config wraps {text}'s with a vision one)"
    return None


def tiny_config(model_type: str) -> dict:
    """The ``Case.model`` of ``model_type``: ``model_type``, ``seq_len`` and its config's keyword arguments."""
    sizes = _tiny(_default_config(model_type).to_dict())
    # vocab_size at the top too: the data is drawn from it (a config that wraps a text config ignores it)
    sizes.update(use_cache=False, attn_implementation="eager", vocab_size=VOCAB)
    for name, value in OVERRIDES.get(model_type, {}).items():  # a sub-config's override adds to its tiny sizes
        sizes[name] = {**sizes[name], **value} if isinstance(sizes.get(name), dict) else value
    return dict(model_type=model_type, seq_len=SEQ_LEN, **sizes)


def _tiny(defaults: dict) -> dict:
    """``TINY`` and no dropout over a config's fields (``defaults``), and so over each sub-config's (a model
    made of parts, e.g. BLT's encoder, global transformer and decoder, has one config per part)."""
    sizes = {}
    depth = defaults.get("num_hidden_layers")
    for name, default in defaults.items():
        if isinstance(default, dict) and "model_type" in default:
            sizes[name] = {**default, **_tiny(default)}
        elif isinstance(default, list) and depth and len(default) == depth:
            sizes[name] = _per_layer(name, default)
        elif name == "per_layer_config" and default:  # sizes that differ per layer, keyed by the full model's
            sizes[name] = {}  # layer numbers: the tiny model's layers all have the tiny sizes
    for fields, value in TINY.items():
        for name in fields:
            default = defaults.get(name, False)
            if default is None and name not in OFF_WHEN_NONE or _is_number(default):
                sizes[name] = value
    if _is_number(defaults.get("qk_rope_head_dim")):  # multi-head latent attention: rotary on a part of its
        sizes["head_dim"] = HEAD_DIM // 2  # own, and keys and values made for every query head (no groups)
        if "num_key_value_heads" in defaults:
            sizes["num_key_value_heads"] = HEADS
    if _is_number(defaults.get("rotary_dim")):  # rotary on part of each head, as in GPT-J and CodeGen
        sizes["rotary_dim"] = HEAD_DIM // 2
    for name, default in defaults.items():  # no randomness in training: dropout, layer drop, router jitter
        if any(word in name for word in RANDOM_FIELDS) and isinstance(default, float):
            sizes[name] = 0.0
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id"):  # ids must be rows of the tiny vocabulary
        if _is_number(defaults.get(name)) and defaults[name] >= VOCAB:
            sizes[name] = 0
    return sizes


def _per_layer(name: str, default: list) -> list:
    """A per-layer list (layer kinds, per-layer sizes) cut to ``DEPTH``, keeping every kind of layer."""
    for fields, value in TINY.items():
        if name in fields:
            return [value] * DEPTH
    kinds = [repr(entry) for entry in default]  # repr: entries may be lists or dicts
    missing = [default[kinds.index(kind)] for kind in dict.fromkeys(kinds) if kind not in kinds[:DEPTH]]
    return default[:DEPTH - len(missing)] + missing  # e.g. Gemma 3n's first full-attention layer is its fifth


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def build(model_type: str):
    """The tiny model in ``model_type``'s ``AutoModelForCausalLM`` class, as ``HFCausalLMModule`` builds it."""
    from lightning_3d.models.hf import hf_config, require_transformers

    sizes = tiny_config(model_type)
    sizes.pop("model_type"), sizes.pop("seq_len")
    return require_transformers().AutoModelForCausalLM.from_config(hf_config(model_type, sizes))


def too_large(model_type: str) -> str | None:
    """Why the tiny model is not tiny (counted on the meta device, so it is never allocated), else None."""
    import torch

    with torch.device("meta"):
        parameters = sum(p.numel() for p in build(model_type).parameters())
    if parameters > MAX_PARAMETERS:
        return f"{parameters:,} parameters from the tiny config: a size field it does not set"
    return None


def why_not_built(model_type: str, err: BaseException) -> str:
    """The reason a model did not build or train in one process: the first line of ``err``, and whether the
    model's default (full-size) config builds (if not, the cause is not the tiny config)."""
    return f"{_first_line(err)}{_default_builds(model_type)}"


def _default_builds(model_type: str) -> str:
    import torch
    import transformers

    try:
        config = _default_config(model_type)
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
    except Exception as err:
        return f" (its default config fails too: {_first_line(err)[:80]})"
    return " (its default config builds)"


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # a validation error's first line names the validator; the cause is on its last
    return f"{type(err).__name__}: {lines[-1] if 'validation error' in str(err) else (lines or [''])[0]}"[:200]
