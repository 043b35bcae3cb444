"""Shape errors of the tensor-parallel model, said in the layout's terms before any block computes.

A policy splits a block's layers over tp ranks and sets the attributes it knows (heads per rank); module code
that reshapes by a size the policy did not change (a head count under a name it does not know, a width)
fails deep in the forward with PyTorch's bare ``shape '[16, 31, -1, 8]' is invalid``. Here, at the first call
of every block this rank holds, the block's own forward runs once on fake tensors -- PyTorch's
``FakeTensorMode``: shapes, dtypes and DTensor layouts without data, and no communication (the tp collectives
inside have fake kernels) -- with the inputs it was called with. If that fails, the error names the module,
the layout, this rank's sizes and what to change, and the real forward never starts.

Why at the first call and not at set-up: only then are the inputs known (the batch's shapes, and whatever
else the model hands its blocks: masks, rotary tables). Every stage of a pipeline checks the blocks it holds,
on its own tp rank's shapes; the first block of a stage runs during the pipeline's metadata inference, before
any micro-batch, and the other stages' ranks stop, naming the failing rank (tests/faults/test_bad_configs.py at
pp=2 x tp=2). Under Lightning's sanity check (on by default) the first call is an evaluation step, so the
error comes before the first training step. The modules before and after the blocks (embeddings, head) are
not checked: what tensor parallelism changes there (a vocabulary split) is checked against the config at
set-up.

The check must leave no trace: it draws no random numbers (fake tensors do not), puts back every attribute
the block's modules set on themselves, and gives the block deep copies of objects it may change in place (a
key/value cache); a block given an object that cannot be copied, or whose forward needs data (``.item()``),
is not checked.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import traceback
import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses import fake_tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from lightning_3d.common import join_fqn, local, parent_fqn
from lightning_3d.errors import ShardedShapeError
from lightning_3d.parallel.dims import ParallelDims, RankCoords
from lightning_3d.pipeline.split import held_modules
from lightning_3d.policies.base import Plan
from lightning_3d.policies.experts import ExpertsStandIn, experts_stood_in

log = logging.getLogger(__name__)

# Raised by fake tensors where an op needs data or is not supported without it: the check cannot tell, so it
# steps aside and the real forward runs.
CANNOT_CHECK = tuple(getattr(fake_tensor, name) for name in (
    "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
    "UnsupportedFakeTensorException", "UnsupportedMutationAliasingException", "FakeTensorDeviceMismatchError",
    "MetadataMismatchError") if hasattr(fake_tensor, name))


def check_shapes_at_first_call(module: nn.Module, plan: Plan, dims: ParallelDims, coords: RankCoords) -> None:
    """Arm a one-time shape check on each block of ``plan`` that ``module`` holds (nothing without a tp plan).

    Example (what the strategy does after preparing the model)::

        check_shapes_at_first_call(module, plan, dims, dims.coords(rank))
        module.model(tokens)  # raises ShardedShapeError naming e.g. model.layers.0.attention, if it cannot run
    """
    if not plan.tp_plan:
        return
    for fqn, block in held_modules(module, plan.blocks).items():
        _FirstCall(fqn, block, plan, dims, coords)


class _FirstCall:
    """The forward pre-hook that checks one block once, then removes itself. Registered after the layout's
    own pre-hooks (FSDP2 prepends its own), so it sees the inputs and parameters the block's forward gets."""

    def __init__(self, fqn: str, block: nn.Module, plan: Plan, dims: ParallelDims, coords: RankCoords) -> None:
        self.fqn, self.plan, self.dims, self.coords = fqn, plan, dims, coords
        self.handle = block.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        if any(isinstance(t, Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0]):
            return  # a placeholder's shape pass, not data: wait for the real call
        self.handle.remove()
        failure = _fake_forward(block, args, kwargs)
        if failure is not None:
            # Not chained: the fault report (lightning_3d.faults) names an exception's first cause, which
            # would be the bare shape error again; its line in the model's code is in the message instead.
            raise ShardedShapeError(self._explain(block, *failure)) from None

    def _explain(self, block: nn.Module, inner: str, error: Exception) -> str:
        if isinstance(block.get_submodule(inner), nn.Linear) and inner:  # its caller holds the sizes
            inner = parent_fqn(inner)
        fqn = join_fqn(self.fqn, inner) if inner else self.fqn
        failing = block.get_submodule(inner)
        d, c = self.dims, self.coords
        fixed = self.plan.attribute_fixes.get(fqn, {})
        attributes = ", ".join(
            f"{name}={value}" + (" (per rank, set by the policy)" if name in fixed else "")
            for name, value in vars(failing).items() if type(value) is int and not name.startswith("_")
        ) or "none"
        layers = ", ".join(filter(None, (_local_size(n, child) for n, child in failing.named_children()))) or "none"
        return (
            f"{fqn} ({type(failing).__name__}) cannot run on the shapes tensor parallelism gives it at layout"
            f" (dp, pp, tp) = ({d.dp}, {d.pp}, {d.tp}), on rank (dp={c.dp}, pp={c.pp}, tp={c.tp}):"
            f" {type(error).__name__}: {error}{_where(error)}\n"
            f"  its layers on this rank (in -> out features): {layers}\n"
            f"  its integer attributes: {attributes}\n"
            f"Most often a head count or width that the module reshapes by, but that the policy did not divide by"
            f" tp, fails this way. Name it in the policy's attribute_fixes (policy='auto' finds the ones its traced block"
            f" reshapes by; per-head sizes such as head_dim stay), or reshape with -1 heads, or use another tensor_parallel_size"
            f" (1 always fits). Found by running {self.fqn}'s forward on fake tensors before its first real call."
        )


