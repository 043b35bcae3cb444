"""policy="auto" finds a model's tensor-parallel split by tracing one block on the meta device (issue 29), for
models this repository did not write; on ranks, the runs that match one process are
parity/test_parity_auto_tensor_parallel.py. Here: the plan only, in one process, at tp=2 and tp=4."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from helpers.user_models import PublishedGPT
from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.projections import ColumnSplit, OnSplitFeatures, RowSplit

transformers = pytest.importorskip("transformers")

# As a model is configured for training: no key/value cache.
SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, use_cache=False)
CONFIGS = {
    "phi3": dict(SIZES, intermediate_size=64, num_key_value_heads=4, pad_token_id=0),
    "bert": dict(SIZES, intermediate_size=64, is_decoder=True),
    "gpt_neox": dict(SIZES, intermediate_size=64),
    "falcon": dict(SIZES, new_decoder_architecture=True, num_kv_heads=2),
    "olmo": dict(SIZES, intermediate_size=64, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gemma2": dict(SIZES, intermediate_size=64, num_key_value_heads=2, head_dim=8),
    "gptj": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, use_cache=False),
    "qwen3": dict(SIZES, intermediate_size=64, num_key_value_heads=2, head_dim=8),
    "olmo2": dict(SIZES, intermediate_size=64, num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    # Fused head-major query_key_value, then a LayerNorm per head on q and k (features followed through it).
    "persimmon": dict(SIZES, intermediate_size=64, pad_token_id=0, bos_token_id=0, eos_token_id=0),
}


def hf(model_type, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**CONFIGS.get(model_type, {}), **overrides})
    with torch.device("meta"):
        return nn.ModuleDict({"model": transformers.AutoModelForCausalLM.from_config(config)})


def plan(root, tp=2, **options):
    return AutoPolicy().plan(root, PlanOptions(tp=tp, **options))


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("tp", [2, 4])
def test_auto_shards_at_least_90_percent_of_the_block_parameters(model_type, tp):
    # At tp=4 with 2 kv heads auto refuses (it does not replicate kv heads; the "llama" policy does): 4 here.
    root = hf(model_type, **({"falcon": dict(num_kv_heads=4), "gemma2": dict(num_key_value_heads=4),
                              "qwen3": dict(num_key_value_heads=4), "olmo2": dict(num_key_value_heads=4)}.get(model_type, {})
                             if tp == 4 else {}))
    p = plan(root, tp)
    sharded, total = sharded_share(root, p.blocks, p.tp_plan)
    assert sharded / total >= 0.9, (sharded, total)


def test_the_blocks_inputs_are_found_without_a_cache_where_the_mask_code_reads_values():
    # Without a cache, transformers checks the position ids for packed sequences with .item(): on meta that
    # fails, unless the values of what derives from the inputs are kept beside them (policies/meta_values.py).
    from lightning_3d.policies.block_inputs import block_inputs

    model = hf("qwen3")["model"]
    found = block_inputs(model, model.model.layers[0], width=32)
    assert not isinstance(found, str), found
    args, kwargs = found
    assert args[0].shape == (1, 4, 32) and kwargs["position_embeddings"][0].shape[-2] == 4


def test_weights_inside_a_split_attention_get_their_gradient_summed_over_tp():
    # Qwen3's q_norm / k_norm (RMSNorm over head_dim) run on this rank's heads: whole weights on split features.
    p = plan(hf("qwen3"))
    for name in ("q_norm", "k_norm"):
        style = p.tp_plan[f"model.model.layers.1.self_attn.{name}"]
        assert isinstance(style, OnSplitFeatures) and style.dim == 2  # (batch, tokens, heads, head_dim)
    assert not any(isinstance(s, OnSplitFeatures) for f, s in p.tp_plan.items() if "norm" in f and "attn" not in f)
    # OLMo 2's q_norm / k_norm normalize all of q's (k's) features: split along the last of (batch, tokens, features).
    p = plan(hf("olmo2"))
    assert p.tp_plan["model.model.layers.0.self_attn.k_norm"].dim == 2


def test_fused_projections_keep_each_ranks_parts_together():
    root = hf("phi3")
    p = plan(root)
    assert p.tp_plan["model.model.layers.0.self_attn.qkv_proj"].parts == (32, 32, 32)
    assert p.tp_plan["model.model.layers.1.mlp.gate_up_proj"].parts == (64, 64)
    assert isinstance(p.tp_plan["model.model.layers.1.mlp.down_proj"], RowSplit)
    fix = p.attribute_fixes["model.model.layers.0.self_attn"]
    assert fix["num_key_value_heads"] == 2 and fix["config"].num_attention_heads == 2
    assert fix["config"] is not root["model"].config and root["model"].config.num_attention_heads == 4


def test_a_fused_projection_of_unequal_parts_is_stored_in_rank_order():
    # Phi-3 with 2 kv heads: q|k|v of 32, 16 and 16 features; rank r keeps its chunk of each.
    root = hf("phi3", num_key_value_heads=2)
    p = plan(root)
    assert p.tp_plan["model.model.layers.0.self_attn.qkv_proj"].parts == (32, 16, 16)
    fix = p.attribute_fixes["model.model.layers.0.self_attn"]
    assert fix["num_key_value_heads"] == 1 and fix["config"].num_attention_heads == 2


def test_rank_order_maps_back_to_the_single_device_order():
    from lightning_3d.fused_parts import FusedParts

    parts = FusedParts(0, (4, 2, 2), 2)
    assert parts.single_device_index().tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert parts.stored(torch.arange(8.0)).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    # A whole part (one kv head of 2 features for 2 ranks): stored once per rank, the same single-device shape.
    mqa = FusedParts(0, (4, 2), 2, whole=(False, True))
    assert mqa.single_device_index().tolist() == [0, 1, 4, 5, 2, 3, 4, 5]
    assert mqa.whole_rows() == [(2, 2)] and mqa.single_device_shape((8, 3)) == (6, 3)


def test_nanogpt_as_published_gets_its_hidden_features_sliced_and_gathered():
    root = nn.ModuleDict({"model": PublishedGPT(64, 16, 2, 32, 4)})
    p = plan(root)
    attn = p.tp_plan["model.transformer.h.0.attn"]
    assert attn.input[1].is_shard(-1)  # the module sees C / tp features: its x.size() then fits its view()
    assert p.tp_plan["model.transformer.h.0.attn.c_attn"].parts == (32, 32, 32)
    assert p.attribute_fixes["model.transformer.h.0.attn"] == {"n_embd": 16, "n_head": 2}


def test_the_embedding_and_head_split_over_the_vocabulary_a_tied_pair_included():
    root = nn.ModuleDict({"model": PublishedGPT(64, 16, 2, 32, 4)})
    p = plan(root)
    assert isinstance(p.tp_plan["model.transformer.wte"], RowwiseParallel)
    assert isinstance(p.tp_plan["model.lm_head"], ColwiseParallel)
    assert "model.transformer.wpe" not in p.tp_plan  # 16 positions, not the vocabulary
    assert ("model.transformer.wte.weight", "model.lm_head.weight") in p.tied_parameters
    untied = plan(hf("olmo"))
    assert {"model.model.embed_tokens", "model.lm_head"} <= set(untied.tp_plan)


def test_a_vocabulary_tp_does_not_divide_stays_whole_and_says_how_to_pad(monkeypatch):
    said = []
    monkeypatch.setattr("lightning_3d.policies.auto_tp.rank_zero_info", said.append)
    p = plan(hf("olmo", vocab_size=63))
    assert "model.lm_head" not in p.tp_plan
    [summary] = said  # one line (on rank 0 only: rank_zero_info)
    assert "the vocabulary (63) does not divide by tensor_parallel_size=2 (pad it to 64)" in summary


def test_fewer_kv_heads_than_tp_ranks_is_refused_naming_it():
    with pytest.raises(PolicyError, match=r"k_proj's 16 outputs overlap or leave some out \(fewer key/value heads"):
        plan(hf("gemma2"), tp=4)


def test_a_block_auto_cannot_split_is_refused_with_what_and_how_unless_allowed():
    # Gemma 2's 2 kv heads over 4 ranks: each kv head is needed by 2 ranks of 4, neither one rank nor all.
    root = hf("gemma2")
    with pytest.raises(PolicyError) as caught:
        plan(root, tp=4)
    message = str(caught.value)
    for fragment in ["of the block parameters of Gemma2ForCausalLM whole on every tp rank",
                     "self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj: the ranks' shares of"
                     " self_attn.k_proj's 16 outputs overlap", "model.model.layers.*.",
                     "ColumnSplit(parts=", "allow_replicated=True"]:
        assert fragment in message, (fragment, message)
    allowed = plan(root, tp=4, allow_replicated=True)
    assert "model.model.layers.0.self_attn.k_proj" not in allowed.tp_plan
    assert isinstance(allowed.tp_plan["model.model.layers.0.mlp.up_proj"], ColumnSplit)


def test_multi_query_attention_keeps_its_one_kv_head_whole_on_every_rank():
    # Falcon-7B: one kv head in the fused query_key_value [q (32) | k (8) | v (8)], which both ranks need.
    root = hf("falcon", new_decoder_architecture=False, multi_query=True)
    found = plan(root)
    qkv = found.tp_plan["model.transformer.h.0.self_attention.query_key_value"]
    assert (qkv.parts, qkv.whole) == ((32, 16), (False, True))
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.9


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe"])
def test_mixture_of_experts_blocks_split_each_expert_by_its_intermediate_features(model_type):
    from lightning_3d.policies.experts import ExpertsSplit

    sizes = dict(SIZES, intermediate_size=64, num_key_value_heads=2, num_experts=4, num_local_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)
    root = hf(model_type, **sizes)
    found = plan(root)
    assert isinstance(found.tp_plan["model.model.layers.0.mlp.experts"], ExpertsSplit)
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95  # all but norms and the router


def test_experts_written_as_a_module_list_are_refused_at_tp_naming_them():
    # A user's mixture of experts for one device: a router and an nn.ModuleList of MLPs, routed at run time.
    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(32, 4, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4))

        def forward(self, x):
            weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                rows = (chosen == e).any(-1).nonzero(as_tuple=True)
                out[rows] += expert(x[rows]) * weights[rows].sum(-1, keepdim=True)
            return x + out

    root = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(MoE() for _ in range(2))})})
    with pytest.raises(PolicyError, match=r"mixture-of-experts(.|\n)*experts \(4 x Sequential\)(.|\n)*not a transformers"
                                          r" experts module(.|\n)*tensor_parallel_size=1"):
        plan(root)


def test_a_model_without_repeated_blocks_is_refused_at_tp_not_left_whole():
    # A list of modules that are not all layers (a ReLU between two Linears) forms no block list: tp would
    # split nothing.
    root = nn.ModuleDict({"model": nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))})
    with pytest.raises(PolicyError, match="found no repeated blocks(.|\n)*tensor_parallel_size=1"):
        plan(root)


def test_three_dimensional_weights_that_are_not_experts_are_not_taken_for_experts():
    from lightning_3d.policies.auto_tp import expert_banks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 4, groups=8)  # weight (8, 1, 4): a depthwise convolution (Mamba)
            self.q, self.k = (nn.Parameter(torch.zeros(32, 4, 8)) for _ in range(2))  # (hidden, heads, head_dim)
            self.gate_up = nn.Parameter(torch.zeros(4, 128, 32))  # experts: (E, 2I, H) and (E, H, I)
            self.down = nn.Parameter(torch.zeros(4, 32, 64))

    assert expert_banks(Block()) == ["gate_up (4, 128, 32)", "down (4, 32, 64)"]
    block = Block()
    del block.gate_up, block.down
    assert expert_banks(block) == []


def test_attention_sinks_split_with_their_heads():
    # gpt-oss: one learned logit per head (self_attn.sinks, 4 values), beside experts stored transposed,
    # gate and up interleaved, with biases.
    from lightning_3d.policies.experts import ExpertsSplit
    from lightning_3d.policies.head_weights import HeadWeights

    root = hf("gpt_oss", intermediate_size=32, num_key_value_heads=2, head_dim=8, num_local_experts=4,
              num_experts_per_tok=2)
    found = plan(root)
    attention = found.tp_plan["model.model.layers.0.self_attn"]
    assert isinstance(attention, HeadWeights) and attention.names == ["sinks"]
    assert isinstance(found.tp_plan["model.model.layers.0.mlp.experts"], ExpertsSplit)
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95


def test_a_gate_on_each_heads_output_goes_with_its_head():
    # Laguna: g_proj (one gate per query feature, read off the row projection's input) beside q, k and v.
    root = hf("laguna", intermediate_size=64, num_key_value_heads=2, head_dim=8, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16)
    found = plan(root)
    attention = [k for k, style in found.tp_plan.items() if k.startswith("model.model.layers.0.self_attn.")
                 and isinstance(style, ColumnSplit)]
    assert "model.model.layers.0.self_attn.g_proj" in attention, attention


def test_alibi_handed_to_every_block_is_cut_to_each_ranks_heads():
    # BLOOM computes its ALiBi bias, (batch x heads, 1, tokens), once and passes it to every block.
    from lightning_3d.policies.head_inputs import HeadInputs, cut

    found = plan(hf("bloom", n_head=4))
    style = found.tp_plan["model.transformer.h.0"]
    assert isinstance(style, HeadInputs) and style.keys == [("kwarg", "alibi", 0)] and style.heads == 4
    alibi = torch.arange(2 * 4 * 3.0).reshape(2 * 4, 1, 3)  # batch 2: rows (b, h)
    _, kwargs = cut((), {"alibi": alibi}, style.keys, heads=4, rank=1, tp=2)
    assert kwargs["alibi"].flatten(1)[:, 0].tolist() == [6.0, 9.0, 18.0, 21.0]  # heads 2, 3 of each sample


MLA = dict(SIZES, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
           v_head_dim=8, intermediate_size=64, first_k_dense_replace=2, n_group=1, topk_group=1)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_splits_its_heads_and_gathers_its_low_rank_projections(model_type):
    # MLA writes each key in place ([..., :nope].copy_(k_nope), [..., nope:].copy_(k_rot)); V2's rotary goes
    # through complex numbers. The trace follows both to the heads.
    from lightning_3d.policies.hidden_states import HiddenStates
    from lightning_3d.policies.projections import SummedGradients

    root = hf(model_type, **MLA)
    found = plan(root)
    attention = "model.model.layers.0.self_attn"
    styles = {name[len(attention) + 1:]: style for name, style in found.tp_plan.items() if name.startswith(attention)}
    assert styles[""].partial_gradient and isinstance(styles[""], HiddenStates)
    for low_rank in ("q_a_proj", "kv_a_proj_with_mqa"):
        assert styles[low_rank].local_input and styles[low_rank].gather_output
    for head_split in ("q_b_proj", "kv_b_proj"):
        assert styles[head_split].local_input and not styles[head_split].gather_output
    assert isinstance(styles["o_proj"], RowSplit)
    assert isinstance(styles["q_a_layernorm"], SummedGradients) and isinstance(styles["kv_a_layernorm"], SummedGradients)
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95


def test_a_sparse_attention_indexer_stays_whole_beside_split_latent_attention():
    # GLM-MoE-DSA: the indexer scores tokens with its own projections; only top-k indices leave it, through which
    # no gradient flows, so it does not take part in the split and each rank runs it whole.
    from lightning_3d.policies.projections import SummedGradients

    root = hf("glm_moe_dsa", **MLA, head_dim=4, qk_head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
              num_experts_per_tok=2, mlp_layer_types=["dense", "dense"], indexer_types=["full", "full"],
              index_n_heads=2, index_head_dim=8, index_topk=4)
    found = plan(root)
    attention = "model.model.layers.0.self_attn"
    assert isinstance(found.tp_plan[f"{attention}.q_b_proj"], ColumnSplit)
    assert isinstance(found.tp_plan[f"{attention}.indexer.wk"], SummedGradients)


def test_a_short_convolution_splits_its_filters_with_their_channels():
    # LFM2: in_proj -> B | C | x, a depthwise conv1d on B * x (read by the mixer, not called), out_proj.
    from lightning_3d.policies.head_weights import HeadWeights

    root = hf("lfm2", **SIZES, intermediate_size=64, num_key_value_heads=2, conv_bias=True,
              layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)
    found = plan(root)
    assert found.tp_plan["model.model.layers.0.conv.in_proj"].parts == (32, 32, 32)
    conv = found.tp_plan["model.model.layers.0.conv"]
    assert isinstance(conv, HeadWeights) and conv.names == ["conv.weight", "conv.bias"]
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95


class _ConvolutionInTheBlock(nn.Module):
    """A user's block holding its depthwise convolution itself, beside the projections around it. ``rolled``:
    the convolution sees its channels turned half a turn (the filter at channel c convolves feature c + 8 mod
    16), so each rank's features would sit at the other rank's filters."""

    def __init__(self, rolled: bool = False):
        super().__init__()
        self.rolled = rolled
        self.norm = nn.LayerNorm(16)
        self.in_proj, self.out_proj = nn.Linear(16, 16), nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 16, 3, groups=16, padding=2)

    def _turn(self, y):
        return torch.cat([y[..., 8:], y[..., :8]], -1) if self.rolled else y

    def forward(self, x):
        y = self.conv(self._turn(self.in_proj(self.norm(x))).transpose(1, 2))[..., :x.shape[1]]
        return x + self.out_proj(self._turn(y.transpose(1, 2)))


def _layers(count: int, **kwargs) -> nn.Module:
    return nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList(_ConvolutionInTheBlock(**kwargs)
                                                                           for _ in range(count))})})


def test_a_convolution_whose_channels_do_not_follow_the_split_features_is_not_split():
    with pytest.raises(PolicyError, match=r"conv's channels do not split as the features they hold do"):
        plan(_layers(2, rolled=True))


def test_a_convolution_held_by_the_block_itself_splits_there_also_under_sequence_parallelism():
    from lightning_3d.policies.head_weights import HeadWeights
    from lightning_3d.policies.hidden_states import HiddenStates

    root = _layers(3)
    found = plan(root)
    assert found.tp_plan["model.layers.1"].names == ["conv.weight", "conv.bias"]
    assert found.attribute_fixes["model.layers.1.conv"] == {"groups": 8}
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.9
    ends = plan(root, sequence_parallel=True).tp_plan
    for block in ("model.layers.0", "model.layers.2"):
        assert isinstance(ends[block], HeadWeights) and isinstance(ends[block].inner, HiddenStates)


def test_a_gated_deltanet_layer_splits_its_scans_heads_and_its_convolution_by_parts():
    # Qwen3.5: the scan (chunk_gated_delta_rule) is seen as attention over its heads; the conv1d runs on
    # [q | k | v], so each rank keeps its chunk of each of the three parts of its channels.
    root = hf("qwen3_5_text", **SIZES, num_key_value_heads=2, head_dim=8, intermediate_size=64,
              layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=4, linear_num_value_heads=4)
    found = plan(root)
    layer = "model.model.layers.0.linear_attn"
    assert isinstance(found.tp_plan[f"{layer}.out_proj"], RowSplit)
    assert found.tp_plan[layer].parts["conv1d.weight"] == (32, 32, 32)
    assert found.attribute_fixes[layer] == {"key_dim": 16, "value_dim": 16}
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95


def test_mamba2_layers_of_one_group_keep_b_and_c_whole_on_every_rank():
    # Bamba: in_proj -> z | x | B | C | dt with one group of B and C, which every rank's heads read; the conv1d
    # runs on x | B | C, and the mixer's conv_dim per rank is its x plus the whole B and C.
    root = hf("bamba", **SIZES, num_key_value_heads=2, intermediate_size=64, mamba_d_head=8, mamba_n_heads=8,
              mamba_d_state=8, mamba_chunk_size=16)
    found = plan(root)
    mixer = "model.model.layers.0.mamba"
    in_proj = found.tp_plan[f"{mixer}.in_proj"]
    assert (in_proj.parts, in_proj.whole) == ((64, 64, 16, 8), (False, False, True, False))
    assert found.tp_plan[mixer].whole["conv1d.weight"] == (False, True)
    assert found.attribute_fixes[mixer] == {"conv_dim": 48, "intermediate_size": 32, "num_heads": 4}


def test_a_hybrid_models_layers_of_two_classes_are_its_blocks_each_kind_split():
    # OLMo-Hybrid: three Gated DeltaNet layers, then an attention layer, each a class of its own, in one list.
    root = hf("olmo_hybrid", **{**SIZES, "num_hidden_layers": 4}, num_key_value_heads=2, intermediate_size=64,
              layer_types=["linear_attention"] * 3 + ["full_attention"], linear_key_head_dim=8,
              linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=4, pad_token_id=0)
    found = plan(root)
    assert found.blocks == [f"model.model.layers.{i}" for i in range(4)]
    assert {type(root.get_submodule(b)).__name__ for b in found.blocks} == {"OlmoHybridLinearAttentionDecoderLayer",
                                                                              "OlmoHybridAttentionDecoderLayer"}
    sharded, total = sharded_share(root, found.blocks, found.tp_plan)
    assert sharded / total > 0.95



def test_stacked_weights_without_a_router_are_not_called_experts():
    """A refusal names the real cause: Zamba's multi-head Mamba holds one matrix per head, applied by hand, with
    nothing routing among them: no mixture of experts (it was refused as one)."""
    from helpers.census.configs import tiny_config

    sizes = tiny_config("zamba")
    sizes.pop("seq_len")
    with pytest.raises(PolicyError) as refused:
        plan(hf(sizes.pop("model_type"), **sizes))
    assert "mixture-of-experts" not in str(refused.value), str(refused.value)
    assert "would leave" in str(refused.value)
