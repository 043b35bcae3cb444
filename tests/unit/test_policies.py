"""Policies resolve from every spec the user may pass, and plan the blocks of known and unknown models."""

import logging

import pytest
from torch import nn

from lightning_3d.models import GPTConfig, GPTLightningModule
from lightning_3d.policies import Plan, PlanOptions, Policy, PolicyError, register_policy, registered_policies, resolve_policy
from lightning_3d.policies import registry
from lightning_3d.policies.auto import AutoPolicy
from lightning_3d.policies.gpt import GPTPolicy

TINY = GPTConfig(n_layer=3, n_embd=16, n_head=2, block_size=8, vocab_size=32)


@pytest.fixture
def restore_registry():
    """The registry is module-global: leave it as the test found it."""
    saved = dict(registry._POLICIES)
    try:
        yield
    finally:
        registry._POLICIES.clear()
        registry._POLICIES.update(saved)


def gpt_module(config=TINY):
    module = GPTLightningModule(config=config)
    module.configure_model()
    return module


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class UnknownNet(nn.Module):
    """Not a GPT: three identical layers in a ModuleList, a shorter list of two, and a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(Layer(), Layer())
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(4, 2)


class FlatNet(nn.Module):
    """No repeated structure: a list of different classes, and a list whose members hold no parameters."""

    def __init__(self):
        super().__init__()
        self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)])
        self.acts = nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU())
        self.head = nn.Linear(4, 2)


# ------------------------------------------------------------------------------------------- resolve


@pytest.mark.parametrize(
    ("spec", "cls"),
    [
        ("gpt", GPTPolicy),
        ("auto", AutoPolicy),
        ("lightning_3d.policies.gpt.GPTPolicy", GPTPolicy),
        (GPTPolicy, GPTPolicy),
    ],
)
def test_resolve_policy_from_name_dotted_path_or_class_gives_an_instance(spec, cls):
    policy = resolve_policy(spec)
    assert type(policy) is cls


def test_resolve_policy_returns_an_instance_as_is():
    policy = GPTPolicy()
    assert resolve_policy(policy) is policy


def test_builtin_policies_are_registered_under_their_names():
    policies = registered_policies()
    assert policies["gpt"] is GPTPolicy and policies["auto"] is AutoPolicy
    assert GPTPolicy.name == "gpt" and AutoPolicy.name == "auto"


def test_unknown_name_lists_the_registered_names():
    with pytest.raises(PolicyError, match="Unknown policy 'mamba'") as err:
        resolve_policy("mamba")
    for name in ("auto", "gpt", "gpt2", "llama"):
        assert repr(name) in str(err.value)
    assert "register_policy" in str(err.value)


def test_dotted_path_to_a_class_that_is_not_a_policy_is_rejected():
    with pytest.raises(PolicyError, match="'lightning_3d.models.gpt.GPT' is not a subclass of .*Policy"):
        resolve_policy("lightning_3d.models.gpt.GPT")


@pytest.mark.parametrize("path", ["no_such_package.policies.MyPolicy", "lightning_3d.policies.gpt.NoSuchPolicy"])
def test_dotted_path_that_does_not_import_is_rejected(path):
    with pytest.raises(PolicyError, match=f"Cannot import policy '{path}'.*Check the module path and class name"):
        resolve_policy(path)


def test_spec_of_another_type_is_rejected():
    with pytest.raises(PolicyError, match="got int"):
        resolve_policy(3)


# ------------------------------------------------------------------------------------------ register


def test_registered_policy_resolves_by_name(restore_registry):
    @register_policy("my_net")
    class MyNetPolicy(Policy):
        def plan(self, root):
            return Plan(blocks=["layers.0"])

    assert MyNetPolicy.name == "my_net"
    assert type(resolve_policy("my_net")) is MyNetPolicy
    assert register_policy("my_net")(MyNetPolicy) is MyNetPolicy  # registering the same class again is harmless


def test_register_policy_rejects_a_taken_name_for_another_class(restore_registry):
    class OtherGPTPolicy(Policy):
        pass

    with pytest.raises(PolicyError, match=r"a policy named 'gpt' is already registered \(GPTPolicy\)"):
        register_policy("gpt")(OtherGPTPolicy)
    assert registered_policies()["gpt"] is GPTPolicy


def test_register_policy_rejects_classes_that_are_not_policies(restore_registry):
    with pytest.raises(TypeError, match="register_policy\\('not_a_policy'\\) decorates Policy subclasses"):
        register_policy("not_a_policy")(nn.Linear)
    with pytest.raises(TypeError, match="decorates Policy subclasses"):
        register_policy("an_instance")(GPTPolicy())
    assert "not_a_policy" not in registered_policies()


# ---------------------------------------------------------------------------------------------- plans


def test_gpt_policy_names_every_block_of_the_lightning_module():
    plan = GPTPolicy().plan(gpt_module())
    assert plan.blocks == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def test_gpt_policy_names_blocks_of_a_bare_gpt_without_prefix():
    plan = GPTPolicy().plan(gpt_module().model)
    assert plan.blocks == ["blocks.0", "blocks.1", "blocks.2"]


def test_gpt_policy_on_a_model_without_a_gpt_says_to_use_auto():
    with pytest.raises(PolicyError, match="found no lightning_3d.models.GPT inside UnknownNet.*policy='auto'"):
        GPTPolicy().plan(UnknownNet())


def test_auto_policy_delegates_to_gpt_for_the_gpt_module(caplog):
    module = gpt_module()
    with caplog.at_level(logging.INFO, logger="lightning_3d.policies.auto"):
        plan = AutoPolicy().plan(module)
    assert plan == GPTPolicy().plan(module)
    assert "policy='auto' uses policy='gpt' for GPTLightningModule" in caplog.text


def test_auto_policy_takes_the_longest_list_of_identical_layers_in_an_unknown_model():
    # layers (3) beats stem (2); head is not repeated.
    assert AutoPolicy().plan(UnknownNet()).blocks == ["layers.0", "layers.1", "layers.2"]


def test_auto_policy_warns_and_plans_no_blocks_without_repeated_structure(caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_3d.policies.auto"):
        plan = AutoPolicy().plan(FlatNet())
    assert plan.blocks == []
    assert "policy='auto' found no repeated blocks in FlatNet" in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_auto_policy_prefers_a_registered_policy_for_its_model_class(restore_registry):
    @register_policy("unknown_net")
    class UnknownNetPolicy(Policy):
        model_classes = (f"{UnknownNet.__module__}.{UnknownNet.__qualname__}",)

        def plan(self, root, options=PlanOptions()):
            return Plan(blocks=["stem.0", "stem.1"])

    assert AutoPolicy().plan(UnknownNet()).blocks == ["stem.0", "stem.1"]


def test_no_module_imports_transformers_at_import_time():
    """The hf extra is optional: transformers is imported inside the functions that need it, never at the top
    of a module (so the package imports, and the GPT trains, without it)."""
    import ast
    from pathlib import Path

    import lightning_3d

    offenders = []
    for path in Path(lightning_3d.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "transformers" for name in names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
