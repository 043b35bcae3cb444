"""Where NaNGuard looks at gradients: on the tensors the modules computed with, before any data-parallel reduction."""

from __future__ import annotations

import warnings
import weakref
from functools import partial

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_3d.common import local
from lightning_3d.pipeline.grad_accumulation import is_accumulating


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

    Per gradient, one reduction as backward produces it (its float32 sum: finite unless an element is not, or
    the sum overflows past 3e38); the step's sums are checked together (:meth:`collect`), and only a step
    that was not finite reads them on the host to name the parameter (:func:`first_not_finite`).

    A pipeline stage's backwards before its last only accumulate (``pipeline/grad_accumulation.py``): their
    gradients are looked at once, at the last backward, as what the tensor holds plus that backward's. Where a
    layout keeps the accumulated gradient elsewhere than on the tensor (FSDP2 with a reduce dtype other than
    the parameters': its own fp32 buffer), the reduced gradients are also checked (:meth:`collect_reduced`),
    so a NaN/Inf is never missed, though its rank of origin may then be unknown.
    """

    def __init__(self, root: nn.Module) -> None:
        self.active = False  # this step is checked
        self._sums: list[tuple[str, torch.Tensor]] = []  # (parameter, its gradient's float32 sum), backward order
        self._hooked = WeakIdKeyDictionary()  # tensor -> its hook's handle
        self._warned = False
        self._deferred = False  # a backward of this step only accumulated: see collect_reduced
        # Under the name root.named_parameters() gives it (the first path to it, for a tied one).
        first_name: dict[int, str] = {}
        self._names: dict[tuple[int, str], str] = {}  # (id(module), parameter's name in it) -> name
        self._held: dict[int, list[weakref.ref]] = {}  # id(module) -> the tensors it held at its last forward
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
        # _parameters (private): named_parameters(recurse=False) builds a generator and a memo set per call,
        # which cost more than this whole check. Once a module's tensors are all hooked, the same ones come back
        # at every forward (in every layout but FSDP2's swaps), so that is looked at first.
        held = [(short, tensor) for short, tensor in module._parameters.items() if tensor is not None]
        last = self._held.get(id(module))
        if last is not None and len(last) == len(held) and all(ref() is t for ref, (_, t) in zip(last, held)):
            return
        all_hooked = True
        for short, tensor in held:
            name = self._names.get((id(module), short))
            if name is None:  # a copy of the module (pipeline shape inference), or a parameter added later
                all_hooked = False
                continue
            self._hook(tensor, name)
            all_hooked = all_hooked and tensor.requires_grad  # a frozen one may be unfrozen later: look again
        if all_hooked:
            self._held[id(module)] = [weakref.ref(tensor) for _, tensor in held]

    def _hook(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.requires_grad and tensor not in self._hooked:
            self._hooked[tensor] = tensor.register_hook(partial(self._record, name, weakref.ref(tensor)))

    def _record(self, name: str, tensor: weakref.ref, grad: torch.Tensor) -> None:
        if not self.active:  # no host sync here: the sums are looked at once, before the optimizer step
            return
        if is_accumulating():  # looked at with the stage's last backward, from what the tensor then holds
            self._deferred = True
            return
        held = tensor()
        accumulated = held.grad if held is not None else None  # the hook runs before this grad is added
        self._sums.append((name, _sum(grad) if accumulated is None else _sum(grad) + _sum(accumulated)))

    def collect(self, root: nn.Module, step: int) -> tuple[list[str], torch.Tensor | None]:
        """This step's gradients (those seen in backward, in backward order, then the others) and whether each
        was finite (a bool device tensor; None without gradients); forgets this step's sums."""
        seen = {name for name, _ in self._sums}
        unseen = [(name, p.grad) for name, p in root.named_parameters() if p.grad is not None and name not in seen]
        if unseen:
            self._warn_unseen([name for name, _ in unseen], len(seen), step)
        sums = self._sums + [(name, _sum(grad)) for name, grad in unseen]
        self._sums = []
        if not sums:
            return [], None
        return [name for name, _ in sums], torch.stack([value for _, value in sums]).isfinite()  # (gradients,)

    def collect_reduced(self, root: nn.Module) -> tuple[list[str], torch.Tensor | None]:
        """After the reduction, in a step where some backward only accumulated: every gradient's name and
        whether it is finite (None when no backward was deferred). A NaN/Inf shows here on every dp rank alike;
        it is the net under layouts that accumulate away from the tensors the hooks see (class doc)."""
        if not self._deferred:
            return [], None
        self._deferred = False
        named = [(name, local(p.grad)) for name, p in root.named_parameters() if p.grad is not None]
        if not named:
            return [], None
        largest = torch._foreach_norm([grad for _, grad in named], ord=float("inf"))  # per (device, dtype)
        return [name for name, _ in named], torch.stack(largest).isfinite()

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


def first_not_finite(names: list[str], finite: torch.Tensor) -> str | None:
    """The first of ``names`` whose ``finite`` flag is False, or None. It reads the flags on the host: for a step
    already known to hold a NaN/Inf."""
    bad = finite.logical_not().nonzero()
    return names[int(bad[0])] if len(bad) else None


def _sum(grad: torch.Tensor) -> torch.Tensor:
    return local(grad).sum(dtype=torch.float32)