def _fake_forward(block: nn.Module, args: tuple, kwargs: dict) -> tuple[str, Exception] | None:
    """Run ``block.forward`` on fake copies of the inputs: None if it ran (or cannot be checked), else the
    FQN inside ``block`` of the innermost module that was running, and the error."""
    try:
        # Objects the forward may change in place (a key/value cache) are copied: the real call keeps its own.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the real call warns about the same things, once
            args, kwargs = tree_map(_copy_object, (args, kwargs))
    except Exception as err:  # noqa: BLE001  (an object that cannot be copied: no check rather than a wrong one)
        log.debug("shape check of %s skipped: an input cannot be copied (%s)", type(block).__name__, err)
        return None
    running = [""]  # FQNs of the modules inside ``block`` whose forward has started, not ended
    hooks = []
    for name, sub in block.named_modules():
        if sub is not block:
            hooks.append(sub.register_forward_pre_hook(lambda *_, name=name: running.append(name) and None,
                                                       prepend=True))
            hooks.append(sub.register_forward_hook(lambda *_: running.pop() and None))  # not on error
    saved = [(sub, dict(vars(sub)), dict(sub._parameters), dict(sub._buffers)) for sub in block.modules()]
    mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)  # parameters stay real; reads only
    try:
        with mode, torch.no_grad(), warnings.catch_warnings(), experts_stood_in(block), _units_stood_in(block):
            warnings.simplefilter("ignore")
            fake_args, fake_kwargs = tree_map(lambda x: _fake(mode, x), (args, kwargs))
            block.forward(*fake_args, **fake_kwargs)  # forward, not __call__: its pre-hooks have run
        return None
    except CANNOT_CHECK as err:
        log.debug("shape check of %s skipped: %s", type(block).__name__, err)
        return None
    except Exception as err:  # noqa: BLE001  (any error of the fake forward is the real forward's too)
        return running[-1], err
    finally:
        for hook in hooks:
            hook.remove()
        # Module code may assign to itself in forward (a buffer moved to the input's dtype): put back what
        # the block held, so no fake tensor outlives the check.
        for sub, attributes, parameters, buffers in saved:
            vars(sub).clear()
            vars(sub).update(attributes)
            sub._parameters.clear()
            sub._parameters.update(parameters)
            sub._buffers.clear()
            sub._buffers.update(buffers)


@contextlib.contextmanager
def _units_stood_in(block: nn.Module):
    """FSDP2 units inside the block (the experts of an expert-parallel layer) replaced in their parents by stand-ins
    without FSDP's hooks, whose pre-forward would unshard them into fake tensors and keep those."""
    units = [(parent, name, child) for parent in block.modules() for name, child in parent.named_children()
             if isinstance(child, FSDPModule)]
    for parent, name, child in units:
        setattr(parent, name, ExpertsStandIn(child))
    try:
        yield
    finally:
        for parent, name, child in units:
            setattr(parent, name, child)


def _copy_object(value: Any) -> Any:
    if value is None or isinstance(value, (Tensor, bool, int, float, str, torch.dtype, torch.device)):
        return value
    return copy.deepcopy(value)


def _where(error: Exception) -> str:
    """`` (at FILE:LINE: CODE)`` of the innermost frame outside torch and lightning_3d: the model's line."""
    ours = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(ours)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""


def _fake(mode: fake_tensor.FakeTensorMode, value: Any) -> Any:
    if isinstance(value, Tensor) and not isinstance(value, DTensor):
        return mode.from_tensor(value.detach())  # (no_grad: its autograd history is not needed)
    return value  # DTensors (sequence-parallel inputs) are read through the mode like parameters


def _local_size(name: str, child: nn.Module) -> str:
    weight = getattr(child, "weight", None)
    if not isinstance(child, nn.Linear) or weight is None:
        return ""
    out_features, in_features = local(weight).shape
    return f"{name} {in_features} -> {out_features} (of {child.in_features} -> {child.out_features})"
