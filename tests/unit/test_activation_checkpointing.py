"""Activation checkpointing keeps names and cuts what forward saves for backward (measured)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_3d.models import GPTConfig, GPTLightningModule
from lightning_3d.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.gpt import GPTPolicy

CONFIG = GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=64)


def saved_bytes_and_grads(mode):
    torch.manual_seed(0)
    module = GPTLightningModule(config=CONFIG)
    module.configure_model()
    if mode:
        apply_activation_checkpointing(module, GPTPolicy().plan(module, PlanOptions()), mode)
    tokens = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(module.model(tokens).flatten(0, 1), tokens.flatten())
    forward_saved = sum(saved)
    loss.backward()
    return forward_saved, loss.item(), {n: p.grad.clone() for n, p in module.named_parameters()}, module


def test_full_checkpointing_saves_well_under_forty_percent_and_changes_nothing_else():
    plain_bytes, plain_loss, plain_grads, plain = saved_bytes_and_grads(None)
    full_bytes, full_loss, full_grads, full = saved_bytes_and_grads("full")
    selective_bytes, *_ = saved_bytes_and_grads("selective")
    print(f"saved for backward per micro-batch: none {plain_bytes} B, selective {selective_bytes} B"
          f" ({selective_bytes / plain_bytes:.0%}), full {full_bytes} B ({full_bytes / plain_bytes:.0%})")
    assert full_bytes < 0.4 * plain_bytes  # "well over 60%" cut
    assert full_bytes < selective_bytes < plain_bytes
    assert [n for n, _ in full.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert full_loss == plain_loss
    assert all(torch.allclose(full_grads[n], plain_grads[n], atol=1e-6) for n in plain_grads)


def test_checkpointing_dropout_under_tensor_parallelism_is_refused():
    module = GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, dropout=0.1))
    module.configure_model()
    plan = GPTPolicy().plan(module, PlanOptions(tp=2))
    with pytest.raises(PolicyError, match="recompute would draw other dropout masks"):
        apply_activation_checkpointing(module, plan, "full")
