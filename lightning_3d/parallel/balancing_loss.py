"""A router's load-balancing loss over the global batch, the value one process computes.

transformers' mixture-of-experts causal LMs (Mixtral, Qwen3-MoE, OLMoE, gpt-oss and the rest), called with
``labels`` and ``output_router_logits`` on, add ``router_aux_loss_coef * load_balancing_loss_func(router_logits,
num_experts, top_k, attention_mask)`` to their loss. That loss multiplies each expert's share of the routed
tokens by its mean router probability, both taken over the batch. On a data-parallel rank the batch is the
rank's own part, and a mean of products is not the product of means: neither a rank's value nor the ranks'
average is the global batch's.

:func:`apply_global_balancing_loss` wraps the function the model's forward calls. Inside that model's forward it
first gathers the router logits of every layer, and the padding mask, from every rank that holds other tokens of
the batch (the dp ranks, and the cp ranks under context parallelism), with torch's autograd-aware all-gather.
Each rank then computes the global batch's loss. The all-gather's backward sums, on the rank the logits came
from, the gradient every rank's copy of the loss sends them, and data parallelism's mean over those ranks then
leaves the one-process gradient (tests/parity/test_parity_expert_parallel.py: dp, ep and ZeRO-3). Tensor-parallel
ranks hold the same tokens and gather nothing more.

Collective: every rank of the group runs the model's forward with the same shapes whenever the loss is computed
(training and validation steps do). Elsewhere -- another model in the process, a forward on fake tensors -- the
function is the model's own.
"""

from __future__ import annotations

import inspect
from functools import wraps
from typing import Any, Callable

import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import all_gather_single

from lightning_3d.errors import ParallelConfigError

LOSS_FUNCTION = "load_balancing_loss_func"
"""The name transformers' mixture-of-experts models give the function their forward calls for the loss."""

_GROUPS: list[dist.ProcessGroup] = []
"""The group of each wrapped model's forward now running, innermost last."""


def apply_global_balancing_loss(root: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Make every submodule of ``root`` whose forward calls a load-balancing loss function compute it over the
    global batch of ``group``'s ranks (the ranks that hold the same weights and other tokens). Returns the names
    of those modules."""
    found = []
    for name, module in root.named_modules():
        namespace = _calls_balancing_loss(type(module))
        if namespace is None:
            continue
        if not getattr(namespace[LOSS_FUNCTION], "gathers_over_ranks", False):
            namespace[LOSS_FUNCTION] = _over_global_batch(namespace[LOSS_FUNCTION])
        module.register_forward_pre_hook(_enter(group))
        module.register_forward_hook(_leave, always_call=True)
        found.append(name)
    return found


def _calls_balancing_loss(cls: type) -> dict[str, Any] | None:
    """The module namespace whose ``load_balancing_loss_func`` ``cls.forward`` calls, or None."""
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    if code is None or LOSS_FUNCTION not in code.co_names or not callable(forward.__globals__.get(LOSS_FUNCTION)):
        return None
    return forward.__globals__


def _enter(group: dist.ProcessGroup) -> Callable:
    def pre_hook(module: nn.Module, args: Any) -> None:
        _GROUPS.append(group)
    return pre_hook


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    if _GROUPS:  # (always called: also after a forward, or an earlier hook, that raised before the pre-hook ran)
        _GROUPS.pop()


def _over_global_batch(own: Callable) -> Callable:
    @wraps(own)
    def global_balancing_loss(gate_logits: Any = None, num_experts: int | None = None, top_k: int = 2,
                              attention_mask: Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        group = _GROUPS[-1] if _GROUPS else None
        if group is None or not isinstance(gate_logits, tuple) or not gate_logits or any(
                isinstance(t, FakeTensor) for t in (*gate_logits, attention_mask) if t is not None):
            return own(gate_logits, num_experts, top_k, attention_mask, *args, **kwargs)
        rows = gate_logits[0].shape[0]
        if attention_mask is not None and attention_mask.numel() != rows:
            raise ParallelConfigError(
                f"The load-balancing loss gets router logits for {rows} tokens on this rank and a padding mask of"
                f" shape {tuple(attention_mask.shape)}: over context parallelism a rank's logits are its part of"
                f" each sequence and the mask is not. Train without the padding mask, or without"
                f" output_router_logits, or with context_parallel_size=1.")
        gathered = tuple(all_gather_single(t.contiguous(), 0, group) for t in gate_logits)
        mask = None if attention_mask is None else all_gather_single(
            attention_mask.float().contiguous(), 0, group).to(attention_mask.dtype)  # (gloo gathers no bool)
        return own(gathered, num_experts, top_k, mask, *args, **kwargs)

    global_balancing_loss.gathers_over_ranks = True
    return global_balancing_loss
