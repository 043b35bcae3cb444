"""The Hugging Face parity runs (Llama and GPT-2), the runs of users' models (their init; pipelines of their
forward as written; sequence parallelism from "auto"), and one shared launch per world size for all of them:
``parity/test_parity_hf_llama.py``, ``parity/test_parity_hf_gpt2.py``, ``parity/test_parity_user_model_init.py``,
``parity/test_parity_pipeline_as_written.py`` and ``parity/test_parity_auto_sequence_parallel.py`` each
check their own cases, whichever runs first launches every set (torchrun start-up dominates these tiny
runs)."""

import dataclasses
from pathlib import Path

from helpers.harness import Case, Result, launch_by_world_size

LLAMA = dict(model_type="llama", seq_len=16, vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
GPT2_SIZES = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=4)
NO_DROPOUT = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)


def llama_case(name, dp, pp, tp, model=(), module="hf", **strategy):
    kwargs = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, **strategy)
    return Case(name=name, module=module, strategy_kwargs=kwargs, dp=dp, model=dict(LLAMA, **dict(model)), steps=4)


def gpt2_case(name, dp, pp, tp, module="hf", **strategy):
    kwargs = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, policy="gpt2", **strategy)
    model = dict(model_type="gpt2", seq_len=16, **GPT2_SIZES, **NO_DROPOUT)
    return Case(name=name, module=module, strategy_kwargs=kwargs, dp=dp, steps=4, model=model)


LLAMA_CASES = {c.name: c for c in [
    llama_case("tp2_kv_split", 1, 1, 2),
    llama_case("tp2_sp", 1, 1, 2, sequence_parallel=True),
    llama_case("tp2_kv1_replicated", 1, 1, 2, model=dict(num_key_value_heads=1)),
    llama_case("pp2_padding_mask", 1, 2, 1, module="hf_padded"),  # the mask travels with the hidden states
    llama_case("pp2_labels", 1, 2, 1, module="hf_labels"),  # the model's own loss, on the last stage
    llama_case("tp2_tied", 1, 1, 2, model=dict(tie_word_embeddings=True)),
    llama_case("pp2_tp2_sp", 1, 2, 2, sequence_parallel=True),
    llama_case("pp2_tp2_sp_padding_mask", 1, 2, 2, module="hf_padded", sequence_parallel=True),
    llama_case("tp4_kv2_replicated", 1, 1, 4),
    llama_case("pp2_tp2_tied_across_stages", 1, 2, 2, model=dict(tie_word_embeddings=True)),
    llama_case("dp2_pp2_tp2", 2, 2, 2),
    llama_case("dp2_pp2_tp2_zero3_interleaved", 2, 2, 2, zero_stage=3, pipeline_schedule="interleaved_1f1b",
               virtual_pipeline_size=2),
]}

GPT2_CASES = {c.name: c for c in [
    gpt2_case("gpt2_1_1_2", 1, 1, 2),
    gpt2_case("gpt2_1_1_2_sp", 1, 1, 2, sequence_parallel=True),
    gpt2_case("gpt2_1_2_1", 1, 2, 1),
    gpt2_case("gpt2_1_2_1_padding_mask", 1, 2, 1, module="hf_padded"),  # later stages get the mask too
    gpt2_case("gpt2_1_2_2", 1, 2, 2),
    gpt2_case("gpt2_1_2_2_sp", 1, 2, 2, sequence_parallel=True),
    gpt2_case("gpt2_2_2_2", 2, 2, 2),
]}


def user_init_case(module, dp, pp, tp, tag="", **strategy):
    """One step at learning rate 0 of a model that initializes itself its own way (helpers/user_models.py):
    the parameters after it are the initial ones, the loss and gradient norm are those at init."""
    kwargs = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, **strategy)
    return Case(name=f"{module}{tag}_{dp}_{pp}_{tp}", module=module, strategy_kwargs=kwargs, dp=dp, steps=1,
                learning_rate=0.0, model=dict(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64))


USER_INIT_CASES = {c.name: c for c in [
    user_init_case("user_nanogpt", 2, 1, 1),
    user_init_case("user_nanogpt", 1, 1, 2),
    user_init_case("user_nanogpt", 1, 2, 1),
    user_init_case("user_llama", 2, 1, 1),
    user_init_case("user_llama", 1, 1, 2),
    user_init_case("user_llama", 1, 2, 1),
]}

