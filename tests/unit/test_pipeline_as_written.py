"""A user's model pipelines as written: ``policy="auto"`` finds its blocks, root, embeddings and head, and each
stage runs the model's own, unchanged forward (``lightning_3d.pipeline.as_written``).

The models (helpers/user_models.py) were written without lightning_3d in mind: nanoGPT (blocks in a ModuleList,
``x = wte(idx) + wpe(arange)``, tied embedding and head) and Meta's reference Llama layout (blocks called with
a mask the forward builds from the caller's padding mask). Their runs under every schedule:
parity/test_parity_pipeline_as_written.py."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from helpers.user_models import LlamaStyleLM, NanoGPT
from lightning_3d.pipeline.as_written import PassThroughBlock, Shell
from lightning_3d.pipeline.split import check_splittable, split_stages
from lightning_3d.pipeline.step_checks import StepPatternError
from lightning_3d.policies import Plan, PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.auto_pipeline import with_pipeline


def planned(root: nn.Module, options: PlanOptions) -> Plan:
    """What the strategy plans for ``root``: the "auto" plan, completed for a pipeline."""
    return with_pipeline(root, AutoPolicy().plan(root, options))


def wrapped(model: nn.Module) -> nn.Module:
    """The model as a LightningModule holds it (``self.model``)."""
    return nn.ModuleDict({"model": model})


def test_auto_finds_root_embeddings_head_and_tied_weights_by_structure():
    plan = planned(wrapped(NanoGPT(64, 16, 4, 32, 4)), PlanOptions())
    assert plan.pipeline_root == "model" and plan.forward_as_written
    assert plan.blocks == [f"model.h.{i}" for i in range(4)]
    assert plan.before == ["model.wte", "model.wpe"] and plan.after == ["model.ln_f", "model.lm_head"]
    assert plan.tied_parameters == [("model.wte.weight", "model.lm_head.weight")]

    plan = planned(wrapped(LlamaStyleLM(64, 2, 32, 4)), PlanOptions())
    assert (plan.before, plan.after, plan.tied_parameters) == (["model.tok_embeddings"],
                                                               ["model.norm", "model.output"], [])


@pytest.mark.parametrize("build, call", [
    (lambda: NanoGPT(64, 16, 4, 32, 4), lambda model, tokens: model(tokens)),
    (lambda: LlamaStyleLM(64, 4, 32, 4), lambda model, tokens: model(tokens, (tokens > 3).long())),
], ids=["nanogpt", "llama_style_with_mask"])
def test_two_stages_chained_in_one_process_give_the_models_own_output(build, call):
    torch.manual_seed(0)
    model = build()
    tokens = torch.randint(0, 64, (2, 16))
    expected = call(model, tokens)
    root = wrapped(copy.deepcopy(model))
    plan = planned(root, PlanOptions())
    first, second = split_stages(root, plan, [plan.blocks[:2], plan.blocks[2:]], [0, 1])
    captured = {}
    call(_Capture(captured), tokens)  # what the engine does: the model call's structure, for every stage
    first.forward.inputs.spec = tree_flatten((captured["args"], captured["kwargs"]))[1]
    sent = first(*captured["args"], **captured["kwargs"])
    assert isinstance(sent, tuple) and sent[0].shape == (2, 16, 32)  # the activation, then the model's inputs
    assert torch.equal(second(*sent), expected)
    # Each stage holds only its own parameters; the others' places are parameterless placeholders.
    held = {name for name, _ in first.named_parameters()}
    assert not any(name.startswith(("h.2", "h.3", "layers.2", "layers.3", "lm_head", "output")) for name in held)
    assert any(isinstance(m, (PassThroughBlock, Shell)) for m in second.modules())


class _Capture(nn.Module):
    def __init__(self, captured):
        super().__init__()
        self.captured = captured

    def forward(self, *args, **kwargs):
        self.captured.update(args=args, kwargs=kwargs)


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)


class RootPositions(nn.Module):
    """Holds a position table as a bare parameter on the root, which every stage runs."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(16, 32))
        self.h = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))


def test_a_model_that_cannot_be_cut_fails_naming_what_was_found():
    root = wrapped(NoBlocks())
    with pytest.raises(PolicyError, match=r"no repeated blocks.*model \(NoBlocks\)"):
        check_splittable(root, planned(root, PlanOptions()))
    root = wrapped(RootPositions())
    with pytest.raises(PolicyError, match=r"\['model.pos'\] are held directly by 'model'"):
        check_splittable(root, planned(root, PlanOptions()))


class EarlyExitGPT(NanoGPT):
    """Stops once the activation grows too large: control flow on values only the earlier stages have."""

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
            if x.abs().max() > 1e3:  # never true here: the branch is taken nowhere, yet it must be refused
                break
        return self.lm_head(self.ln_f(x))


class ScaledAfterBlock1GPT(NanoGPT):
    """Scales the activation after block 1 only: where a 2 + 2 split cuts, so neither stage would run it."""

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.h):
            x = block(x)
            if i == 1:
                x = x * 0.5
        return self.lm_head(self.ln_f(x))


class GuardedGPT(NanoGPT):
    """Legal everywhere: branches on the model's own inputs (every stage has them) and changes the activation
    inside the first stage (between blocks 0 and 1), where that stage runs it on the real values."""

    def forward(self, idx):
        if (idx < 0).any():
            raise ValueError("negative token ids")
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.h):
            if i == 1 and idx.shape[1] > 1:  # sizes are known on every stage
                x = x * 0.5
            x = block(x)
        return self.lm_head(self.ln_f(x))


def two_stages(model: nn.Module, tokens: torch.Tensor) -> tuple:
    """The model split 2 + 2 in one process, and the first stage's output for ``tokens``."""
    root = wrapped(model)
    plan = planned(root, PlanOptions())
    first, second = split_stages(root, plan, [plan.blocks[:2], plan.blocks[2:]], [0, 1])
    first.forward.inputs.spec = tree_flatten(((tokens,), {}))[1]
    return second, first(tokens)


@pytest.mark.parametrize("model, found", [
    (EarlyExitGPT, r"reads the value of a tensor computed before block 'h.2' \(__bool__\) at .*"
                   r"test_pipeline_as_written.py:\d+: if x.abs\(\).max\(\) > 1e3.*Stage 1 of the pipeline"),
    (ScaledAfterBlock1GPT, r"Block 'h.1', where stage 0 of the pipeline ends, returned something else than the"
                           r" first block gets: the forward changes or skips the activation between 'h.1' and"
                           r" 'h.2'"),
], ids=["control_flow_on_activation", "activation_changed_where_stages_meet"])
def test_a_forward_that_needs_another_stages_values_fails_at_the_first_call_naming_the_pattern(model, found):
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    second, sent = two_stages(model(64, 16, 4, 32, 4), tokens)
    with pytest.raises(StepPatternError, match=found):
        second(*sent)


def test_branches_on_the_inputs_or_inside_one_stage_run_as_in_one_process_and_later_calls_skip_the_checks():
    torch.manual_seed(0)
    model, tokens = GuardedGPT(64, 16, 4, 32, 4), torch.randint(0, 64, (2, 16))
    expected = model(tokens)
    second, sent = two_stages(copy.deepcopy(model), tokens)
    assert torch.equal(second(*sent), expected)
    assert second.forward.checked  # the second call runs without the watch
    assert torch.equal(second(*sent), expected)
