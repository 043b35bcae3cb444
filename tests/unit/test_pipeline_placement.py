"""A forward as people write it pipelines as written (``lightning_3d.pipeline.as_written``) with one process's
output, or fails at a stage's first call naming the module -- never a silently wrong result:

* the modules outside the blocks go to the stage on whose side of the blocks the forward uses them, not the
  side they are registered on (OPT registers its final norm before its layers);
* blocks that return a tuple the forward indexes (``hidden = block(hidden)[0]``: BLOOM, GPT-Neo, MPT, Falcon),
  or pass each other more than the activation (GLM-MoE-DSA's top-k indices), and forwards that read a
  block's attributes;
* a forward that reads an attribute of a module another stage holds (``embed.weight.device``: Llama 4);
* a stage whose output would be made of a placeholder's zeros (a module placed on the wrong side, an
  embedding's weight read again as the head's), of values collected from inside its blocks (an auxiliary
  loss over every block's router logits), or would not depend on the activation it receives.

Two stages run in one process, chained as the pipeline chains them; their runs on ranks are in
parity/test_parity_pipeline_as_written.py."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from helpers.hf_cases import MOE_MODELS, PIPELINE_HF_MODELS
from lightning_3d.pipeline.split import split_stages
from lightning_3d.pipeline.step_checks import StepPatternError
from lightning_3d.policies import Plan, PlanOptions
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_pipeline import with_pipeline


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class NormFirstLM(nn.Module):
    """Registers its final norm before its blocks and calls it after them, as OPT's decoder does."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.final_norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


class TupleBlock(Residual):
    def __init__(self, width: int, wrap) -> None:
        super().__init__(width)
        self.wrap = wrap

    def forward(self, x):
        return self.wrap(super().forward(x))


class TupleBlocksLM(NormFirstLM):
    """Blocks that return their activation in a tuple or list, indexed by the forward."""

    def __init__(self, wrap) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TupleBlock(32, wrap) for _ in range(4))

    def forward(self, idx):
        x = self.embed(idx.to(self.embed.weight.device))  # reads an attribute of another stage's module
        for block in self.blocks:
            outputs = block(x)
            x = outputs[0]
        return self.head(self.final_norm(x))


class IndexBlock(Residual):
    def __init__(self, width: int, takes_previous: bool) -> None:
        super().__init__(width)
        self.takes_previous = takes_previous

    def forward(self, x, previous=None):
        h = self.fc(x) if previous is None else self.fc(x) + 0.1 * previous
        return x + torch.tanh(h), h.argmax(-1, keepdim=True)  # (activation, an index the next block takes)


class IndexPassingLM(NormFirstLM):
    """Each block takes an index the one before it returned, where the block says it does (an attribute the
    forward reads), as GLM-MoE-DSA's layers pass their top-k indices on."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(IndexBlock(32, takes_previous=i % 2 == 0) for i in range(4))

    def forward(self, idx):
        x, index = self.embed(idx), None
        for block in self.blocks:
            x, index = block(x, index if block.takes_previous else None)
        return self.head(self.final_norm(x))


class EmbeddingAsHeadLM(NormFirstLM):
    """Reads the embedding's weight again after the blocks, as its head: no module of its own for it."""

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.final_norm(x), self.embed.weight)


class IgnoresReceivedLM(NormFirstLM):
    """Its head reads features of the token ids, not what the blocks made of them."""

    def forward(self, idx):
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.final_norm(F.one_hot(idx % h.shape[-1], h.shape[-1]).float()))


class CollectingLM(NormFirstLM):
    """Adds a term made of every block's inner activations, which hooks collect during the forward (as
    transformers collects router logits for an auxiliary load-balancing loss)."""

    def forward(self, idx):
        collected = []
        handles = [m.register_forward_hook(lambda _m, _args, out: collected.append(out))
                   for name, m in self.named_modules() if name.endswith(".fc")]
        try:
            logits = super().forward(idx)
        finally:
            for handle in handles:
                handle.remove()
        return logits + 0.01 * sum(c.pow(2).mean() for c in collected)


def planned(model: nn.Module) -> tuple[nn.Module, Plan]:
    root = nn.ModuleDict({"model": model})  # as a LightningModule holds it (self.model)
    return root, with_pipeline(root, AutoPolicy().plan(root, PlanOptions()))


