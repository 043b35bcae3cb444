"""Where NaNGuard looks at gradients: on the tensors the modules computed with, before any data-parallel reduction."""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_3d.common import local


class GradientChecks:
    """Records, for every gradient backward produces on this rank, whether it is finite -- before DDP or FSDP2
    reduces it over dp, so that the rank where a NaN/Inf first appears is the one that reports it.

    DDP computes gradients on the registered parameters, but FSDP2 (``fully_shard`` for ZeRO, ``replicate``
    for dp with tp or pp) swaps unsharded tensors into the modules before their forward and reduces the
    gradients of those into the registered (sharded) parameters: a hook on a registered parameter never fires
    there. So a forward pre-hook on every module that holds parameters hooks the tensors the module holds at
    that moment -- the ones autograd will differentiate -- each tensor once; the registered parameters are
    hooked too (DDP, and parameters used outside their module's forward).

    Whatever no hook saw is still checked, from ``param.grad`` after the reduction (where a NaN shows on every
    dp rank), with a warning: the checks cannot switch themselves off silently.
    """

    def __init__(self, root: nn.Module) -> None:
        self.active = False  # this step is checked
        self._checks: list[tuple[str, torch.Tensor]] = []  # (parameter, its gradient is finite), backward order
        self._hooked = WeakIdKeyDictionary()  # tensor -> its hook's handle
        self._warned = False
        # Under the name root.named_parameters() gives it (the first path to it, for a tied one).
        first_name: dict[int, str] = {}
        self._names: dict[tuple[int, str], str] = {}  # (id(module), parameter's name in it) -> name
        self._module_hooks = []
        for module_name, module in root.named_modules():
            held = list(module.named_parameters(recurse=False))
            for short, param in held:
                name = first_name.setdefault(id(param), f"{module_name}.{short}" if module_name else short)
                self._names[(id(module), short)] = name
                self._hook(param, name)
            if held:
                # prepend=False: runs after FSDP2's own pre-forward hook (prepended), which swaps its tensors in.
                self._module_hooks.append(module.register_forward_pre_hook(self._hook_module_tensors))

    def _hook_module_tensors(self, module: nn.Module, args) -> None:
        for short, tensor in module.named_parameters(recurse=False):
            name = self._names.get((id(module), short))
            if name is not None:  # None: a copy of the module (pipeline shape inference), or a parameter
                # added after training started
                self._hook(tensor, name)

    def _hook(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.requires_grad and tensor not in self._hooked:
            self._hooked[tensor] = tensor.register_hook(partial(self._record, name))

    def _record(self, name: str, grad: torch.Tensor) -> None:
        if self.active:
            # A sum is finite unless an element is not (or the fp32 sum overflows, past 3e38): one reduction,
            # no boolean copy of the gradient, and no host sync until the optimizer step.
            self._checks.append((name, torch.isfinite(local(grad).sum(dtype=torch.float32))))

    def first_not_finite(self, root: nn.Module, step: int) -> str | None:
        """The first parameter whose gradient was not finite in this step (those seen in backward, in backward
        order, then the others), or None; forgets this step's checks."""
        seen = {name for name, _ in self._checks}
        unseen = [(name, p.grad) for name, p in root.named_parameters() if p.grad is not None and name not in seen]
        if unseen:
            self._warn_unseen([name for name, _ in unseen], len(seen), step)
        checks = self._checks + [(name, torch.isfinite(local(grad).sum(dtype=torch.float32))) for name, grad in unseen]
        self._checks = []
        if not checks:
            return None
        finite = torch.stack([ok for _, ok in checks])
        return None if bool(finite.all()) else checks[int(finite.logical_not().nonzero()[0])][0]

    def _warn_unseen(self, unseen: list[str], seen: int, step: int) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"NaNGuard: at step {step}, {len(unseen)} parameters have a gradient that no hook saw as backward"
            f" produced it ({seen} others were seen), first {unseen[0]!r}. Their gradients are checked after the"
            " data-parallel reduction instead, where a NaN/Inf shows on every dp rank alike, so the rank it came"
            " from cannot be told for them. Parameters used outside their module's forward are not seen (use"
            " the module); otherwise this layout computes gradients on tensors the guard does not know: please"
            " report it with the layout.", RuntimeWarning, stacklevel=2)

    def remove(self) -> None:
        for handle in [*self._module_hooks, *self._hooked.values()]:
            handle.remove()
        self._module_hooks = []
        self._hooked = WeakIdKeyDictionary()
