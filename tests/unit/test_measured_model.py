"""The planner's description of a model no config describes, measured on the model on fake tensors
(lightning_3d/strategies/measure_model.py, planner.model.MeasuredCosts): parameters per piece, FLOPs per token and
bytes saved for backward against hand counts, and against the formulas for a model they also describe."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.user_models import NanoGPTModule, StoryLMModule
from lightning_3d.errors import ParallelConfigError
from lightning_3d.models import GPTConfig, GPTLightningModule
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.parallelize import plan_model
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import PRECISIONS, block_activation_bytes, estimate_memory, rank_parameters
from lightning_3d.planner.model import ModelSpec, model_spec
from lightning_3d.planner.time import block_forward_flops, head_forward_flops, step_flops
from lightning_3d.policies import Plan
from lightning_3d.policies.registry import resolve_policy
from lightning_3d.strategies.auto_layout import assumed_calibration, ranked
from lightning_3d.strategies.measure_model import measured_model_spec

S, H, HEADS, V, LAYERS, BATCH = 16, 32, 4, 64, 2, 8
CPU = torch.device("cpu")


def on_meta(module_class):
    module = module_class(config=GPTConfig(n_layer=LAYERS, n_embd=H, n_head=HEADS, block_size=S, vocab_size=V))
    with torch.device("meta"):
        module.configure_model()
    return module


def batch():
    return torch.zeros(BATCH, S, dtype=torch.long), torch.zeros(BATCH, S, dtype=torch.long)


def measured(module, precision="32-true", tp_sizes=(2,)):
    policy = resolve_policy("auto")
    plans = {tp: plan_model(policy, module, ParallelConfig(), tp) for tp in tp_sizes}
    return measured_model_spec(module, plan_model(policy, module, ParallelConfig(), 1), plans, batch(), device=CPU,
                               precision=precision)


def test_a_module_that_holds_a_gpt_config_but_not_the_reference_gpt_is_measured_not_read_from_the_config():
    # The users' modules of the tests keep the harness's GPTConfig for their sizes; its architecture is theirs.
    # Read as the reference GPT, a StoryLM (no attention biases, an MLP three times the width) was planned with
    # the GPT's parameters and tensors.
    assert model_spec(on_meta(StoryLMModule), S) is None
    assert model_spec(on_meta(GPTLightningModule), S) == ModelSpec.from_gpt_config(on_meta(GPTLightningModule).config,
                                                                                   seq_length=S)


def test_parameters_per_piece_are_the_models_split_as_the_policys_plan_splits_them():
    spec = measured(on_meta(StoryLMModule))
    costs = spec.measured
    # A block: q, k, v, o (h x h, no bias); up (h x 3h + 3h) and down (3h x h + h); two LayerNorms (2h each).
    # The plan splits q, k, v, up column-wise (weights and biases) and o, down row-wise (weights; down's bias
    # is added after the reduction, whole), the norms stay whole.
    assert (costs.block.split, costs.block.replicated) == (4 * H * H + 3 * H * H + 3 * H + 3 * H * H, H + 4 * H)
    assert (costs.embedding.split, costs.embedding.replicated) == (V * H, S * H)  # vocabulary-parallel; positions
    assert (costs.head.split, costs.head.replicated) == (V * H, 2 * H)  # the head over the vocabulary; final norm
    assert costs.tied_head.total == 0 and costs.tp_sizes == (1, 2)
    module = on_meta(StoryLMModule)
    assert spec.num_parameters() == sum(p.numel() for p in module.parameters())
    layout = Layout(tp=2, pp=2, micro_batch_size=2, num_microbatches=4)
    assert rank_parameters(spec, layout, 1) == costs.block.split / 2 + costs.block.replicated + V * H / 2 + 2 * H


def test_a_tied_head_counts_once_and_as_the_last_stages_copy_under_a_pipeline():
    module = on_meta(NanoGPTModule)  # the head's weight is the token embedding's
    spec = measured(module)
    assert spec.measured.tied_head.total == V * H and spec.measured.head.total == 2 * H  # the final norm alone
    assert spec.num_parameters() == sum(p.numel() for p in module.parameters())
    assert spec.head_params(1).total == 2 * H and spec.head_params(2).total == 2 * H + V * H


class MLPAttentionBlock(nn.Module):
    """The smallest block a hand count covers: attention (separate q, k, v, o) and an MLP (up, GELU, down)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(width, hidden, bias=False), nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))
        return x + self.down(F.gelu(self.up(x)))