# model_init="fast" (each rank replays the build for its own stages, every draw seeded apart): one process under
# "fast" is the reference of every layout under "fast" (parity/test_parity_user_model_init.py).
FAST_INIT_CASES = {c.name: c for c in [
    user_init_case(module, *layout, tag="_fast", model_init="fast")
    for module in ("user_nanogpt", "user_llama") for layout in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2)]
]}


def as_written_case(name, module, dp, pp, tp=1, steps=3, **strategy):
    """A user's model under a pipeline with policy="auto": each stage runs its forward as written."""
    kwargs = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, **strategy)
    return Case(name=name, module=module, strategy_kwargs=kwargs, dp=dp, steps=steps, learning_rate=0.1,
                model=dict(n_layer=4, n_embd=32, n_head=4, block_size=16, vocab_size=64))


AS_WRITTEN_CASES = {c.name: c for c in [
    as_written_case("nanogpt_pp2_gpipe", "user_nanogpt", 1, 2, pipeline_schedule="gpipe"),
    as_written_case("nanogpt_pp2_1f1b", "user_nanogpt", 1, 2, pipeline_schedule="1f1b", num_microbatches=4),
    as_written_case("nanogpt_pp2_interleaved", "user_nanogpt", 1, 2, pipeline_schedule="interleaved_1f1b",
                    virtual_pipeline_size=2),
    as_written_case("nanogpt_pp2_zero_bubble", "user_nanogpt", 1, 2, pipeline_schedule="zero_bubble",
                    virtual_pipeline_size=2),
    as_written_case("llama_style_pp2", "user_llama_style", 1, 2),
    as_written_case("nanogpt_dp2_pp2_zero3", "user_nanogpt", 2, 2, zero_stage=3),
]}

# Sequence parallelism that policy="auto" plans by structure, for a model it has no policy for (issue 17
# item 7): parity/test_parity_auto_sequence_parallel.py.
AUTO_SP_CASES = {c.name: c for c in [
    as_written_case("nanogpt_tp2_sp", "user_nanogpt", 1, 1, 2, sequence_parallel=True),
    as_written_case("nanogpt_dp2_tp2_sp", "user_nanogpt", 2, 1, 2, sequence_parallel=True),
    as_written_case("nanogpt_dp2_pp2_tp2_sp", "user_nanogpt", 2, 2, 2, sequence_parallel=True),
]}

