"""Expert parallelism: every mixture-of-experts layer's experts split over the "ep" ranks, tokens sent to their
experts' ranks and back by all-to-all.

The experts module is transformers' (``MixtralExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``...: stacked
``gate_up_proj`` / ``down_proj`` with the expert first, called as ``experts(hidden_states, top_k_index,
top_k_weights)``; :func:`~lightning_3d.policies.experts.is_dispatched_experts`). Rank ``r`` of an ep group of
``n`` keeps experts ``[r E/n, (r+1) E/n)`` of each (a DTensor ``Shard(0)`` on "ep"; under tp also split over
"tp" by each expert's intermediate features, :class:`~lightning_3d.policies.experts.ExpertsSplit`). The router
and every other weight stay as the layout has them; the ep ranks are data-parallel ranks, each with its own
tokens.

A call, on each rank (:class:`_DispatchedForward`):

1. the (token, choice) pairs are sorted by expert (a stable sort: each expert's pairs in token order), and the
   ranks exchange how many pairs each sends to each expert;
2. the pairs' hidden states and routing weights go to their experts' ranks (one all-to-all each, autograd-aware:
   torch's functional ``all_to_all_single``, whose backward is the reverse all-to-all);
3. the module's own forward runs there, on the experts that rank holds (its ``num_experts`` set to them), each
   received pair routed to one of them with its weight: whatever experts implementation the config picked;
4. the weighted outputs come back by the reverse all-to-all and are summed per token, in expert order, as the
   module's forward sums them in one process.

Gradients: the all-to-all's backward brings every expert the gradient of all the pairs routed to it, from every
rank of its ep group: the sum of ep ranks' losses where every other weight gets one rank's. The experts' weights
scale their gradient by 1/ep on its way in, so it is the ep group's average, and data parallelism then averages
it over the ranks that hold the same experts (the "dp_mod_ep" groups): the average over dp, as every other
gradient. (Not FSDP2's ``set_gradient_divide_factor``: over a group of one rank it divides twice when sums are
forced, as gloo needs.) The split sizes of step 2 are read on the host: one synchronization per layer and
micro-batch, as torchtitan's dispatch has.
"""

from __future__ import annotations

import contextlib
import inspect
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_3d.errors import ParallelConfigError
from lightning_3d.policies.base import Plan
from lightning_3d.policies.experts import ExpertsSplit, is_dispatched_experts
from lightning_3d.policies.local_tensors import shadowed


def expert_count(module: nn.Module) -> int:
    """How many experts ``module`` (:func:`~lightning_3d.policies.experts.is_dispatched_experts`) holds: its
    ``down_proj``'s first dimension."""
    return module.down_proj.shape[0]


def check_expert_parallel(root: nn.Module, plan: Plan, ep: int) -> None:
    """What expert parallelism at ``ep`` cannot do to the plan's experts modules fails here, the same on every
    rank, before any collective."""
    if not plan.experts:
        raise ParallelConfigError(
            f"expert_parallel_size={ep}, but the policy's plan names no experts module (Plan.experts): the model has"
            " no mixture-of-experts layer that policy='auto' recognizes (transformers' experts modules: stacked"
            " gate_up_proj / down_proj, called with the router's choices). Set expert_parallel_size=1, or name the"
            " experts modules in a policy of your own.")
    for name in plan.experts:
        module = root.get_submodule(name)
        if not is_dispatched_experts(module):
            raise ParallelConfigError(
                f"expert_parallel_size={ep}: {name} ({type(module).__name__}) is not a transformers experts module"
                " (stacked gate_up_proj / down_proj under use_experts_implementation), whose forward takes the"
                " routed tokens of its own experts. Set expert_parallel_size=1 for this model.")
        count = expert_count(module)
        if count % ep:
            raise ParallelConfigError(
                f"expert_parallel_size={ep} does not divide the {count} experts of {name}: every ep rank holds the same"
                f" number of them. Choose expert_parallel_size among"
                f" {[d for d in range(1, count + 1) if count % d == 0]}.")


