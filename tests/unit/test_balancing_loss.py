"""The router's load-balancing loss over the global batch (lightning_3d/parallel/balancing_loss.py): which
models' forwards it reaches, and what it leaves alone. Its numbers are checked against one process in
tests/parity/test_parity_expert_parallel.py (the "_aux" cases)."""

import importlib
import pkgutil

import pytest
import torch
import transformers
import transformers.models

from helpers.hf_cases import MOE_MODELS, MORE_MOE_MODELS
from lightning_3d.errors import ParallelConfigError
from lightning_3d.parallel import balancing_loss
from lightning_3d.parallel.balancing_loss import LOSS_FUNCTION, apply_global_balancing_loss


def _build(model_type, sizes):
    sizes = {k: v for k, v in sizes.items() if k != "seq_len"}
    config = transformers.AutoConfig.for_model(model_type, **sizes)  # (the cases are configured for training: use_cache=False)
    return torch.nn.ModuleDict({"model": transformers.AutoModelForCausalLM.from_config(config)})


@pytest.mark.parametrize("model", sorted({**MOE_MODELS, **MORE_MOE_MODELS}))
def test_the_causal_lm_whose_forward_adds_the_loss_is_found_and_only_it(model):
    sizes = dict({**MOE_MODELS, **MORE_MOE_MODELS}[model])
    found = apply_global_balancing_loss(_build(sizes.pop("model_type"), sizes), group=object())
    assert found == ["model"]


def test_every_transformers_causal_lm_that_defines_the_loss_calls_it_where_it_is_found():
    """A census of transformers' modeling modules: wherever the loss function is defined, a causal LM of that
    module is found calling it (none computes it some other way this module would miss)."""
    found, missed = [], []
    for info in pkgutil.iter_modules(transformers.models.__path__):
        spec = importlib.util.find_spec(f"transformers.models.{info.name}.modeling_{info.name}")
        if spec is None or LOSS_FUNCTION not in spec.loader.get_source(spec.name):
            continue
        modeling = importlib.import_module(spec.name)
        if not hasattr(modeling, LOSS_FUNCTION):
            continue
        lms = [c for n, c in vars(modeling).items() if n.endswith("ForCausalLM") and isinstance(c, type)]
        if lms:
            (found if any(balancing_loss._calls_balancing_loss(c) for c in lms) else missed).append(info.name)
    assert len(found) >= 25 and not missed, (found, missed)


def test_outside_a_wrapped_forward_the_function_is_the_models_own():
    own = lambda gate_logits, num_experts=None, top_k=2, attention_mask=None: ("own", len(gate_logits))
    wrapped = balancing_loss._over_global_batch(own)
    logits = (torch.randn(6, 4),)
    assert wrapped(logits, 4, 2, None) == ("own", 1)
    assert wrapped.gathers_over_ranks


def test_a_padding_mask_that_does_not_match_the_ranks_logits_is_refused_before_gathering():
    """Under context parallelism a rank's logits are its part of each sequence and the mask is whole."""
    wrapped = balancing_loss._over_global_batch(lambda *a: pytest.fail("the model's own function was called"))
    balancing_loss._GROUPS.append(object())
    try:
        with pytest.raises(ParallelConfigError, match="router logits for 8 tokens.*mask of shape \\(2, 8\\)"):
            wrapped((torch.randn(8, 4),), 4, 2, torch.ones(2, 8))
    finally:
        balancing_loss._GROUPS.pop()