# Tensor parallelism that policy="auto" finds by tracing a block (issue 29), for models from transformers
# configs and nanoGPT as published: parity/test_parity_auto_tensor_parallel.py.
# Configured as for training: no key/value cache (transformers' mask code then takes its packed-sequence path).
_HF_SIZES = dict(seq_len=16, vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, use_cache=False)
AUTO_TP_MODELS = {
    "phi3": dict(_HF_SIZES, model_type="phi3", intermediate_size=64, num_key_value_heads=4, pad_token_id=0),
    # Grouped-query attention in the fused qkv_proj (Phi-3-small and -medium): parts of 32, 16 and 16 features,
    # stored in rank order over tp (lightning_3d/fused_parts.py).
    "phi3_gqa": dict(_HF_SIZES, model_type="phi3", intermediate_size=64, num_key_value_heads=2, pad_token_id=0),
    "bert": dict(_HF_SIZES, model_type="bert", intermediate_size=64, is_decoder=True, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
    "gpt_neox": dict(_HF_SIZES, model_type="gpt_neox", intermediate_size=64, bos_token_id=0, eos_token_id=0),
    "falcon": dict(_HF_SIZES, model_type="falcon", new_decoder_architecture=True, num_kv_heads=2, bos_token_id=0,
                   eos_token_id=0),
    # Falcon-7B's multi-query attention: one k and v head, which every tp rank keeps whole in the fused
    # query_key_value (its gradient summed over tp; counted once by the global norm).
    "falcon_mqa": dict(_HF_SIZES, model_type="falcon", multi_query=True, bos_token_id=0, eos_token_id=0),
    "olmo": dict(_HF_SIZES, model_type="olmo", intermediate_size=64, num_key_value_heads=2, pad_token_id=0,
                 bos_token_id=0, eos_token_id=0),
    "gemma2": dict(_HF_SIZES, model_type="gemma2", intermediate_size=64, num_key_value_heads=2, head_dim=8),
    "qwen2": dict(_HF_SIZES, model_type="qwen2", intermediate_size=64, num_key_value_heads=2),
    # Per-head q_norm / k_norm inside the split attention: whole weights whose gradient is summed over tp.
    "qwen3": dict(_HF_SIZES, model_type="qwen3", intermediate_size=64, num_key_value_heads=2, head_dim=8),
    # q_norm / k_norm over all of q's and k's features: each rank holds half of them, DTensor computes the norm.
    # A LayerNorm per head on q and k of a fused head-major query_key_value.
    "persimmon": dict(_HF_SIZES, model_type="persimmon", intermediate_size=64, pad_token_id=0, bos_token_id=0,
                      eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0),
    "olmo2": dict(_HF_SIZES, model_type="olmo2", intermediate_size=64, num_key_value_heads=2, pad_token_id=0,
                  bos_token_id=0, eos_token_id=0),
    "gpt2": dict(model_type="gpt2", seq_len=16, **GPT2_SIZES, **NO_DROPOUT),
    # ALiBi: the per-head bias BLOOM computes once and hands every block, cut to each rank's heads.
    "bloom": dict(_HF_SIZES, model_type="bloom", hidden_dropout=0.0, attention_dropout=0.0),
    # LFM2's short convolution (in_proj -> B, C, x; a depthwise conv1d on B * x; out_proj), with its biases:
    # B, C and x split by channel, the conv's filters with their channels.
    "lfm2": dict(_HF_SIZES, model_type="lfm2", intermediate_size=64, num_key_value_heads=2, conv_bias=True,
                 layer_types=["conv", "full_attention", "conv", "full_attention"], block_auto_adjust_ff_dim=False),
    # Mamba-2 layers (Bamba): heads split with their x, z and dt features and their A_log, D, dt_bias; B and C of
    # the one group whole on every rank (their gradients summed over tp), in the fused in_proj and in the conv1d's
    # channels; the gated norm over all of a rank's features computed by DTensor.
    "bamba": dict(_HF_SIZES, model_type="bamba", num_key_value_heads=2, intermediate_size=64, mamba_d_head=8,
                  mamba_n_heads=8, mamba_d_state=8, mamba_chunk_size=16, max_position_embeddings=64),
    # Gated DeltaNet layers (Qwen3.5) beside full attention: the scan's heads split like attention's; the conv1d
    # over [q | k | v] keeps each rank's chunk of each part.
    "qwen3_5_text": dict(_HF_SIZES, model_type="qwen3_5_text", num_key_value_heads=2, head_dim=8, intermediate_size=64,
                         layer_types=["linear_attention"] * 3 + ["full_attention"], linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=4,
                         max_position_embeddings=64),
    # Mamba-1 layers (Jamba's, beside attention; one expert: dense MLPs): each channel a head with its x, z,
    # dt_proj row, A_log and D; x_proj split by its inputs, its outputs (step sizes, B, C) summed over tp both
    # ways, and the norms on them whole with gradients summed over tp.
    "jamba": dict(_HF_SIZES, model_type="jamba", num_key_value_heads=2, intermediate_size=64, num_experts=1,
                  mamba_d_state=8, mamba_dt_rank=4, max_position_embeddings=64, attention_dropout=0.0),
    # Multi-head latent attention (DeepSeek-V3's, its MLPs dense): the low-rank q_a_proj and kv_a_proj_with_mqa
    # split and gathered, their norms whole with gradients summed over tp, q_b_proj and kv_b_proj split by heads;
    # the rotary key, one for all heads, reaches every rank's heads whole.
    "deepseek_v3": dict(_HF_SIZES, model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4, intermediate_size=64,
                        first_k_dense_replace=4, n_routed_experts=4, moe_intermediate_size=32, n_group=1,
                        topk_group=1, attention_dropout=0.0),
}
# Mixtures of experts: each expert's intermediate features split over tp (lightning_3d/policies/experts.py);
# Qwen2-MoE adds a shared expert (an MLP region) and its gate; gpt-oss, below. Not with sequence parallelism (refused: the
# router would see one rank's positions).
AUTO_TP_MOE_MODELS = {
    "mixtral": dict(_HF_SIZES, model_type="mixtral", intermediate_size=64, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
    "qwen2_moe": dict(_HF_SIZES, model_type="qwen2_moe", intermediate_size=64, num_key_value_heads=2,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    # Experts stored transposed, gate and up interleaved, with biases; attention sinks (one weight per head).
    "gpt_oss": dict(_HF_SIZES, model_type="gpt_oss", intermediate_size=32, num_key_value_heads=2, head_dim=8,
                    num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2,
                    sliding_window=8),
}

# Expert parallelism (tests/parity/test_parity_expert_parallel.py, test_checkpoints.py): as trained, with grouped-query
# attention and top-2 of 8 experts, so every ep size up to 8 divides them.
_MOE_SIZES = dict(_HF_SIZES, num_key_value_heads=2)
MOE_MODELS = {
    "mixtral": dict(_MOE_SIZES, model_type="mixtral", intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    router_jitter_noise=0.0),
    # Qwen3-MoE: q/k norms per head, its experts' top-k weights renormalized
    "qwen3_moe": dict(_MOE_SIZES, model_type="qwen3_moe", head_dim=8, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1),
    # OLMoE: q/k norms over all heads, the top-k weights not renormalized
    "olmoe": dict(_MOE_SIZES, model_type="olmoe", intermediate_size=32, num_experts=8, num_experts_per_tok=2),
}
MORE_MOE_MODELS = {
    # a shared expert (an MLP beside the routed ones, with its own gate): data-parallel like every other weight
    "qwen2_moe": dict(_MOE_SIZES, model_type="qwen2_moe", intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, shared_expert_intermediate_size=32),
    # experts stored transposed, gate and up interleaved, with biases (the down bias added once under tp)
    "gpt_oss": dict(_MOE_SIZES, model_type="gpt_oss", intermediate_size=32, head_dim=8, num_local_experts=8,
                    num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8),
}

# Forwards that pipeline as written only when the stages follow the forward: OPT calls its final norm, registered
# before its layers, after them; BLOOM, GPT-Neo, MPT and Falcon blocks return tuples their forward indexes;
# Llama 4 reads embed_tokens.weight.device on every stage; GLM-MoE-DSA's layers pass top-k indices to the next
# (tests/unit/test_pipeline_placement.py).
PIPELINE_HF_MODELS = {
    "opt": dict(_HF_SIZES, model_type="opt", ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                max_position_embeddings=64, pad_token_id=1),
    "bloom": dict(_HF_SIZES, model_type="bloom", hidden_dropout=0.0, attention_dropout=0.0),
    "gpt_neo": dict(_HF_SIZES, model_type="gpt_neo", num_layers=4, num_heads=4,
                    attention_types=[[["global", "local"], 2]], window_size=8, max_position_embeddings=64,
                    embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0, bos_token_id=0, eos_token_id=0),
    "mpt": dict(_HF_SIZES, model_type="mpt", d_model=32, n_heads=4, n_layers=4, expansion_ratio=2, max_seq_len=64,
                resid_pdrop=0.0, emb_pdrop=0.0),
    "falcon": AUTO_TP_MODELS["falcon"],
    "llama4_text": dict(_HF_SIZES, model_type="llama4_text", num_key_value_heads=2, head_dim=8, intermediate_size=64,
                        intermediate_size_mlp=64, num_local_experts=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    # Layers 2 and 3 reuse the top-k tokens layer 1 selected (of 16, 4): the indices cross the stages.
    "glm_moe_dsa": dict(_HF_SIZES, model_type="glm_moe_dsa", num_key_value_heads=4, head_dim=4, v_head_dim=8,
                        qk_head_dim=8, qk_rope_head_dim=4, qk_nope_head_dim=4, kv_lora_rank=16, q_lora_rank=16,
                        intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=1, topk_group=1, mlp_layer_types=["dense", "dense", "dense", "sparse"],
                        indexer_types=["full", "full", "shared", "shared"], index_n_heads=2, index_head_dim=8,
                        index_topk=4, max_position_embeddings=64, attention_dropout=0.0),
}
PIPELINE_HF_CASES = {c.name: c for c in [
    Case(name=f"hf_{model}_pp2", module="hf", strategy_kwargs=dict(data_parallel_size=1, pipeline_parallel_size=2,
                                                                  tensor_parallel_size=1), steps=4, model=config)
    for model, config in PIPELINE_HF_MODELS.items() if model != "falcon"  # (Falcon: in AUTO_TP_CASES, tp2 x pp2)
]}

AUTO_TP_STEPS = {"qwen3": 20}
"""Steps per model where 4 are too few: an unreduced gradient of a small weight shows late (Qwen3's k_norm:
equal losses at step 1, 1e-3 apart by step 6)."""


def auto_tp_case(model, dp, pp, tp, **strategy):
    kwargs = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, **strategy)
    tag = (f"{model}_{dp}_{pp}_{tp}" + ("_sp" if strategy.get("sequence_parallel") else "")
           + (f"_zero{strategy['zero_stage']}" if strategy.get("zero_stage") else ""))
    if model == "nanogpt":
        return as_written_case(f"auto_{tag}", "user_published_gpt", dp, pp, tp, **strategy)
    return Case(name=f"auto_{tag}", module="hf", strategy_kwargs=kwargs, dp=dp, steps=AUTO_TP_STEPS.get(model, 4),
                model={**AUTO_TP_MODELS, **AUTO_TP_MOE_MODELS}[model])


AUTO_TP_CASES = {c.name: c for c in [
    auto_tp_case(model, *layout, **extra)
    for model in ["nanogpt", *AUTO_TP_MODELS]
    for layout, extra in [((1, 1, 2), {}), ((1, 1, 2), dict(sequence_parallel=True)), ((1, 2, 2), {})]
] + [
    # ZeRO-3 over dp on fused projections (phi3's weights, nanoGPT's q|k|v bias too): dp cuts the tp-local piece.
    auto_tp_case(model, 2, 1, 2, zero_stage=3) for model in ("phi3", "phi3_gqa", "nanogpt", "mixtral")
] + [
    auto_tp_case(model, *layout) for model in AUTO_TP_MOE_MODELS for layout in [(1, 1, 2), (1, 2, 2)]
] + [
    # The global norm clips (0.05 is below every step's norm): whole parts counted once, under ZeRO's dp cut.
    dataclasses.replace(auto_tp_case("falcon_mqa", 2, 1, 2, zero_stage=3), gradient_clip_val=0.05),
    dataclasses.replace(auto_tp_case("deepseek_v3", 2, 1, 2, zero_stage=3), gradient_clip_val=0.05),
    # A user's model with a gated short convolution (nn.Conv1d of one filter per channel, called as a module) in
    # each block, its own init: tp splits the filters with their channels; also under ZeRO-3 with SP.
    as_written_case("auto_conv_lm_1_1_2", "user_conv_lm", 1, 1, 2),
    as_written_case("auto_conv_lm_2_1_2_zero3_sp", "user_conv_lm", 2, 1, 2, zero_stage=3, sequence_parallel=True),
]}

AUTO_TP_SAVED = [name for name in AUTO_TP_CASES if name.endswith(("_1_1_2", "_zero3"))]
"""The auto tp=2 runs that save their checkpoint after training (``AUTO_TP_CHECKPOINTS``: name -> path)."""
AUTO_TP_CHECKPOINTS: dict[str, str] = {}

_RESULTS: dict[str, Result] = {}


def hf_results(tmp_path_factory) -> dict[str, Result]:
    """Every Hugging Face parity run's result by name, launched once per pytest session."""
    if not _RESULTS:
        out_dir = Path(tmp_path_factory.mktemp("hf_parity"))
        AUTO_TP_CHECKPOINTS.update({name: str(out_dir / "checkpoints" / f"{name}.ckpt") for name in AUTO_TP_SAVED})
        auto_tp = [dataclasses.replace(c, save_checkpoint=AUTO_TP_CHECKPOINTS.get(c.name)) for c in AUTO_TP_CASES.values()]
        cases = [*LLAMA_CASES.values(), *GPT2_CASES.values(), *USER_INIT_CASES.values(), *FAST_INIT_CASES.values(),
                 *AS_WRITTEN_CASES.values(), *PIPELINE_HF_CASES.values(), *AUTO_SP_CASES.values(), *auto_tp]
        _RESULTS.update(launch_by_world_size(cases, out_dir, timeout=900))
    return _RESULTS