def apply_expert_parallel(root: nn.Module, experts: list[str], tp_plan: dict, mesh: DeviceMesh) -> None:
    """Split each of the ``experts`` modules of ``root`` over ``mesh["ep"]`` (on ``mesh["ep", "tp"]`` where a style
    of ``tp_plan`` splits it over tp too) and route its calls (module docstring). Before tensor parallelism: the
    tp style then finds the weights placed and wraps this forward in its own (each rank's share summed over tp)."""
    tp_splits = {pattern: style for pattern, style in tp_plan.items() if isinstance(style, ExpertsSplit)}
    for name in experts:
        module = root.get_submodule(name)
        tp_split = next((style for pattern, style in tp_splits.items() if fnmatch(name, pattern)), None)
        weights_mesh = mesh["ep", "tp"] if tp_split is not None else mesh["ep"]
        for param_name, param in list(module.named_parameters(recurse=False)):
            placements = [Shard(0)] + ([tp_split.placements().get(param_name, Replicate())] if tp_split else [])
            split = distribute_tensor(param.data, weights_mesh, placements, src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(split, requires_grad=param.requires_grad))
        module.forward = _DispatchedForward(module, module.forward, mesh["ep"])


class _DispatchedForward:
    """The experts module's own forward, run on this rank's experts for the (token, choice) pairs routed to
    them from every rank of the ep group (module docstring)."""

    def __init__(self, module: nn.Module, forward, mesh: DeviceMesh) -> None:
        self.module, self.forward = module, forward
        self.group, self.ranks = mesh.get_group(), mesh.size()
        self.experts = expert_count(module)  # of the whole model
        self.local_experts = self.experts // self.ranks
        self.names = list(inspect.signature(forward).parameters)[:3]  # hidden states, choices, their weights

    def __call__(self, *args, **kwargs) -> Tensor:
        bound = dict(zip(self.names, args), **kwargs)
        hidden, choices, weights = (bound[name] for name in self.names)
        tokens = hidden.reshape(-1, hidden.shape[-1])
        choices = choices.reshape(tokens.shape[0], -1)
        per_token = choices.shape[1]
        pairs = choices.reshape(-1)
        order = torch.argsort(pairs, stable=True)  # pairs by expert, each expert's in token order
        token_of = order // per_token
        sent = torch.bincount(pairs, minlength=self.experts)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)  # counts: no gradient
        received = received.view(self.ranks, self.local_experts)
        # the split sizes, both ways, in one host read
        send_splits, receive_splits = torch.stack([sent.view(self.ranks, -1).sum(1), received.sum(1)]).tolist()
        arrived = _exchange(tokens[token_of], receive_splits, send_splits, self.group)
        arrived_weights = _exchange(weights.reshape(-1)[order], receive_splits, send_splits, self.group)
        # Each rank's pairs come sorted by expert: this rank's experts, numbered from 0, in that order.
        local_choices = torch.repeat_interleave(
            torch.arange(self.local_experts, device=pairs.device).repeat(self.ranks), received.reshape(-1))
        with _local_experts(self.module, self.local_experts, self.ranks):
            out = self.forward(arrived, local_choices.to(choices.dtype)[:, None], arrived_weights[:, None])
            if out.shape[0] == 0:  # no pair reached this rank's experts: their gradients are zeros, not missing
                out = out + sum(p.reshape(-1)[:0].sum() for p in vars(self.module).values() if isinstance(p, Tensor))
        back = _exchange(out, send_splits, receive_splits, self.group)
        combined = torch.zeros_like(tokens).index_add(0, token_of, back.to(tokens.dtype))
        return combined.reshape(hidden.shape)


def _exchange(tensor: Tensor, receive_splits: list[int], send_splits: list[int], group) -> Tensor:
    """All-to-all of ``tensor``'s rows (autograd-aware: the gradient goes back the reverse way)."""
    return all_to_all_single(tensor.contiguous(), receive_splits, send_splits, group)


@contextlib.contextmanager
def _local_experts(module: nn.Module, count: int, ranks: int):
    """While the module runs: its split weights seen as this rank's local tensors, their gradients scaled by
    1 / ``ranks`` (module docstring), and its ``num_experts`` the count this rank holds. Where tp's forward, around
    this one, shows them as local tensors already, those are scaled and put back after."""
    shown = {name: vars(module)[name] for name, _ in module.named_parameters(recurse=False) if name in vars(module)}
    local = {name: _GradientScaled.apply(shown[name] if name in shown else param.to_local(), 1.0 / ranks)
             for name, param in module.named_parameters(recurse=False) if isinstance(param, DTensor) or name in shown}
    for name in shown:
        del vars(module)[name]
    whole = module.num_experts
    module.num_experts = count
    try:
        with shadowed(module, local):
            yield
    finally:
        module.num_experts = whole
        vars(module).update(shown)


class _GradientScaled(torch.autograd.Function):
    """The tensor as it is, its gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None