def chained(root: nn.Module, plan: Plan, args: tuple = (), kwargs: dict | None = None, split: int | None = None):
    """The output of two stages chained as the pipeline chains them: ``split`` blocks (half) on the first."""
    kwargs, root = kwargs or {}, copy.deepcopy(root)
    split = len(plan.blocks) // 2 if split is None else split
    first, second = split_stages(root, plan, [plan.blocks[:split], plan.blocks[split:]], [0, 1])
    first.forward.inputs.spec = tree_flatten((args, kwargs))[1]
    return second(*first(*args, **kwargs))


def test_a_module_goes_to_the_side_of_the_blocks_the_forward_uses_it_on_not_where_it_is_registered():
    torch.manual_seed(0)
    model, tokens = NormFirstLM(), torch.randint(0, 64, (2, 8))
    root, plan = planned(copy.deepcopy(model))
    assert plan.before == ["model.embed"] and plan.after == ["model.final_norm", "model.head"]
    assert torch.equal(chained(root, plan, (tokens,)), model(tokens))


@pytest.mark.parametrize("wrap", [lambda x: (x, None), lambda x: [x]], ids=["tuple_with_attention_weights",
                                                                       "list_of_one"])
def test_blocks_that_return_tuples_and_reads_of_another_stages_attributes_run_as_in_one_process(wrap):
    # (transformers' older blocks return (hidden, attn_weights); OpenAI GPT's a list [hidden])
    torch.manual_seed(0)
    model, tokens = TupleBlocksLM(wrap), torch.randint(0, 64, (2, 8))
    root, plan = planned(copy.deepcopy(model))
    assert torch.equal(chained(root, plan, (tokens,)), model(tokens))


def test_what_blocks_pass_each_other_besides_the_activation_crosses_the_stages():
    torch.manual_seed(0)
    model, tokens = IndexPassingLM(), torch.randint(0, 64, (2, 8))
    root, plan = planned(copy.deepcopy(model))
    # 1 + 3: the index block 0 returns reaches block 1 on the same stage; block 1's, sent, reaches block 2
    assert torch.equal(chained(root, plan, (tokens,), split=1), model(tokens))
    assert torch.equal(chained(root, plan, (tokens,), split=2), model(tokens))


@pytest.mark.parametrize("build, plan_change, found", [
    (NormFirstLM, dict(before=["model.embed", "model.final_norm"], after=["model.head"]),
     r"output of stage 1 of the pipeline is computed from 'final_norm', which stage 0 holds"),
    (EmbeddingAsHeadLM, {}, r"output of stage 1 of the pipeline is computed from 'embed', which stage 0 holds"),
    (IgnoresReceivedLM, {}, r"output of stage 1 of the pipeline does not depend on the activation it receives"),
    (CollectingLM, {}, r"output of stage 1 of the pipeline derives from a value computed inside block"
                       r" 'blocks.2' other than what the block returns"),
], ids=["module_on_the_wrong_side", "embedding_weight_read_as_head", "output_ignores_the_activation",
        "values_collected_from_inside_the_blocks"])
def test_a_stage_whose_output_owes_to_a_placeholder_or_not_to_its_input_fails_at_its_first_call(
        build, plan_change, found):
    torch.manual_seed(0)
    root, plan = planned(build())
    with pytest.raises(StepPatternError, match=found):
        chained(root, replace(plan, **plan_change), (torch.randint(0, 64, (2, 8)),))


@pytest.mark.parametrize("model_type", sorted(PIPELINE_HF_MODELS))
def test_transformers_models_two_stages_give_the_models_own_logits(model_type):
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in PIPELINE_HF_MODELS[model_type].items() if k != "seq_len"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).train()
    tokens = torch.randint(2, config["vocab_size"], (2, 8))
    root, plan = planned(copy.deepcopy(model))
    output = chained(root, plan, kwargs=dict(input_ids=tokens))
    assert torch.equal(output[0] if isinstance(output, tuple) else output, model(input_ids=tokens).logits)


def test_a_mixture_of_experts_load_balancing_loss_is_refused_under_a_pipeline():
    """Mixtral with output_router_logits, called with labels: its loss adds a term from every layer's router,
    which the last stage does not have."""
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in MOE_MODELS["mixtral"].items() if k != "seq_len"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config, output_router_logits=True)).train()
    tokens = torch.randint(2, config["vocab_size"], (2, 8))
    root, plan = planned(copy.deepcopy(model))
    with pytest.raises(StepPatternError, match=r"computed inside block 'model.layers.2' .*output_router_logits=False"):
        chained(root, plan, kwargs=dict(input_ids=tokens, labels=tokens))
