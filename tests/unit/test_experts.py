"""Where transformers' experts modules keep their intermediate features (lightning_3d/policies/experts.py), read
from the flags ``use_experts_implementation`` sets, for the layouts transformers has: Mixtral's [gate | up]
halves, gpt-oss's transposed and interleaved weights with biases, and a post-expert norm that tp cannot split."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_3d.policies.block_trace import meta_copy, trace_block  # noqa: E402
from lightning_3d.policies.experts import ExpertsLayout, experts_layout, is_experts  # noqa: E402


def _experts(model_type: str, **config):
    config = transformers.AutoConfig.for_model(model_type, **{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64), **config})
    model = transformers.AutoModelForCausalLM.from_config(config)
    return next(m for m in model.modules() if is_experts(m))


def test_mixtral_keeps_gate_and_up_as_halves_of_dim_1():
    layout, why = experts_layout(_experts("mixtral", num_local_experts=4), tp=2)
    assert layout == ExpertsLayout(up="gate_up_proj", up_dim=1, halves=True, down_dim=2, bias=False), why


def test_gpt_oss_is_transposed_interleaved_and_biased():
    experts = _experts("gpt_oss", num_local_experts=4, head_dim=8)
    layout, why = experts_layout(experts, tp=2)
    assert layout == ExpertsLayout(up="gate_up_proj", up_dim=2, halves=False, down_dim=1, bias=True), why
    assert experts.gate_up_proj.shape[2] == 2 * experts.down_proj.shape[1]  # (E, H, 2I) and (E, I, H)


def test_an_intermediate_size_tp_does_not_divide_is_refused_with_the_numbers():
    layout, why = experts_layout(_experts("mixtral", num_local_experts=4, intermediate_size=66), tp=4)
    assert layout is None and "66 intermediate features do not divide by tensor_parallel_size=4" in why


def test_a_norm_on_each_experts_output_is_refused():
    experts = _experts("mixtral", num_local_experts=4)
    experts.has_post_expert_norm = True
    layout, why = experts_layout(experts, tp=2)
    assert layout is None and "norm" in why


def test_a_block_with_experts_traces_on_meta_and_its_forward_is_put_back():
    # Routing reads values (and grouped matmuls want bf16 on meta): the trace runs a stand-in instead.
    config = transformers.AutoConfig.for_model("mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                               num_local_experts=4)
    block = meta_copy(transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp)
    trace = trace_block(block, (torch.zeros(1, 4, 32, device="meta"),), {})
    assert trace.problem is None, trace.problem
    assert "forward" not in vars(block.experts)


def test_an_experts_class_that_adds_to_the_implementation_is_refused():
    # Ergo's experts subclass the decorated projections and normalize each route's output in their own forward.
    experts = _experts("ergo", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                       num_hidden_layers=2, mlp_layer_types=["dense", "sparse"])
    layout, why = experts_layout(experts, tp=2)
    assert layout is None and "norm" in why, why
