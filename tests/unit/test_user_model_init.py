"""A model built in ``configure_model()`` starts from the weights it was written to have, on every layout.

The meta route (build on meta, replay ``reset_parameters()``) is taken only where a record of the build proves
it equivalent (``lightning_3d.parallel.init_record``); models that initialize themselves otherwise -- nanoGPT's
``self.apply(self._init_weights)``, Hugging Face's ``post_init()`` -- are built again on the host as written.
Unit tests of that judgement; the user's view -- first-step loss and initial weights equal one process's at
dp=2, tp=2 and pp=2 (helpers/user_models.py, written independently of our policies) -- is
parity/test_parity_user_model_init.py."""

import copy

import pytest
import torch
from torch import nn

from helpers.toy_model import ToyLM
from helpers.user_models import NanoGPT, PublishedGPT
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.init_record import ConstructionRecord, ModuleAttributes
from lightning_3d.parallel.weight_init import materialize, replay_init

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64)


def record_build(build):
    """Build on meta under a record, as ThreeDStrategy does; the model sits at "model" as in a LightningModule."""
    record = ConstructionRecord()
    with torch.device("meta"), record:
        root = nn.ModuleDict({"model": build()})
    return root, record


def eager_and_replayed(build, order_from_record=True):
    torch.manual_seed(5)
    eager = nn.ModuleDict({"model": build()})
    after_eager = torch.get_rng_state()
    torch.manual_seed(5)
    start = torch.get_rng_state()
    root, record = record_build(build)
    skeleton = copy.deepcopy(root)
    materialize(root, torch.device("cpu"))  # as the strategy does: a tied weight stays one tensor
    replay_init(skeleton, root, start, order=record.reset_order(root) if order_from_record else None)
    return eager, root, after_eager


@pytest.mark.parametrize("build", [lambda: GPT(TINY), ToyLM, lambda: PublishedGPT(64, 16, 2, 32, 4)],
                         ids=["reference_gpt", "toy_lm", "nanogpt_as_published_tied"])
def test_models_that_init_in_reset_parameters_are_proven_replayable_and_replay_bit_for_bit(build):
    root, record = record_build(build)
    assert record.verdict(root) is None
    eager, replayed, after_eager = eager_and_replayed(build)
    for name, tensor in eager.state_dict().items():
        assert torch.equal(replayed.state_dict()[name], tensor), name
    assert torch.equal(torch.get_rng_state(), after_eager)


def test_a_tied_weight_replays_to_its_eager_value_on_a_stage_that_holds_only_one_end():
    # The first pipeline stage holds the embedding, not the head whose reset ran last in the eager build.
    build = lambda: PublishedGPT(64, 16, 2, 32, 4)  # noqa: E731
    torch.manual_seed(5)
    eager = nn.ModuleDict({"model": build()})
    torch.manual_seed(5)
    start = torch.get_rng_state()
    root, record = record_build(build)
    skeleton = copy.deepcopy(root)
    materialize(root, torch.device("cpu"))
    root["model"].lm_head.register_parameter("weight", None)  # the last stage's end
    replay_init(skeleton, root, start, order=record.reset_order(root))
    assert torch.equal(root["model"].transformer.wte.weight, eager["model"].transformer.wte.weight)


def test_init_in_the_parent_is_refused_naming_the_line_of_code():
    root, record = record_build(lambda: NanoGPT(64, 16, 2, 32, 4))
    why = record.verdict(root)
    assert why is not None and "outside any reset_parameters()" in why
    assert "user_models.py" in why and "in _init_weights" in why, why


class Mask(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("causal", torch.tril(torch.ones(4, 4)))  # made at construction, never reset


class Scaled(nn.Module):
    """Has reset_parameters() for its weight, but its scale comes from torch.ones and is never reset."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.scale = nn.Parameter(torch.ones(4))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight)


class Nested(nn.Module):
    """Its reset draws, calls a child's reset, draws again: replay cannot run it as one unit."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.a, self.b = nn.Parameter(torch.empty(4)), nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.a)
        self.child.reset_parameters()
        nn.init.normal_(self.b)


@pytest.mark.parametrize(("build", "expected"), [
    (Mask, "model.causal gets its value when it is created"),
    (Scaled, "model.scale gets its value when it is created"),
    (Nested, "reset_parameters() of model runs another module's reset_parameters() between its own draws"),
])
def test_tensors_replay_would_not_reproduce_are_named(build, expected):
    root, record = record_build(build)
    assert expected in (record.verdict(root) or ""), record.verdict(root)


class BuiltOutOfOrder(nn.Module):
    """Builds ``second`` before ``first`` but registers ``first`` first: replay in registration order would
    swap their random draws."""

    def __init__(self):
        super().__init__()
        second = nn.Linear(4, 4)
        first = nn.Linear(4, 4)
        self.first, self.second = first, second


def test_replay_follows_the_order_construction_ran_the_resets():
    eager, replayed, _ = eager_and_replayed(BuiltOutOfOrder)
    assert torch.equal(replayed["model"].first.weight, eager["model"].first.weight)
    _, by_registration, _ = eager_and_replayed(BuiltOutOfOrder, order_from_record=False)
    assert not torch.equal(by_registration["model"].first.weight, eager["model"].first.weight)


def test_a_hugging_face_model_is_replayable_only_when_its_parameters_are_loaded():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    root, record = record_build(lambda: transformers.LlamaForCausalLM(config))
    assert "post_init() initializes it and is skipped on the meta device" in record.verdict(root)
    # Loaded: only buffers count, and the policy's init_module gives the rotary frequencies theirs.
    assert record.verdict(root, init_module=lambda module: None, params_loaded=True) is None
    assert "rotary_emb.inv_freq gets its value when it is created" in record.verdict(root, params_loaded=True)


def test_configure_model_can_run_again_from_the_attributes_it_started_with():
    module = nn.Module()
    module.model = None
    module.note = "kept"
    before = ModuleAttributes(module)
    module.model = nn.Linear(2, 2)  # what configure_model() does
    module.extra = 3
    before.restore(module)
    assert module.model is None and not hasattr(module, "extra") and module.note == "kept"
    assert dict(module.named_children()) == {}
