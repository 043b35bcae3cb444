"""Hugging Face Llama (and GQA): ``policy="auto"`` picks the "llama" policy, whose plan names the HF modules and
whose stages run the HF forward as written (the runs that match one process: parity/test_parity_hf_llama.py).

Tiny random configs built here; nothing is downloaded."""

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from helpers.hf_cases import LLAMA  # noqa: E402
from lightning_3d.models import GPTConfig, GPTLightningModule  # noqa: E402
from lightning_3d.policies.kv_heads import ReplicatedKVHeads  # noqa: E402
from lightning_3d.pipeline.split import split_stages  # noqa: E402
from lightning_3d.policies import PlanOptions, PolicyError, resolve_policy  # noqa: E402
from lightning_3d.policies.auto import AutoPolicy  # noqa: E402
from lightning_3d.policies.llama import LlamaPolicy  # noqa: E402


def _llama(**sizes):
    config = transformers.AutoConfig.for_model("llama", **dict({k: v for k, v in LLAMA.items() if k not in ("model_type", "seq_len")}, **sizes))
    return transformers.AutoModelForCausalLM.from_config(config)


def _root(model):
    root = torch.nn.Module()
    root.model = model
    return root


def test_auto_picks_the_llama_policy_and_the_plan_names_hf_modules():
    plan = AutoPolicy().plan(_root(_llama()), PlanOptions(tp=2, sequence_parallel=True))
    assert plan.blocks == [f"model.model.layers.{i}" for i in range(4)]
    assert plan.before == ["model.model.embed_tokens"] and plan.after == ["model.model.norm", "model.lm_head"]
    assert isinstance(plan.tp_plan["model.model.layers.*.self_attn.k_proj"], ColwiseParallel)  # 2 kv heads / tp 2
    assert "model.model.layers.*.input_layernorm" in plan.tp_plan and not plan.tied_parameters
    replicated = LlamaPolicy().plan(_root(_llama(num_key_value_heads=1)), PlanOptions(tp=4))
    assert isinstance(replicated.tp_plan["model.model.layers.*.self_attn.v_proj"], ReplicatedKVHeads)
    assert replicated.attribute_fixes["model.model.layers.0.self_attn"] == {"num_key_value_groups": 1}
    tied = LlamaPolicy().plan(_root(_llama(tie_word_embeddings=True)), PlanOptions())
    assert tied.tied_parameters == [("model.model.embed_tokens.weight", "model.lm_head.weight")]


def test_kv_heads_that_fit_no_rule_name_the_allowed_tp_sizes():
    # 3 kv heads at tp=2: 2 neither divides 3 nor is a multiple of it.
    model = _llama(hidden_size=48, num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(PolicyError, match=r"12 attention heads and 3 key/value heads .* allowed tensor_parallel_size: \[1, 3, 6, 12\]"):
        LlamaPolicy().plan(_root(model), PlanOptions(tp=2))


def test_the_llama_policy_forced_on_another_model_names_the_class_and_the_expected_modules():
    module = GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32))
    module.configure_model()
    with pytest.raises(PolicyError, match=r"found no LlamaForCausalLM .* lightning_3d.models.gpt.GPT\). It expects model.embed_tokens"):
        resolve_policy("llama").plan(module, PlanOptions(tp=2))


def test_pipeline_stages_run_the_hf_forward_as_written_and_the_last_rebuilds_its_output():
    """The policy's stages chained in one process (what the engine sends between ranks): the model's own
    logits and loss, with a padding mask and labels=; the last stage hands PipelineStage tensors only (it
    refuses a ModelOutput) and rebuilds the model's output object for the user's step."""
    torch.manual_seed(0)
    model = _llama()
    tokens = torch.randint(0, 64, (2, 16))
    mask = torch.ones_like(tokens)
    mask[0, -3:] = 0
    call = dict(input_ids=tokens, attention_mask=mask, labels=tokens)
    expected = model(**call)
    root = _root(model)
    plan = LlamaPolicy().plan(root, PlanOptions())
    first, second = split_stages(root, plan, [plan.blocks[:2], plan.blocks[2:]], [0, 1])
    first.forward.inputs.spec = tree_flatten(((), call))[1]  # set by the engine on every rank
    returned = second(*first(**call))
    assert isinstance(returned, tuple) and all(isinstance(x, torch.Tensor) for x in returned)
    output = second.forward.model_output(returned)
    assert isinstance(output, type(expected))
    assert torch.equal(output.logits, expected.logits) and torch.equal(output.loss, expected.loss)
