"""Hugging Face GPT-2 (``policy="gpt2"``, lightning_3d.policies.hf_gpt2): the plan as data, its errors, the
Conv1D styles and strided checkpoint boxes on one process (parity with the single-process HF model at (dp, pp,
tp) layouts, weights in and out: parity/test_parity_hf_gpt2.py)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.hf_cases import GPT2_SIZES, NO_DROPOUT
from lightning_3d.policies import PlanOptions, PolicyError, resolve_policy
from lightning_3d.policies.projections import ColumnSplit, RowSplit

transformers = pytest.importorskip("transformers")

SIZES = GPT2_SIZES


def _root(**sizes) -> nn.Module:
    """A LightningModule-like root holding the model as ``model`` (the FQNs the strategy sees)."""
    root = nn.Module()
    root.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**SIZES, **NO_DROPOUT, **sizes}))
    return root


# ---------------------------------------------------------------------------------------------- the plan


def test_plan_names_the_stages_the_tie_and_the_per_rank_attention_sizes():
    plan = resolve_policy("gpt2").plan(_root(), PlanOptions(tp=2))
    assert plan.blocks == [f"model.transformer.h.{i}" for i in range(4)]
    assert plan.pipeline_root == "model"
    assert plan.before == ["model.transformer.wte", "model.transformer.wpe", "model.transformer.drop"]
    assert plan.after == ["model.transformer.ln_f", "model.lm_head"]
    assert plan.tied_parameters == [("model.transformer.wte.weight", "model.lm_head.weight")]
    assert plan.attribute_fixes["model.transformer.h.3.attn"] == {"split_size": 16, "embed_dim": 16, "num_heads": 2}
    assert isinstance(plan.tp_plan["model.transformer.h.*.attn.c_attn"], ColumnSplit)
    assert plan.tp_plan["model.transformer.h.*.attn.c_attn"].parts == 3
    assert isinstance(plan.tp_plan["model.transformer.h.*.mlp.c_proj"], RowSplit)
    assert plan.forward_as_written and plan.stage_forward is None  # each stage runs GPT-2's own forward
    assert plan.sharded_rng_regions == []  # no dropout


def test_auto_picks_gpt2_and_tp1_has_no_tp_plan():
    plan = resolve_policy("auto").plan(_root(), PlanOptions(tp=1))
    assert plan.tp_plan == {} and plan.attribute_fixes == {}
    assert plan.tied_parameters == [("model.transformer.wte.weight", "model.lm_head.weight")]


def test_sequence_parallel_adds_norms_the_sequence_split_and_dropout_streams():
    plan = resolve_policy("gpt2").plan(_root(attn_pdrop=0.1), PlanOptions(tp=2, sequence_parallel=True))
    for norm in ("model.transformer.h.*.ln_1", "model.transformer.h.*.ln_2", "model.transformer.ln_f",
                 "model.transformer.drop"):
        assert norm in plan.tp_plan
    assert plan.sharded_rng_regions == ["model.transformer.h.*.attn", "model.transformer.h.*.mlp.dropout"]


def test_untied_head_has_no_tied_pair():
    root = _root(tie_word_embeddings=False)
    assert resolve_policy("gpt2").plan(root, PlanOptions(tp=2)).tied_parameters == []


def test_forced_on_another_model_names_the_class_and_the_expected_modules():
    root = nn.Module()
    root.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4))
    with pytest.raises(PolicyError, match=r"GPT2LMHeadModel inside Module: it expects .*transformer\.wte.*"
                                          r"attn\.c_attn.*lm_head"):
        resolve_policy("gpt2").plan(root, PlanOptions(tp=2))


def test_heads_not_divisible_by_tp_lists_the_allowed_tp_sizes():
    with pytest.raises(PolicyError, match=r"n_head \(4\) is not divisible by tensor_parallel_size \(3\).*"
                                          r"may be \[1, 2, 4\]"):
        resolve_policy("gpt2").plan(_root(vocab_size=66, n_embd=36), PlanOptions(tp=3))


def test_vocabulary_not_divisible_by_tp_says_what_to_pad_to():
    with pytest.raises(PolicyError, match="vocab_size \\(65\\) is not divisible .* set vocab_size=66"):
        resolve_policy("gpt2").plan(_root(vocab_size=65), PlanOptions(tp=2))


# ---------------------------------------------------------------------------------------------- one process


@pytest.fixture
def fake_world():
    """A 2-rank fake process group in this process: DTensor placements and local slices, no communication
    (conftest's each_test_starts_without_a_process_group ends it after the test)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    return torch.distributed.device_mesh.init_device_mesh("cpu", (2,))


def test_conv1d_styles_place_columns_rows_and_fused_qkv_per_head(fake_world):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers.pytorch_utils import Conv1D

    layers = nn.ModuleDict({"qkv": Conv1D(12, 4), "up": Conv1D(8, 4), "down": Conv1D(4, 8)})
    full = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    parallelize_module(layers, fake_world, {"qkv": ColumnSplit(parts=3), "up": ColumnSplit(),
                                            "down": RowSplit()}, src_data_rank=None)  # slice locally
    assert layers["up"].weight.placements == (Shard(1),) and layers["up"].bias.placements == (Shard(0),)
    assert layers["down"].weight.placements == (Shard(0),) and layers["down"].bias.placements == (Replicate(),)
    # rank 1 of 2 holds the second half of each of q, k, v: columns [2:4], [6:8], [10:12]
    expected = torch.cat([full["qkv"][:, 2:4], full["qkv"][:, 6:8], full["qkv"][:, 10:12]], dim=1)
    assert torch.equal(layers["qkv"].weight.to_local(), expected)


def test_strided_shard_is_three_boxes_for_checkpoints(fake_world):
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_3d.checkpoint.boxes import is_strided, local_boxes

    qkv = distribute_tensor(torch.zeros(4, 12), fake_world, [_StridedShard(1, split_factor=3)], src_data_rank=None)
    assert local_boxes(qkv) == [((0, c), (4, 2), (slice(0, 4), slice(l, l + 2))) for c, l in ((2, 0), (6, 2), (10, 4))]
    assert is_strided(qkv)
    plain = distribute_tensor(torch.zeros(4, 12), fake_world, [Shard(1)], src_data_rank=None)
    assert local_boxes(plain) == [((0, 6), (4, 6), (slice(0, 4), slice(0, 6)))] and not is_strided(plain)
