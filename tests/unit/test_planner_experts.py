"""The planner's mixture of experts: parameters (all, active, per rank at ep), FLOPs of the experts a token
visits, ZeRO over the ranks that hold the same experts, the all-to-all's time, and ep in the search."""

import dataclasses

import pytest
import torch
import yaml

from helpers.hf_cases import MOE_MODELS
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.planner import PRECISIONS, Cluster, Layout, ModelSpec, estimate_memory
from lightning_3d.planner.memory import rank_expert_parameters, rank_parameters
from lightning_3d.planner.search import enumerate_layouts, plan
from lightning_3d.planner.time import estimate_step_time, step_flops

# Published configs (their config.json sizes).
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False)
OLMOE_1B_7B = dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=16, vocab_size=50304, num_experts=64,
                   num_experts_per_tok=8, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.mark.parametrize("config, total, active, rel", [
    (MIXTRAL_8X7B, 46.7e9, 12.9e9, 0.005),  # Mistral AI: 46.7B parameters, 12.9B used per token
    (OLMOE_1B_7B, 6.9e9, 1.3e9, 0.02),  # AI2: 6.9B, 1.3B active (each of its q / k norms, 2 h per layer, aside)
], ids=["mixtral_8x7b", "olmoe_1b_7b"])
def test_a_published_moe_config_gives_its_published_total_and_active_parameters(config, total, active, rel):
    model = ModelSpec.from_hf_config(config, seq_length=4096)
    assert (model.num_experts, model.experts_per_token) == (config.get("num_local_experts", config.get("num_experts")),
                                                            config["num_experts_per_tok"])
    assert model.num_parameters() == pytest.approx(total, rel=rel)
    assert model.active_parameters() == pytest.approx(active, rel=rel)


def test_a_tiny_mixtral_built_by_transformers_has_the_planners_parameter_count():
    transformers = pytest.importorskip("transformers")
    sizes = {k: v for k, v in MOE_MODELS["mixtral"].items() if k != "seq_len"}
    config = transformers.AutoConfig.for_model(**sizes)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    model = ModelSpec.from_hf_config(config, seq_length=16)
    assert model.num_parameters() == sum(p.numel() for p in built.parameters())
    assert model.num_layers * model.expert_params().total == sum(
        p.numel() for n, p in built.named_parameters() if ".experts." in n)


def test_a_rank_holds_one_ep_th_of_the_experts_and_zero_shards_them_over_the_ranks_that_hold_the_same_ones():
    model = ModelSpec.from_hf_config(MIXTRAL_8X7B, seq_length=4096)
    experts = model.num_layers * model.expert_params().total
    dense = model.num_parameters() - experts
    bf16 = PRECISIONS["bf16-mixed"]
    for ep in (1, 2, 8):
        layout = Layout(dp=8, ep=ep, zero_stage=3)
        assert rank_expert_parameters(model, layout, 0) == experts / ep
        assert rank_parameters(model, layout, 0) == dense + experts / ep
        # ZeRO: dense weights over the 8 dp ranks, experts over the 8 / ep that hold the same ones: 1/8 either way
        states = estimate_memory(model, layout, bf16, 0)
        assert states.optimizer_state == pytest.approx((dense / 8 + experts / ep / (8 // ep)) * bf16.optimizer_bytes)


def test_step_flops_count_the_experts_a_token_visits_not_all_of_them():
    moe = ModelSpec.from_hf_config(MIXTRAL_8X7B, seq_length=4096)
    one_expert = dataclasses.replace(moe, num_experts=0, experts_per_token=0, ffn_hidden_size=2 * 14336)
    # two experts of 14336 per token are one MLP of 2 x 14336; the router adds 2 h E per token
    router = 2 * 4096 * 8 * moe.num_layers * 4096 * 3  # per sequence, forward and backward
    assert step_flops(moe, 1) == pytest.approx(step_flops(one_expert, 1) + router)


def test_expert_parallel_pays_four_all_to_alls_of_the_routed_tokens_per_block_and_micro_batch():
    model = ModelSpec.from_hf_config(MIXTRAL_8X7B, seq_length=4096)
    cluster, bf16 = Cluster(nodes=1), PRECISIONS["bf16-mixed"]
    assert estimate_step_time(model, Layout(dp=8), cluster, bf16).ep_communication == 0
    layout = Layout(dp=8, ep=8, zero_stage=2, micro_batch_size=1, num_microbatches=2)
    routed = 4096 * 2 * 4096 * bf16.activation_bytes  # a sequence's tokens x top-2 x h
    wire = routed * 7 / 8  # what a rank sends the 7 others
    expected = 2 * 4 * 32 * wire / (cluster.intra_node_bandwidth_gbs * 1e9)  # m x 4 x blocks
    assert estimate_step_time(model, layout, cluster, bf16).ep_communication == pytest.approx(expected)


def test_the_search_offers_ep_dividing_dp_and_the_experts_for_moe_only_and_the_plan_writes_it():
    moe = ModelSpec.from_hf_config(MIXTRAL_8X7B, seq_length=4096)
    eps = {(l.dp, l.ep, l.cp) for l in enumerate_layouts(moe, 64, 8, 64, zero_stages=(2,), recompute=("full",))}
    assert {ep for dp, ep, cp in eps if dp == 64} == {1, 2, 4, 8}  # not 16, 32, 64: 8 experts
    assert all(ep == 1 for dp, ep, cp in eps if cp > 1)
    dense = dataclasses.replace(moe, num_experts=0, experts_per_token=0)
    assert {l.ep for l in enumerate_layouts(dense, 64, 8, 64, zero_stages=(2,), recompute=("full",))} == {1}
    result = plan(moe, Cluster.preset("h100", nodes=8), global_batch_size=256)
    ep_plans = [c for c in result.candidates if c.layout.ep > 1]
    assert ep_plans and f"ep{ep_plans[0].layout.ep}" in ep_plans[0].layout.describe()
    config = yaml.safe_load(result.to_yaml(ep_plans[0]))["trainer"]["strategy"]["init_args"]
    assert config["expert_parallel_size"] == ep_plans[0].layout.ep
    ParallelConfig(**config)