class HandCountLM(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(MLPAttentionBlock(H, HEADS, hidden) for _ in range(LAYERS))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class HandCountModule(NanoGPTModule):
    def configure_model(self):
        if self.model is None:
            self.model = HandCountLM(hidden=3 * H)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_flops_and_saved_bytes_per_token_match_a_hand_count_of_an_mlp_and_attention_block(precision):
    spec = measured(on_meta(HandCountModule), precision)
    f = 3 * H
    # Forward FLOPs per token, 2 per multiply-add: q, k, v, o (4 h^2), up and down (2 h f), and attention's two
    # products over the whole sequence (2 s h each, counted as the planner counts them: not halved for causal).
    assert spec.measured.block_flops_per_token == 2 * (4 * H * H + 2 * H * f) + 4 * S * H
    assert spec.measured.head_flops_per_token == 2 * H * V
    # Saved for backward, per sequence, on the CPU's kernels. Whole on every tp rank: the block's input, which
    # q, k and v read (under autocast each casts its own bf16 copy: three), and the residual the MLP's up reads
    # (one copy). Split over tp: q, k, v, the fused attention's output and its fp32 log-sum-exp per head and
    # token, GELU's input and output (down's input).
    e = 4 if precision == "32-true" else 2
    whole = 2 * S * H * 4 if e == 4 else (3 + 1) * S * H * 2
    split = 3 * S * H * e + S * H * e + HEADS * S * 4 + 2 * S * f * e
    measured_bytes = spec.measured.block_whole_bytes_per_sequence, spec.measured.block_split_bytes_per_sequence
    assert measured_bytes == (whole, split)
    layout = Layout(tp=2, micro_batch_size=4)
    assert block_activation_bytes(spec, layout, PRECISIONS[precision]) == 4 * (whole + split / 2)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_model_the_formulas_also_describe_gets_the_formulas_numbers_measured(precision):
    """StoryLM is a GPT in all but names: LayerNorm, separate q, k, v, an MLP of 3h, SDPA, learned positions. Its
    measured FLOPs and activations equal the formulas' for those sizes, layout by layout."""
    spec = measured(on_meta(StoryLMModule), precision)
    formula = ModelSpec(num_layers=LAYERS, hidden_size=H, num_heads=HEADS, vocab_size=V, seq_length=S,
                        ffn_hidden_size=3 * H, fused_qkv=False, key_bias=False)
    p = PRECISIONS[precision]
    assert block_forward_flops(spec, BATCH * S) == block_forward_flops(formula, BATCH * S)
    assert head_forward_flops(spec, BATCH * S) == head_forward_flops(formula, BATCH * S)
    assert step_flops(spec, BATCH, "full") == step_flops(formula, BATCH, "full")
    for layout in (Layout(micro_batch_size=8), Layout(tp=2, micro_batch_size=8),
                   Layout(pp=2, micro_batch_size=2, num_microbatches=4, recompute="selective")):
        assert block_activation_bytes(spec, layout, p) == block_activation_bytes(formula, layout, p), layout
        for rank in range(layout.pp):
            ours, theirs = estimate_memory(spec, layout, p, rank), estimate_memory(formula, layout, p, rank)
            # (within the first stage's position ids, s int64 per micro-batch, which a measurement of a batch of 8
            # counts per sequence: 2 micro-batches in flight under pp=2)
            assert ours.activations == pytest.approx(theirs.activations, abs=2 * S * 8), (layout, rank)


def test_the_search_takes_only_the_tp_sizes_the_policys_plan_splits_the_measured_model_by():
    spec = measured(on_meta(StoryLMModule), tp_sizes=(2,))
    candidates = ranked(spec, ParallelConfig(layout="auto"), world_size=4, per_node=4, batch_size=8,
                        precision=PRECISIONS["32-true"], memory_per_rank=2**30, calibration=assumed_calibration(spec))
    assert candidates and {c.layout.tp for c in candidates} == {1, 2}
    assert math.isclose(candidates[0].time.model_flops, step_flops(spec, candidates[0].layout.global_batch_size))


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(LAYERS))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x * x.detach().abs().max().item()  # a tensor's value, read in the forward


class ReadsValuesModule(NanoGPTModule):
    def configure_model(self):
        if self.model is None:
            self.model = ReadsValues()


def test_a_forward_that_reads_tensor_values_is_refused_naming_that():
    module = on_meta(ReadsValuesModule)
    plan = Plan(blocks=["model.blocks.0", "model.blocks.1"], pipeline_root="model")
    with pytest.raises(ParallelConfigError, match=r"measures ReadsValuesModule's model on fake tensors.*reads tensor"
                                                  r" values"):
        measured_model_spec(module, plan, {}, batch(), device=CPU, precision="32-true")
